"""Each row's token from a decode step's logits. Runs on the runner thread only, for
`BatchDecoder.decode` (and `batch_constrained`, through `BatchChoice.row`).

Per sequence, as on the serialized route (`decode.ActiveSequence`): its `TokenSelector` (sampling
parameters, penalties, logit bias, its own seeded draws, `row_sampling.draw`, so a seeded request
draws the same tokens whatever its companions), its logits processors called on its own row of
logits (shape (1, vocab)) until they retire, its grammar's mask where it has one
(`masked_choice.masked_logits`), its logprobs. Rows that are greedy without processors or penalties
(`BatchSequence.plain`; logit bias allowed) are chosen by one batched argmax; rows sampled without
processors, penalties or grammar (`TokenSelector.batch_sampled`; logit bias allowed) are drawn
together by one pass over the batch's logits (`row_sampling.sample`: each row's filters and its own
uniform number, so each draws the token it would draw alone, `TokenSelector.choose`). The biases
stacked into one matrix, the rows' filters and which rows are which are rebuilt only when the rows
change (`rows_changed`: the batch's rows changed, or a row's processors retired). A row of any other
kind is chosen on its own (`row`).

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

from trio_mlx.engine import row_sampling
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
        #: per row: drawn in the batch's sampling pass (`vector_sampled`); and their filters
        self._sampled: list[bool] = []
        self._filters: row_sampling.RowParams | None = None

    def rows_changed(self) -> None:
        """The batch's rows, or which of them are plain, changed: rebuild the bias matrix."""
        self._bias_stale = True

    def tokens(
        self, rows: list[BatchSequence], logits: Any, spent: frozenset[int] = frozenset()
    ) -> tuple[Any, dict[int, Any]]:
        """The next token of every row (shape (B,), lazy), and the rows' logprob arrays."""
        self._refresh(rows, logits.shape[-1])
        biased = self._biased(logits)  # (once, for the argmax and the sampling pass)
        greedy: Any = None
        if any(s.plain for s in rows):
            greedy = mx.argmax(biased, -1)
        if all(s.plain and not s.job.params.logprobs for s in rows):
            return greedy, {}
        drawn = self._draw(rows, biased, spent) if any(self._sampled) else None
        live = [vector and i not in spent for i, vector in enumerate(self._sampled)]
        tokens: Any
        if all(live):
            tokens = drawn
        else:  # greedy rows, a spent row's token (never read), and those chosen on their own
            greedy = mx.argmax(biased, -1) if greedy is None else greedy
            tokens = greedy if drawn is None else mx.where(mx.array(live), drawn, greedy)
        pending: dict[int, Any] = {}
        own = [
            i
            for i, (seq, vector) in enumerate(zip(rows, self._sampled, strict=True))
            if not (seq.plain or vector) and i not in spent
        ]
        place: dict[int, int] = {}  # a row chosen on its own: its token's place
        if own:
            # rows chosen on their own (processors, penalties, a grammar): their tokens put in
            # their places by one gather
            chosen = [self.row(i, rows[i], logits[i : i + 1], greedy, pending) for i in own]
            place = {i: len(rows) + k for k, i in enumerate(own)}  # (logprobs: `row`'s)
            index = mx.array([place.get(i, i) for i in range(len(rows))])
            tokens = mx.take(mx.concatenate([tokens, *chosen]), index)
        for i, seq in enumerate(rows):
            if seq.job.params.logprobs and i not in spent and i not in place:
                token = tokens[i : i + 1]
                top = seq.job.params.top_logprobs
                chosen_logprob, ids, values = logprob_arrays(logits[i : i + 1], token, top)
                pending[i] = PendingToken(token, chosen_logprob, ids, values)
        return tokens, pending

    def _biased(self, logits: Any) -> Any:
        """Every row's logits plus its bias (`_refresh`), float32 where a row has one."""
        bias = self._bias
        return logits if bias is None else logits.astype(mx.float32) + bias

    def _draw(self, rows: list[BatchSequence], biased: Any, spent: frozenset[int]) -> Any:
        """Every row's token from the batch's sampling pass over the `biased` logits
        (`row_sampling.sample`, shape (B,)): the `vector_sampled` rows' draws, each at its next
        uniform number (a `spent` row's is not taken: its token is never read); the other rows'
        entries are not used."""
        uniforms = [
            seq.selector.next_uniform() if vector and i not in spent else 0.5
            for i, (seq, vector) in enumerate(zip(rows, self._sampled, strict=True))
        ]
        assert self._filters is not None
        return row_sampling.sample(biased, self._filters, uniforms)

    def _refresh(self, rows: list[BatchSequence], width: int) -> None:
        """Rebuild, after `rows_changed`, the bias matrix, which rows the sampling pass draws
        and their filters (neutral ones for the other rows)."""
        if not self._bias_stale and len(self._sampled) == len(rows):
            return
        self._bias_stale = False
        # (logits of another width than the biases': a biased row is chosen on its own, whose
        # selector widens its bias or says why it cannot)
        self._sampled = [
            vector_sampled(s) and (width == self._vocab or s.selector.bias is None) for s in rows
        ]
        biases = [
            s.selector.bias if s.plain or vector else None
            for s, vector in zip(rows, self._sampled, strict=True)
        ]
        if all(b is None for b in biases) or width != self._vocab:
            self._bias = None
        else:
            zeros = mx.zeros((self._vocab,), dtype=mx.float32)
            self._bias = mx.stack([zeros if b is None else b for b in biases])
        neutral = (1.0, 0, 1.0, 0.0)
        filters = [
            s.selector.filters if vector else neutral
            for s, vector in zip(rows, self._sampled, strict=True)
        ]
        columns = list(zip(*filters, strict=True)) or [(), (), (), ()]
        self._filters = row_sampling.RowParams(*(list(c) for c in columns))

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
        self._refresh(rows, logits.shape[-1])
        if greedy is None and any(s.plain for s in rows):
            greedy = mx.argmax(self._biased(logits), -1)
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


def vector_sampled(seq: BatchSequence) -> bool:
    """Whether the batch's sampling pass draws `seq`'s token: sampled, no processors, no
    penalties, no grammar (a logit bias allowed)."""
    return not seq.processors and seq.grammar is None and seq.selector.batch_sampled
