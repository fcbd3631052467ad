"""One step of the decode batch: its forward pass queued on the device, then its tokens read.
Runs on the runner thread only, for `BatchDecoder.decode` (and the lone row's steps, `jump`,
`speculate`, and a lone request with media's first token, which read a step the same way).

`BatchDecoder.decode()` is one step for every row: rows removed since the last step (finished,
aborted, failed) leave the batch (`batch_leave`); the next step's forward pass is queued on the
device (`feed`, `forward`, `queue_tokens`: `mx.async_eval`); then the previous step's tokens are
read (`read_step`) and returned. So the device computes step k while the host reads step k - 1 and
builds step k + 1 (the pipelining of mlx-lm's `GenerationBatch`); a finished row costs one wasted
row in the step already queued (`spent_rows`). Where `dispatch_order` defers, the step is built
but queued only after the previous step's tokens are read and handed over
(`QueuedStep.dispatch`, `BatchDecoder.dispatch_pending`). Where pipelining does not pay
(`pipelining_pays` False: MLX's CPU backend, whose `async_eval` computes most of a step before it
returns, so a step queued before the last one is read delays every token by a step and computes a
wasted step for every finish), each step is read as soon as it is queued, its tokens the rows'
`pending` inputs of the next.

Token accounting: at every call boundary a row's cache holds `fed_tokens()`: the prompt tokens
processed and the generated tokens read so far (each token read has already been fed to the step
queued before it was read, so an EOS and the last token of a `max_tokens` finish are fed, which
differs from the serialized route: the snapshots' keys say exactly what they hold either way).

Errors: a processor or sampler that raises fails its row only (its `failure`, reported by the
read); a constrained row whose grammar refuses its token fails alone at the read; whatever else
these functions raise (the forward pass, its evaluation) the decoder attributes to every row of
the step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from trio_mlx.engine.batch_choice import BatchChoice
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.compiled_step import CompiledDecode
from trio_mlx.engine.decode import PendingToken, read_logprobs
from trio_mlx.engine.dispatch_order import DispatchOrder
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.structured.matcher import GrammarViolation
from trio_mlx.types import TokenLogprob


@dataclass(frozen=True)
class RowResult:
    """What one step produced for one sequence: a token (none on EOS or failure), a finish."""

    seq: BatchSequence
    tokens: tuple[int, ...] = ()
    finish: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None


class QueuedStep:
    """A queued decode step: its rows (in row order) and their lazy outputs. While constrained
    rows wait for their masks, `tokens` is None and `pieces` holds every other row's token
    (None for the constrained ones), `logits` the step's logits (`batch_constrained`)."""

    __slots__ = ("dispatched", "logits", "logprobs", "pieces", "rows", "tokens")

    def __init__(
        self,
        rows: list[BatchSequence],
        tokens: Any,
        logprobs: dict[int, PendingToken],
        *,
        logits: Any = None,
        pieces: list[Any] | None = None,
        dispatched: bool = True,
    ) -> None:
        self.rows = rows
        self.tokens = tokens
        self.logprobs = logprobs
        self.logits = logits
        self.pieces = pieces
        #: whether its arrays are queued on the device (`dispatch`); False: built only
        #: (`queue_tokens` with an `order` that defers it: `dispatch_order`)
        self.dispatched = dispatched

    def dispatch(self) -> None:
        """Queue the step's tokens and log-probabilities on the device, if not yet."""
        if not self.dispatched:
            mx.async_eval(self.tokens, *(a for p in self.logprobs.values() for a in p.arrays()))
            self.dispatched = True


def pipelining_pays() -> bool:
    """Whether queuing the next step before reading the last one overlaps anything: on a GPU
    the device computes while the host builds; MLX's CPU backend computes a step inside
    `async_eval` (SmolLM2-135M: ~97 of its ~124 ms there), so queuing first only makes every
    token wait for the next step. `TRIO_MLX_BATCH_PIPELINE` `on` / `off` overrides."""
    forced = os.environ.get("TRIO_MLX_BATCH_PIPELINE", "").strip().lower()
    if forced in ("on", "off"):
        return forced == "on"
    return bool(mx.default_device() == mx.gpu)


def spent_rows(rows: list[BatchSequence], in_flight: QueuedStep | None) -> frozenset[int]:
    """The rows (indices) whose token in the step still in flight (`in_flight`, not yet read)
    is their last by `max_tokens`: the step being queued is wasted on them (it is never read),
    so their processors and selector must not see it (`batch_choice`). Empty unless pipelined."""
    if in_flight is None:
        return frozenset()
    queued = {id(seq) for seq in in_flight.rows}
    return frozenset(
        i
        for i, seq in enumerate(rows)
        if not seq.plain and id(seq) in queued and seq.generated + 1 >= seq.job.params.max_tokens
    )


def feed(rows: list[BatchSequence]) -> None:
    """The step about to be queued feeds every row its input: its prompt is done, and a token
    read but not yet fed (`pending`, a step read at once) counts as fed from here."""
    for seq in rows:
        seq.prompt_done = len(seq.job.prompt_tokens)
        if seq.pending is not None:
            seq.fed_generated.append(seq.pending)
            seq.pending = None


