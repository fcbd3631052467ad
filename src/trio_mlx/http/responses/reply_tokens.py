"""Which of a Responses reply's tokens wrote its text, its reasoning, or a function call's markup.

A message's `output_text` logprobs are its text's tokens, and `usage.output_tokens_details.
reasoning_tokens` counts the reasoning's; the engine gives the reply's tokens and its pieces of
text apart, so `ReplyTokens` matches them up, the same way for a stream and a whole response.
"""

from __future__ import annotations

from trio_mlx.http.generation import TokenText
from trio_mlx.tools import ArgumentsAppended, CallStarted, Content, Reasoning, ToolEvent


class ReplyTokens:
    """Which of the reply's tokens wrote its text (`output_text` and its logprobs), its
    reasoning (`reasoning_tokens`), or a function call's markup.

    Tokens wait (`note`) for the pieces their text makes (`read`), however many one output
    carries. A piece of text or reasoning takes the waiting tokens up to the end of its text,
    found in theirs (each token's text decoded alone); those before its text held what lies
    between two kinds: a thinking tag (the reasoning's) or the end of a call's markup (no
    one's). A token whose text begins in a piece and ends in what follows (`.<` before
    `<tool_call>`) goes with the piece. Where the piece's text is not found in the tokens'
    (a character split between tokens decodes apart as U+FFFD), it takes every token waiting.
    The tokens left at the end (`end`: an end-of-sequence token, a stop string, which wrote
    nothing of their own) go with what came last, text or reasoning. So without tools or
    reasoning the text has every token, as chat's `logprobs` do.

    `plain`: the reply has no tools (tokens that wrote nothing at all go with the text).
    `simple`: nothing to tell apart (no reasoning, and no tools or nobody asking): a piece of
    text takes every token waiting, none is decoded."""

    def __init__(self, text: TokenText, *, plain: bool, simple: bool = False) -> None:
        self._text = text
        self._plain = plain
        self._simple = simple
        self._waiting: list[tuple[int, int]] = []  # (position in the reply, token id)
        self._count = 0
        self._last = "start"  # what the last piece was: start, text, reasoning or call
        #: The positions of the text's tokens, and how many tokens the reasoning took.
        self.text: list[int] = []
        self.reasoning = 0

    def note(self, tokens: list[int]) -> None:
        self._waiting += [(self._count + i, token) for i, token in enumerate(tokens)]
        self._count += len(tokens)

    def read(self, event: ToolEvent) -> list[int]:
        """The positions of the tokens that wrote `event`, a piece of text ([] for others)."""
        if isinstance(event, CallStarted | ArgumentsAppended):
            self._last = "call"
            return []
        if not isinstance(event, Content | Reasoning):
            return []
        if not event.text:
            return []
        kind = "text" if isinstance(event, Content) else "reasoning"
        lead: list[tuple[int, int]] = []
        if self._simple:
            taken, self._waiting = self._waiting, []
        else:
            lead, taken = self._take(event.text)
        # What lay before the piece's text: a thinking tag, the end of a call's markup.
        between = "reasoning" if "reasoning" in (kind, self._last) else None
        if self._last != "call" and between is None:
            between = "text"
        self._last = kind
        positions: list[int] = []
        for group, owner in ((lead, between), (taken, kind)):
            if owner == "reasoning":
                self.reasoning += len(group)
            elif owner == "text":
                positions += [position for position, _ in group]
        self.text += positions
        return positions

    def end(self) -> list[int]:
        """The positions of the tokens left at the end, if they go with the text."""
        waiting, self._waiting = self._waiting, []
        if self._last == "reasoning":
            self.reasoning += len(waiting)
        if self._last == "text" or (self._last == "start" and self._plain):
            return [position for position, _ in waiting]
        return []

    def _take(self, text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Take the waiting tokens up to the end of `text`: those before it, those of it."""
        starts = []
        written = ""
        for _, token in self._waiting:
            starts.append(len(written))
            written += self._text(token)
        found = _find(written, text, set(starts))
        if found < 0:
            taken, self._waiting = self._waiting, []
            return [], taken
        ends = [*starts[1:], len(written)]
        lead = sum(1 for end in ends if end <= found)
        rest = sum(1 for start in starts if start >= found + len(text))
        cut = len(self._waiting) - rest
        waiting, self._waiting = self._waiting[:cut], self._waiting[cut:]
        return waiting[:lead], waiting[lead:]


def _find(written: str, text: str, starts: set[int]) -> int:
    """Where `text` is in `written`: its first place at the start of a token, else its first
    place; -1 when it is not there."""
    first = found = written.find(text)
    while found >= 0 and found not in starts:
        found = written.find(text, found + 1)
    return found if found >= 0 else first
