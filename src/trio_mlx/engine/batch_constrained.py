"""Constrained rows of the decode batch: choosing the tokens of rows whose job has a `grammar`
(each row its own `GrammarMatcher`). Runs on the runner thread only, for `BatchDecoder.decode`.

A row's mask for step k depends on its token of step k - 1, which is read only after step k's
forward pass has been queued. So `decode()` queues step k's forward pass with every
unconstrained row's choice (the batched argmax for plain rows, unchanged) and leaves the
constrained rows' places empty (`QueuedStep.pieces`), reads step k - 1 (advancing each
constrained row's matcher with its token), then calls `choose_constrained`: the constrained
rows' masks are computed on the CPU (together, in parallel, while the device runs the forward
pass) and their masked choices, and so the next step's inputs, are queued behind it.
Unconstrained rows never wait for a mask; a constrained row's token that completes its grammar
ends it (`stop`) at once (`BatchDecoder._read`).

A row whose grammar cannot go on (`GrammarViolation` computing its mask) fails alone: its
`failure` is set and reported at the next read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from trio_mlx.engine.decode import PendingToken
from trio_mlx.engine.sampling import logprob_arrays
from trio_mlx.structured.matcher import GrammarViolation, allowed_words_of, apply_token_mask

if TYPE_CHECKING:
    from trio_mlx.engine.batch import QueuedStep
    from trio_mlx.engine.batch_sequence import BatchSequence


class RowChooser(Protocol):
    """`BatchDecoder._choose_row`: row `i`'s token (shape (1,), lazy) from its logits `raw`
    under the mask `words`, its logprob arrays added to `logprobs`."""

    def __call__(
        self,
        i: int,
        seq: BatchSequence,
        raw: Any,
        greedy: Any,
        logprobs: dict[int, Any],
        words: Any = None,
    ) -> Any: ...


def choose_constrained(queued: QueuedStep, choose_row: RowChooser) -> Any:
    """Choose the constrained rows' tokens of `queued` (its forward pass already on the device,
    the previous step read) and queue the step's tokens; return them (shape (B,), lazy; also
    `queued.tokens`): the next step's inputs.

    Their masks are computed together (in parallel); rows that are greedy with nothing else to
    apply are chosen by one masked argmax, the others each on their own row (`choose_row`)."""
    pieces = queued.pieces
    assert pieces is not None
    waiting = [i for i, p in enumerate(pieces) if p is None and not queued.rows[i].removed]
    masks: dict[int, Any] = {}
    if waiting:
        matchers = [queued.rows[i].grammar for i in waiting]
        try:
            words = allowed_words_of(matchers)  # type: ignore[arg-type]
            masks = {i: words[j : j + 1] for j, i in enumerate(waiting)}
        except GrammarViolation:
            pass  # each row finds its own failure below
    simple = [i for i in waiting if i in masks and _greedy_alone(queued.rows[i])]
    if len(simple) > 1:
        _choose_greedy_masked(queued, simple, masks)
    for i in waiting:
        if pieces[i] is not None:
            continue
        seq = queued.rows[i]
        row_words = masks.get(i)
        if row_words is None:
            assert seq.grammar is not None
            try:
                row_words = seq.grammar.allowed_words()[None]
            except GrammarViolation as exc:
                seq.failure = f"{type(exc).__name__}: {exc}"
                pieces[i] = mx.zeros((1,), dtype=mx.uint32)
                continue
        raw = queued.logits[i : i + 1]
        pieces[i] = choose_row(i, seq, raw, None, queued.logprobs, row_words)
    for i, piece in enumerate(pieces):
        if piece is None:  # left since (finished or aborted): its token is never read
            pieces[i] = mx.zeros((1,), dtype=mx.uint32)
    tokens = mx.concatenate(pieces)
    queued.tokens = tokens
    queued.logits = queued.pieces = None
    mx.async_eval(tokens, *(a for p in queued.logprobs.values() for a in p.arrays()))
    return tokens


def _choose_greedy_masked(queued: QueuedStep, rows: list[int], masks: dict[int, Any]) -> None:
    """One masked argmax for the constrained `rows` of `queued` (greedy, nothing else)."""
    import numpy as np

    pieces = queued.pieces
    assert pieces is not None
    words = np.concatenate([masks[i] for i in rows])
    masked = apply_token_mask(queued.logits[mx.array(rows)], words)
    chosen = mx.argmax(masked, -1).astype(mx.uint32)
    for k, i in enumerate(rows):
        token = chosen[k : k + 1]
        pieces[i] = token
        params = queued.rows[i].job.params
        if params.logprobs:
            raw = queued.logits[i : i + 1]
            picked, ids, values = logprob_arrays(raw, token, params.top_logprobs)
            queued.logprobs[i] = PendingToken(token, picked, ids, values)


def _greedy_alone(seq: BatchSequence) -> bool:
    """Greedy with no processor, penalty or bias: only its grammar's mask shapes its choice."""
    return not seq.processors and seq.selector.batch_greedy and seq.selector.bias is None
