"""A request with media decoding alone in the batch: its lane's path. Runs on the runner thread
only, for `BatchDecoder.prefill` and `BatchDecoder.decode` (`BatchDecoder.lone_media`).

A request with media that joins the decode batch (`multimodal.joining`) would otherwise pay for
the batch when it is alone, against the media lane, which runs it as the serialized route does
(`multimodal.job.MultimodalSequence`):
- its first token: the lane takes it from its prompt's last pass (the rest of the prompt fused
  with its last token, `PrefillPlan.tail`: on MLX's CUDA backend up to 1,024 tokens, most prompts
  with an image whole) and reads it at once; the batch prefilled all of the prompt but its last
  token, then fed that token in its first decode step and, pipelined, read its token only after
  queuing the next step: a forward pass and a step's graph more before the first token;
- each decode step: the lane calls its own model (`PromptEmbeddingModel`: the language model with
  the prompt's rope delta, as mlx-vlm places it); the batch called its shared model with the
  row's delta as an array made each step (`TextView(..., row_deltas=)`, the fused rope forced).

So while nothing else decodes or waits:
- `alone_with_media`: a sequence with media alone in the batch (and without a grammar: a
  constrained row's first token is chosen with its mask, by the batch) takes its first token as
  its lane does: the rest of its prompt, once it fits its plan's tail (`fits_first_pass`; a
  longer prompt first prefills in chunks as any arrival, down to its last token, as its lane's
  does), goes through its own model with its last token in one pass (`first_token_pass`, in the
  prefill call that brought it there); the decoder chooses its first token from the last
  position's logits as it chooses a row's (`BatchChoice.first`) and reads it at once. The token
  is the sequence's `pending` input when it joins (`batch_join.joined`), or it ends there (EOS,
  `max_tokens` of 1).
- `lone_step_model`: the batch's only row, on its own cache (`BatchDecoder.solo`), continuing a
  prompt with media at a rope delta, decodes through its own model, the lane's forward pass
  exactly.
A second sequence joining merges the row into a batch cache as any lone row, and from there it
decodes at its delta in the batch's one forward pass (`row_deltas`); the batch falling back to
that one row gives it its own cache and its own model again. Either model places its tokens at
the same positions (`multimodal.text_rope`), so its greedy tokens are the lane's throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trio_mlx.engine.batch_sequence import BatchSequence


def alone_with_media(seq: BatchSequence, *, decoding: int, waiting: int) -> bool:
    """Whether `seq` (waiting to join) takes its lane's way to its first token: it has media
    (its own model), no grammar and no store points (a prompt with media has none: its snapshots
    are taken at its end), prompt tokens left to feed on its own cache, and nothing else decodes
    or waits (`decoding`, `waiting`: the batch's rows and waiting sequences, `seq` among them)."""
    return (
        seq.media
        and seq.prefill_model is not None
        and seq.grammar is None
        and not seq.job.store_points
        and seq.cache is not None
        and seq.pending is None
        and not seq.prefill_done
        and decoding == 0
        and waiting == 1
    )


def fits_first_pass(seq: BatchSequence) -> bool:
    """Whether the rest of `seq`'s prompt, its last token included, fits its plan's fused tail:
    its first token's pass may take it (else its chunks first)."""
    return 0 < seq.remaining_prompt() + 1 <= seq.tail


def first_token_pass(seq: BatchSequence) -> tuple[Any, int]:
    """Run the rest of `seq`'s prompt, its last token included, through its own model in one
    pass on its own cache; return the last position's logits (shape (1, vocab), lazy) and the
    prompt tokens the pass took. Raises whatever the model raises (the sequence then fails, as
    on a prefill chunk that raises)."""
    assert seq.cache is not None and seq.prefill_model is not None
    start = seq.prompt_done
    rest = seq.prompt_array[start:]
    logits = seq.prefill_model(rest[None], cache=seq.cache)[:, -1, :]
    n = len(seq.job.prompt_tokens) - start
    seq.advance(n)
    return logits, n


def lone_step_model(rows: Sequence[BatchSequence], *, solo: bool) -> Any:
    """The model the batch's next step calls for its only row, when that is the row's own
    (module docstring); None: the batch's model."""
    if not solo or len(rows) != 1:
        return None
    seq = rows[0]
    return seq.prefill_model if seq.rope_delta and seq.prefill_model is not None else None
