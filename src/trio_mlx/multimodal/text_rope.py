"""Text positions through MLX's fused RoPE on mlx-vlm's MRoPE language models (the Qwen-VL
family, Qwen3.5). Runner thread only.

MRoPE gives a token three positions (time, height, width) and rotates each frequency band by one
of them. mlx-vlm applies it with some twenty array operations a layer (slices, a rotate-half,
products, sums, casts) wherever its fused kernel is missing, which is everywhere but Metal: on
MLX's CUDA backend, where a decode step costs what the host spends building and dispatching its
operations, that is about as many operations again as the rest of the layer. A token whose three
positions are equal is rotated exactly as plain RoPE rotates it at that position, and that holds
for every token of a text-only request (positions `offset + i`) and every token generated after a
prompt with media (positions `offset + i + rope delta`): every decode step. There MLX's fused
rope (`mx.fast.rope`, one kernel on a GPU) does the rotation.

On by default on a GPU (`TextRoPE.default`); off on the CPU, where MLX composes `mx.fast.rope`
from plain operations itself: there the tiny test model's decode step measured 4 % slower with it
(2.99 against 2.88 ms, medians of 10 alternating runs of 100 steps).

`install(language_model)` wraps each attention layer's rotary embedding in a `TextPositionRoPE`
once the fused rope (`mx.fast.rope` with the embedding's own frequencies) was checked to give
mlx-vlm's result at equal positions, trying both pairings of dimensions (halves, as Qwen's
"chunked" style, or neighbours); a model where neither agrees, or whose layers hold no MRoPE
embedding, keeps mlx-vlm's (logged) and `install` returns None. The caller then enters
`TextRoPE.text_positions()` around each call whose positions are all text positions; outside it
the wrapped embeddings behave exactly as mlx-vlm's (prompts with media keep their three axes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

log = logging.getLogger(__name__)

#: largest difference from mlx-vlm's rotation accepted by the check (float32, unit-scale inputs;
#: the two differ by rounding only, ~1e-6, where they agree at all)
TOLERANCE = 1e-3


class TextRoPE:
    """The switch shared by one language model's wrapped embeddings; `enabled` False keeps
    mlx-vlm's MRoPE everywhere (`bench.multimodal`'s `engine-mrope` side)."""

    #: `enabled` of a new switch; None: on a GPU only (module docstring)
    default: bool | None = None

    def __init__(self) -> None:
        self.active = False
        self.enabled = mx.default_device() == mx.gpu if self.default is None else self.default
        #: each row's shift of its positions during a call (None: none)
        self.deltas: Any = None
        self._ids: Any = None  # the call's position ids, and the offsets computed from them
        self._offsets: Any = None

    @contextmanager
    def text_positions(self, deltas: Any = None) -> Iterator[None]:
        """Within: every position the model is given is a text position (its three MRoPE axes
        equal, consecutive within a row), rotated by the fused rope. With `deltas` (an int32
        array, one a row) each row's positions are shifted by its delta: rows of a batch that
        continue prompts with media (their rope delta; `BatchSequence.rope_delta`), which only
        this rotation places, so it is used then whatever `enabled`."""
        self.active = self.enabled or deltas is not None
        self.deltas = deltas
        try:
            yield
        finally:
            self.active = False
            self.deltas = self._ids = self._offsets = None

    def offsets(self, position_ids: Any) -> Any:
        """Each row's first position (plus its delta) from `position_ids` ((3, batch, tokens)
        or (batch, tokens)), int32; computed once a call (every layer gets the same ids)."""
        if position_ids is not self._ids:
            rows = position_ids[0] if position_ids.ndim == 3 else position_ids
            offsets = rows[:, 0].astype(mx.int32)
            if self.deltas is not None:
                offsets = offsets + self.deltas
            self._ids, self._offsets = position_ids, offsets
        return self._offsets


class TextPositionRoPE:
    """One layer's MRoPE embedding, with the fused rope for text positions (module docstring).
    While the switch is on it reports `fused_apply` (so the model hands each layer its position
    ids instead of computing cos/sin once for all: mlx-vlm's contract for a fused embedding);
    anything else is the wrapped embedding's own."""

    def __init__(self, inner: Any, switch: TextRoPE, *, traditional: bool) -> None:
        self._inner = inner
        self._switch = switch
        self._traditional = traditional
        self._dims = 2 * int(inner.inv_freq.shape[0])
        self._freqs = 1.0 / inner.inv_freq.astype(mx.float32)
        mx.eval(self._freqs)

    @property
    def fused_apply(self) -> bool:
        return self._switch.active or bool(getattr(self._inner, "fused_apply", False))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, x: Any, position_ids: Any) -> Any:
        return self._inner(x, position_ids)

    def apply_rotary(self, q: Any, k: Any, position_ids: Any, **kwargs: Any) -> Any:
        if not self._switch.active or kwargs.get("unsqueeze_dim", 1) != 1:
            return self._inner.apply_rotary(q, k, position_ids, **kwargs)
        return self.rotate(q, position_ids), self.rotate(k, position_ids)

    def rotate(self, x: Any, position_ids: Any) -> Any:
        """`x` (batch, heads, tokens, dims) rotated at text positions `position_ids` ((3, batch,
        tokens) or (batch, tokens)): each row from its first position on, plus its delta (the
        switch's `deltas`)."""
        return mx.fast.rope(
            x,
            self._dims,
            traditional=self._traditional,
            base=None,
            scale=1.0,
            offset=self._switch.offsets(position_ids),
            freqs=self._freqs,
        )


