"""A thinking-token budget for reasoning models, as a logits processor that retires.

While the model is thinking (after its think-start tokens, or from the first token when the prompt
already opened the thinking), the processor counts the tokens generated. When `budget` is spent it
forces the think-end tokens, one per step, and retires; it also retires as soon as the model ends
its thinking by itself, or starts its answer without thinking. After it retires it is never called
again, so decoding goes back to full speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx


class ThinkingBudget:
    """`(tokens, logits) -> logits` processor; see the module docstring.

    `think_start` / `think_end` are the token ids of the tags (one or more tokens each);
    `prompt_length` tells which of the `tokens` it is given were generated; `open_in_prompt` says
    whether the prompt itself opened the thinking (decided on the prompt's text, since a tag
    inside a prompt may be tokenized differently from the tag alone).
    """

    def __init__(
        self,
        budget: int,
        think_start: Sequence[int],
        think_end: Sequence[int],
        prompt_length: int,
        open_in_prompt: bool,
    ) -> None:
        if budget < 0:
            raise ValueError("the thinking budget must be >= 0")
        if not think_end:
            raise ValueError("think_end must have at least one token")
        self.budget = budget
        self._start = list(think_start)
        self._end = list(think_end)
        self._prompt_length = prompt_length
        self._seen = 0  # how many of `tokens` have been looked at
        self._thinking = open_in_prompt
        self._thought = 0  # tokens generated while thinking
        self._forcing: int | None = None  # index into think_end being forced
        self._recent: list[int] = []
        self.calls = 0
        self.is_retired = False

    def __call__(self, tokens: Any, logits: Any) -> Any:
        self.calls += 1
        new = tokens[self._seen :].tolist() if self._seen < tokens.shape[0] else []
        first = self._seen
        self._seen += len(new)
        for position, token in enumerate(new, start=first):
            if position < self._prompt_length:
                continue
            self._observe(token, generated=position - self._prompt_length + 1)
            if self.is_retired:
                return logits
        if self._forcing is not None:
            return _force(logits, self._end[self._forcing])
        if self._thinking and self._thought >= self.budget:
            self._forcing = 0
            return _force(logits, self._end[0])
        return logits

    def _observe(self, token: int, generated: int) -> None:
        self._recent = [*self._recent, token][-max(len(self._start), len(self._end)) :]
        if self._forcing is not None:
            self._forcing += 1
            if self._forcing >= len(self._end):
                self.is_retired = True
            return
        if self._thinking:
            self._thought += 1
            if self._recent[-len(self._end) :] == self._end:
                self.is_retired = True  # the model ended its thinking itself
        elif self._start and self._recent[-len(self._start) :] == self._start:
            self._thinking = True
        elif not self._start or generated >= len(self._start):
            self.is_retired = True  # answering without thinking


def _force(logits: Any, token: int) -> Any:
    """Logits (same shape) under which `token` is the only possible choice."""
    mask = mx.arange(logits.shape[-1]) == token
    return mx.where(mask, 0.0, float("-inf")).astype(logits.dtype).reshape(logits.shape)
