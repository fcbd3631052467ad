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
ends it (`stop`) at once (`batch_step.read_step`).

The masked choice costs as little dispatch as it can (`structured/masked_choice`): a greedy row
whose mask allows a single token takes it with no device work; other greedy rows share one
fused masked argmax (two kernels). When every row of the step is such a greedy row, the step's
tokens come whole, without gathering a piece per row (a kernel each): from the host when every
mask forces its token, else from one masked argmax over every row.

A row whose grammar cannot go on (`GrammarViolation` computing its mask) fails alone: its
`failure` is set and reported at the next read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

from trio_mlx.engine.decode import PendingToken
from trio_mlx.engine.sampling import logprob_arrays
from trio_mlx.structured import masked_choice
from trio_mlx.structured.matcher import GrammarViolation, allowed_words_of

if TYPE_CHECKING:
    from trio_mlx.engine.batch_sequence import BatchSequence
    from trio_mlx.engine.batch_step import QueuedStep


class RowChooser(Protocol):
    """`BatchChoice.row` (`batch_choice`): row `i`'s token (shape (1,), lazy) from its logits `raw`
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

    Their masks are computed together (in parallel). Rows that are greedy with nothing but the
    mask shaping their choice take the token their mask forces, when it allows only one, with
    no device work (`masked_choice.forced_tokens`); the others of them are chosen by one masked
    argmax (`masked_choice.masked_argmax`). Every other constrained row is chosen on its own
    (`choose_row`, which masks with `masked_choice.masked_logits`)."""
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
    known: dict[int, int] = {}  # rows whose token the host has: forced, failed or gone
    if simple:
        width = queued.logits.shape[-1]
        forced = masked_choice.forced_tokens(np.concatenate([masks[i] for i in simple]), width)
        known = {i: token for i, token in zip(simple, forced, strict=True) if token is not None}
        for i in simple:
            queued.rows[i].forced_last = i in known
        if len(simple) == len(pieces) and len(known) < len(simple):
            # Every row is of these and some are not forced: one masked argmax over the whole
            # step (it picks the forced tokens too) beats gathering a piece per row.
            known = {}
        _log_forced(queued, known)
    argmax_rows = [i for i in simple if i not in known]
    chosen = _choose_greedy_masked(queued, argmax_rows, masks) if argmax_rows else None
    taken = set(argmax_rows)
    for i in waiting:
        if i in known or i in taken:
            continue
        seq = queued.rows[i]
        row_words = masks.get(i)
        if row_words is None:
            assert seq.grammar is not None
            try:
                row_words = seq.grammar.allowed_words()[None]
            except GrammarViolation as exc:
                seq.failure = f"{type(exc).__name__}: {exc}"
                known[i] = 0
                continue
        raw = queued.logits[i : i + 1]
        pieces[i] = choose_row(i, seq, raw, None, queued.logprobs, row_words)
    if chosen is not None and len(argmax_rows) == len(pieces):
        tokens = chosen  # every row chosen by the one masked argmax
    else:
        if chosen is not None:
            for k, i in enumerate(argmax_rows):
                pieces[i] = chosen[k : k + 1]
        tokens = _step_tokens(pieces, known)
    queued.tokens = tokens
    queued.logits = queued.pieces = None
    mx.async_eval(tokens, *(a for p in queued.logprobs.values() for a in p.arrays()))
    return tokens


def _log_forced(queued: QueuedStep, known: dict[int, int]) -> None:
    """The logprob arrays of rows whose token their mask forced (the model's own logprobs,
    from the raw logits, as for any other row)."""
    for i, token in known.items():
        params = queued.rows[i].job.params
        if params.logprobs:
            chosen = mx.array([token], dtype=mx.uint32)
            raw = queued.logits[i : i + 1]
            picked, ids, values = logprob_arrays(raw, chosen, params.top_logprobs)
            queued.logprobs[i] = PendingToken(chosen, picked, ids, values)


def _choose_greedy_masked(queued: QueuedStep, rows: list[int], masks: dict[int, Any]) -> Any:
    """One masked argmax for the constrained `rows` of `queued` (greedy, nothing else shaping
    their choice): their tokens, shape (len(rows),), lazy; their logprob arrays added."""
    logits = queued.logits
    if len(rows) < logits.shape[0]:  # not every row of the step: theirs
        logits = logits[rows[0] : rows[0] + 1] if len(rows) == 1 else logits[mx.array(rows)]
    chosen = masked_choice.masked_argmax(logits, np.concatenate([masks[i] for i in rows]))
    for k, i in enumerate(rows):
        params = queued.rows[i].job.params
        if params.logprobs:
            token = chosen[k : k + 1]
            raw = queued.logits[i : i + 1]
            picked, ids, values = logprob_arrays(raw, token, params.top_logprobs)
            queued.logprobs[i] = PendingToken(token, picked, ids, values)
    return chosen


def _step_tokens(pieces: list[Any], known: dict[int, int]) -> Any:
    """The step's tokens (shape (B,)) from each row's piece (shape (1,), lazy) or, for the rows
    in `known` and rows gone since the step was queued (whose token is never read: 0), the
    token on the host. Only host tokens: one small copy to the device, no kernel."""
    if all(p is None for p in pieces):
        return mx.array([known.get(i, 0) for i in range(len(pieces))], dtype=mx.uint32)
    return mx.concatenate(
        [
            mx.array([known.get(i, 0)], dtype=mx.uint32) if p is None else p
            for i, p in enumerate(pieces)
        ]
    )


def _greedy_alone(seq: BatchSequence) -> bool:
    """Greedy with no processor, penalty or bias: only its grammar's mask shapes its choice."""
    return not seq.processors and seq.selector.batch_greedy and seq.selector.bias is None