def _embeddings(language_model: Any) -> list[Any]:
    """Each attention layer's attention module that holds an MRoPE embedding."""
    found = []
    for layer in language_model.layers:
        attention = getattr(layer, "self_attn", None)
        embedding = getattr(attention, "rotary_emb", None)
        if hasattr(embedding, "apply_rotary") and hasattr(embedding, "inv_freq"):
            found.append(attention)
    return found


def _agrees(embedding: Any, head_dim: int, traditional: bool) -> bool:
    """Whether the fused rope rotates as `embedding` does at equal positions (float32): one row,
    then two rows at their own offsets with per-row deltas (as a batch with a row continuing a
    prompt with media calls it)."""
    switch = TextRoPE()
    switch.enabled = True
    fused = TextPositionRoPE(embedding, switch, traditional=traditional)
    key = mx.random.key(0)
    q = mx.random.normal((2, 2, 4, head_dim), key=key)
    k = mx.random.normal((2, 1, 4, head_dim), key=mx.random.split(key)[0])
    steps = mx.arange(4, dtype=mx.int32)
    cases: list[tuple[Any, Any, int]] = [(mx.array([s]), None, 1) for s in (0, 7, 4093)]
    cases.append((mx.array([30, 12]), mx.array([-20, 5], dtype=mx.int32), 2))
    for starts, deltas, rows in cases:
        shifted = starts if deltas is None else starts + deltas
        want_ids = mx.broadcast_to((shifted[:, None] + steps)[None], (3, rows, 4))
        want_q, want_k = embedding.apply_rotary(q[:rows], k[:rows], want_ids, unsqueeze_dim=1)
        ids = mx.broadcast_to((starts[:, None] + steps)[None], (3, rows, 4))
        with switch.text_positions(deltas):
            got_q, got_k = fused.apply_rotary(q[:rows], k[:rows], ids, unsqueeze_dim=1)
        worst = max(
            float(mx.abs(want_q.astype(mx.float32) - got_q).max()),
            float(mx.abs(want_k.astype(mx.float32) - got_k).max()),
        )
        if not worst <= TOLERANCE:
            return False
    return True


def install(language_model: Any) -> TextRoPE | None:
    """Wrap `language_model`'s MRoPE embeddings (module docstring); None where it has none or
    the fused rope does not agree with them."""
    attentions = _embeddings(language_model)
    if not attentions:
        return None
    first = attentions[0]
    head_dim = int(getattr(first, "head_dim", 2 * int(first.rotary_emb.inv_freq.shape[0])))
    try:
        pairing = next((t for t in (False, True) if _agrees(first.rotary_emb, head_dim, t)), None)
    except Exception as exc:  # an embedding this check cannot drive keeps its own path
        log.info("text positions keep mlx-vlm's MRoPE (%s: %s)", type(exc).__name__, exc)
        return None
    if pairing is None:
        log.info("text positions keep mlx-vlm's MRoPE: the fused rope does not agree with it")
        return None
    switch = TextRoPE()
    for attention in attentions:
        # a plain attribute: the module's own entry (and so its parameters) stays as it was
        object.__setattr__(
            attention,
            "rotary_emb",
            TextPositionRoPE(attention.rotary_emb, switch, traditional=pairing),
        )
    log.info("text positions take the fused rope (%d layers)", len(attentions))
    return switch
