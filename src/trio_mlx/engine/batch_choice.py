"""Each row's token from a decode step's logits. Runs on the runner thread only, for
`BatchDecoder.decode` (and `batch_constrained`, through `BatchChoice.row`).

Per sequence, as on the serialized route (`decode.ActiveSequence`): its `TokenSelector` (sampling
parameters, penalties, logit bias, its own PRNG key, so a seeded request draws the same tokens
whatever its companions), its logits processors called on its own row of logits (shape (1, vocab))
until they retire, its grammar's mask where it has one (`masked_choice.masked_logits`), its
logprobs. Rows that are greedy without processors or penalties (`BatchSequence.plain`; logit bias
allowed) are chosen by one batched argmax, their biases stacked into one matrix that is rebuilt
only when the rows change (`rows_changed`: the batch's rows changed, or a row's processors
retired).

Spent rows (`spent`: row indices whose token in flight is their last, in a pipelined batch that
queues the next step before reading the last) are chosen by their logits' argmax alone: their
token is never read, and their processors, selector and history see no call for it, as on the
serialized route.

Errors: a processor or sampler that raises fails its row only: its `failure` is set (the decoder
reports it at the next read) and its token meanwhile is its logits' argmax.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.decode import PendingToken
from trio_mlx.engine.sampling import logprob_arrays
from trio_mlx.structured import masked_choice


class BatchChoice:
    """The token choice of the decode batch's rows (see the module docstring)."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab = vocab_size
        self._bias: Any = None
        self._bias_stale = True

    def rows_changed(self) -> None:
        """The batch's rows, or which of them are plain, changed: rebuild the bias matrix."""
        self._bias_stale = True

    def tokens(
        self, rows: list[BatchSequence], logits: Any, spent: frozenset[int] = frozenset()
    ) -> tuple[Any, dict[int, Any]]:
        """The next token of every row (shape (B,), lazy), and the rows' logprob arrays."""
        greedy: Any = None
        if any(s.plain for s in rows):
            bias = self._bias_matrix(rows, logits.shape[-1])
            greedy = mx.argmax(logits if bias is None else logits.astype(mx.float32) + bias, -1)
        if all(s.plain and not s.job.params.logprobs for s in rows):
            return greedy, {}
        pieces, logprobs = self.pieces(rows, logits, greedy=greedy, spent=spent)
        return mx.concatenate(pieces), logprobs

    def first(self, seq: BatchSequence, logits: Any) -> tuple[Any, dict[int, Any]]:
        """The token of `seq` alone (not a row of the batch: its first token, from its prompt's
        last pass, `batch_lone_media`) from its `logits` (shape (1, vocab)), chosen as a row's
        would be (a plain row: the argmax with its bias; else `row`), and its logprob arrays
        (keyed 0). The batch's stacked biases are left as they are."""
        greedy: Any = None
        if seq.plain:
            bias = seq.selector.bias if logits.shape[-1] == self._vocab else None
            greedy = mx.argmax(logits if bias is None else logits.astype(mx.float32) + bias, -1)
        logprobs: dict[int, Any] = {}
        return self.row(0, seq, logits, greedy, logprobs), logprobs

    def pieces(
        self,
        rows: list[BatchSequence],
        logits: Any,
        *,
        greedy: Any = None,
        skip_constrained: bool = False,
        spent: frozenset[int] = frozenset(),
    ) -> tuple[list[Any], dict[int, Any]]:
        """Each row's token (shape (1,), lazy; None for a constrained row when
        `skip_constrained`; the argmax alone for a `spent` row) and the rows' logprob arrays."""
        if greedy is None and any(s.plain for s in rows):
            bias = self._bias_matrix(rows, logits.shape[-1])
            greedy = mx.argmax(logits if bias is None else logits.astype(mx.float32) + bias, -1)
        pieces: list[Any] = []
        logprobs: dict[int, Any] = {}
        for i, seq in enumerate(rows):
            if skip_constrained and seq.grammar is not None:
                pieces.append(None)
                continue
            if i in spent:
                pieces.append(mx.argmax(logits[i : i + 1], -1).astype(mx.uint32))
                continue
            pieces.append(self.row(i, seq, logits[i : i + 1], greedy, logprobs))
        return pieces, logprobs

    def row(
        self,
        i: int,
        seq: BatchSequence,
        raw: Any,
        greedy: Any,
        logprobs: dict[int, Any],
        words: Any = None,
    ) -> Any:
        """Row `i`'s token (shape (1,), lazy): from the batched argmax `greedy` for a plain row,
        else sampled from its logits `raw` under the mask `words`; its logprob arrays are added
        to `logprobs`."""
        try:
            token = greedy[i : i + 1] if seq.plain else _sample(seq, raw, words)
            if seq.job.params.logprobs:
                chosen, ids, values = logprob_arrays(raw, token, seq.job.params.top_logprobs)
                logprobs[i] = PendingToken(token, chosen, ids, values)
        except Exception as exc:
            seq.failure = f"{type(exc).__name__}: {exc}"
            token = mx.argmax(raw, -1)
        return token.astype(mx.uint32)

    def _bias_matrix(self, rows: list[BatchSequence], width: int) -> Any:
        """Every row's logit bias stacked (zeros for rows without one), None when no row has
        one; rebuilt only when the rows change."""
        if self._bias_stale:
            self._bias_stale = False
            biases = [s.selector.bias if s.plain else None for s in rows]
            if all(b is None for b in biases) or width != self._vocab:
                self._bias = None
            else:
                zeros = mx.zeros((self._vocab,), dtype=mx.float32)
                self._bias = mx.stack([zeros if b is None else b for b in biases])
        return self._bias


def _sample(seq: BatchSequence, raw: Any, words: Any = None) -> Any:
    """`seq`'s token from its row of logits `raw`: its processors (its history grows by the
    token while it has any), its selector's adjustments, the mask `words`, its selector."""
    logits = raw
    for processor in seq.processors:
        logits = processor(seq.history, logits)
    if seq.selector.adjusts_logits:
        logits = seq.selector.adjust(logits)
    if words is not None:
        logits = masked_choice.masked_logits(logits, words)
    token = seq.selector.choose(logits)
    if seq.processors:
        seq.history = mx.concatenate([seq.history, token.astype(mx.int32)])
    return token