def forward(
    model: Any,
    rows: list[BatchSequence],
    inputs: Any,
    cache: list[Any],
    *,
    own: Any,
    compiled: CompiledDecode | None,
    lean: LeanStep | None = None,
    lean_rows: LeanStep | None = None,
) -> Any:
    """The step's forward pass over `inputs` (one token a row) on the batch's `cache`; return
    its logits (shape (rows, vocab), lazy). The model it takes: `own`, a lone row's own model
    (`batch_lone_media.lone_step_model`), where given; else `lean`, a lone row's lean step
    (`lean_step`), where its cache fits it and it is at no rope delta; else the traced batch
    step where the cache fits it and no row is at a rope delta; else `lean_rows`, the lean step
    over the batch's cache (`LeanStep.batch_logits`), where given and no row is at a rope delta;
    else `model`, with each row's delta where any row continues a prompt with media
    (`BatchSequence.rope_delta`)."""
    shifted = any(seq.rope_delta for seq in rows)
    if own is not None:
        return own(inputs[:, None], cache=cache)[:, -1, :]
    if lean is not None and len(rows) == 1 and not shifted and lean.fits(cache):
        return lean.logits(inputs, cache)
    if not shifted and compiled is not None and compiled.batch_fits(cache):
        return compiled.batch_logits(inputs, cache)
    if not shifted and lean_rows is not None:
        return lean_rows.batch_logits(inputs, cache)
    if shifted:
        deltas = mx.array([seq.rope_delta for seq in rows], dtype=mx.int32)
        return model(inputs[:, None], cache=cache, row_deltas=deltas)[:, -1, :]
    return model(inputs[:, None], cache=cache)[:, -1, :]


def queue_tokens(
    rows: list[BatchSequence],
    logits: Any,
    choice: BatchChoice,
    spent: frozenset[int],
    *,
    order: DispatchOrder | None = None,
) -> QueuedStep:
    """Choose every row's token from the step's `logits` and queue them on the device. With a
    constrained row among `rows`, only the other rows' tokens (`QueuedStep.pieces`): the
    constrained ones wait for their masks (`batch_constrained.choose_constrained`); else the
    step's `tokens`, the next step's inputs, queued unless `order` defers them (then built,
    for `QueuedStep.dispatch` to queue). A step with constrained rows is queued at once, and
    `order` is not asked (their masks are computed while it runs)."""
    if any(seq.grammar is not None for seq in rows):
        pieces, logprobs = choice.pieces(rows, logits, skip_constrained=True, spent=spent)
        ready = [p for p in pieces if p is not None]
        mx.async_eval(logits, *ready, *(a for p in logprobs.values() for a in p.arrays()))
        return QueuedStep(rows, None, logprobs, logits=logits, pieces=pieces)
    tokens, logprobs = choice.tokens(rows, logits, spent)
    queued = QueuedStep(rows, tokens, logprobs, dispatched=False)
    if order is None or not order.defer():
        queued.dispatch()
    return queued


def read_step(
    queued: QueuedStep,
    *,
    eos: frozenset[int],
    choice: BatchChoice,
    finish_row: Callable[[BatchSequence], None],
    fed: bool = True,
) -> list[RowResult]:
    """The tokens of a queued step, one result a row not removed since; `fed`: the step after
    it is queued already (so they are in the cache), else each row's token is its `pending`
    input. A row that finishes (EOS, its grammar done, `max_tokens`) goes to `finish_row`; a row
    that failed (`failure`, or its grammar refusing its token) is removed with an error. Raises
    what evaluating the step raises."""
    mx.eval(queued.tokens)
    values = queued.tokens.tolist()
    results: list[RowResult] = []
    for i, seq in enumerate(queued.rows):
        if seq.removed:
            continue  # aborted since: nothing more to say
        token = int(values[i])
        if fed:
            seq.fed_generated.append(token)
        else:
            seq.pending = token
        if seq.failure is not None:
            seq.removed = True
            results.append(RowResult(seq, finish="error", error=seq.failure))
            continue
        pending = queued.logprobs.get(i)
        logprobs = (read_logprobs(token, pending),) if pending is not None else ()
        if seq.processors:
            seq.processors = [p for p in seq.processors if not getattr(p, "is_retired", False)]
            if not seq.processors:
                choice.rows_changed()
        finish: str | None = None
        tokens: tuple[int, ...] = ()
        if token in eos:
            finish = "stop"
            logprobs = ()
        else:
            if seq.grammar is not None:
                try:
                    seq.grammar.consume(token)
                except GrammarViolation as exc:
                    seq.removed = True
                    results.append(RowResult(seq, finish="error", error=str(exc)))
                    continue
            seq.generated += 1
            tokens = (token,)
            if seq.grammar is not None and seq.grammar.done:
                finish = "stop"
            elif seq.generated >= seq.job.params.max_tokens:
                finish = "length"
        if finish is not None:
            finish_row(seq)
        results.append(RowResult(seq, tokens, finish, logprobs))
    return results
