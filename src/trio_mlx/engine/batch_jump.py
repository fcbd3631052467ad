"""Jump-forward decoding for the decode batch's lone constrained row. Runs on the runner thread
only, for `BatchDecoder.can_jump` / `BatchDecoder.jump`.

What the serialized route does for a greedy sequence under a grammar (`structured/forced_runs`:
the tokens its grammar forces fed in one forward pass, `decode.ActiveSequence`), for the batch's
only row, on its own cache (`BatchDecoder.solo`): the GPU's default route serves a lone request
this way. It applies while exactly one row decodes, greedy with nothing but its mask shaping the
choice, without logprobs, on plain trimmable caches; as soon as a second row joins, the batch
decodes one token a step again.

A jump step: the step already queued is read without queuing another (its token, read and
consumed by the grammar, is the row's `pending` input); the grammar's forced run after it is
read ahead (each the only token its mask allows); `pending` and the run go through the model in
one forward pass (padded to `MAX_RUN + 1` tokens over the cache's whole buffer where attention
shapes must recur, the padding trimmed off); and the next token is chosen under the mask after
the run and queued as the next step's input, as `decode` would have. The row emits the run on
top of the token read; its tokens are those of one step a token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.padded_attention import forward_run
from trio_mlx.engine.true_positions import PositionedKVCache
from trio_mlx.structured import masked_choice
from trio_mlx.structured.forced_runs import MAX_RUN, forced_run


def can_jump(rows: list[BatchSequence], cache: list[Any], *, solo: bool) -> bool:
    """One live row, on its own plain cache (`solo`; a SpecPrefill row's `PositionedKVCache`,
    whose offset keeps its true positions, is one too), under a grammar that forced its last
    token, greedy with nothing but its mask shaping the choice, without logprobs."""
    if not solo:
        return False
    live = [s for s in rows if not s.removed]
    if len(live) != 1:
        return False
    seq = live[0]
    return (
        seq.rope_delta == 0  # its positions are the model's own (`BatchSequence.rope_delta`)
        and seq.forced_last
        and seq.grammar is not None
        and not seq.processors
        and seq.selector.batch_greedy
        and seq.selector.bias is None
        and not seq.job.params.logprobs
        and seq.failure is None
        and all(type(layer) in (KVCache, PositionedKVCache) for layer in cache)
    )


@dataclass(frozen=True)
class Jump:
    """What a jump step did: the forced run emitted after the row's pending token, whether the
    grammar or `max_tokens` ended the row there, and the next token (lazy; None when ended)."""

    run: tuple[int, ...]
    finish: str | None
    upcoming: Any


def jump_row(seq: BatchSequence, model: Any, cache: list[Any], width: int, pad: bool) -> Jump:
    """One jump step for `seq`, whose `pending` token is read and consumed by its grammar but
    not yet fed (module docstring). Updates `seq`'s fed tokens, `pending` and count of generated
    tokens. Raises whatever the model or the grammar raises."""
    assert seq.pending is not None and seq.grammar is not None
    grammar = seq.grammar
    if grammar.done:
        return Jump((), "stop", None)
    room = seq.job.params.max_tokens - seq.generated
    run = forced_run(grammar, width, min(MAX_RUN, room))
    seq.generated += len(run)
    if grammar.done:
        return Jump(tuple(run), "stop", None)
    if seq.generated >= seq.job.params.max_tokens:
        return Jump(tuple(run), "length", None)
    fed = [seq.pending, *run]
    logits = forward_run(model, fed, cache, MAX_RUN + 1 if pad else None)
    seq.fed_generated.extend(fed)
    seq.pending = None
    upcoming, forced = masked_choice.greedy_choice(logits, grammar.allowed_words()[None])
    seq.forced_last = forced is not None  # a free choice next: the batch decodes it pipelined
    upcoming = upcoming.astype(mx.uint32)
    mx.async_eval(upcoming)
    return Jump(tuple(run), None, upcoming)
