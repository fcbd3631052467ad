"""Speculative decoding inside the decode batch, for its lone row. Runs on the runner thread
only, for `BatchDecoder.can_speculate` / `BatchDecoder.speculate`.

A draft (a draft model or the MTP head: `speculative.Speculator`) proposes tokens that the
target verifies in one pass on the batch's own cache. That pays only while one row decodes, so
it applies to a batch with exactly one live row, without logits processors or a grammar (their
state cannot be rewound), not a SpecPrefill row (which decodes without the draft, as on the
serialized route), past its first token. The row's draft state is opened at its first
speculative step and kept on the row (`BatchSequence.draft`); after a step the row's cache holds
`fed_tokens()` and its next input is `pending`, so a plain `decode` (another row joined) carries
on from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trio_mlx.engine.speculative import Speculation, Speculator

if TYPE_CHECKING:
    from trio_mlx.engine.batch_sequence import BatchSequence


def can_speculate(rows: Sequence[BatchSequence], *, step_queued: bool) -> bool:
    """One live row among `rows`, without processors or a grammar, not continuing a prompt with
    media, not sparsely prefilled (SpecPrefill), past its first token (a step is queued,
    `step_queued`, or its next input is `pending`)."""
    live = [s for s in rows if not s.removed]
    if len(live) != 1 or live[0].processors or live[0].grammar is not None:
        return False
    if live[0].media:  # a prompt with media: the draft model never saw it, and its fed tokens
        return False  # are cache keys (`BatchSequence.key_tokens`), not token ids
    if live[0].sparse:  # a SpecPrefill row decodes without the draft, as on the serialized route
        return False
    return step_queued or live[0].pending is not None


def speculate_row(
    seq: BatchSequence, speculator: Speculator, cache: list[Any], eos: frozenset[int]
) -> Speculation:
    """One speculative step (`Speculator.step`) for `seq`, the batch's only row, whose next
    input is `pending`, on the batch's `cache`; `seq`'s fed tokens, `pending` and count of
    generated tokens are brought up to date. Raises whatever the draft or the target raises
    (before `seq` changes)."""
    assert seq.pending is not None
    if seq.draft is None:
        seq.draft = speculator.open_draft()
    out = speculator.step(
        cache,
        seq.draft,
        seq.fed_tokens(),
        seq.pending,
        seq.selector,
        seq.job.params,
        eos,
        seq.generated,
    )
    seq.fed_generated.extend(out.fed)
    seq.pending = out.pending
    seq.generated += len(out.tokens)
    return out
