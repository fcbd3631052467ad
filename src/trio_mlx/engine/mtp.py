"""Native multi-token prediction (MTP) heads as the drafter of speculative decoding. Runner thread.

Some checkpoints carry, beside the model, a DeepSeek-V3-style MTP module (`num_nextn_predict_layers`
in the config, weights under `model.layers.{num_hidden_layers}`) that mlx-lm's `sanitize` drops.
`load_mtp_model` loads such a model through mlx-lm with a model class of ours (`_MTP_CLASSES`, a
subclass of mlx-lm's own) whose `sanitize` keeps those weights, as `mtp.*`; mlx-lm's files are not
touched. Supported: `deepseek_v3` (here; and configs that map onto it, e.g. Kimi-K2) and
`glm4_moe` (GLM-4.5 / 4.6, `mtp_glm4_moe.py`) and `glm4_moe_lite` (GLM-4.7-Flash,
`mtp_glm4_moe_lite.py`): all three lay the layer out the same way, so the module
(`NextnMtp`, around the family's own decoder layer), the weight split (`keep_nextn_layer`) and the
drafter are shared, and a family module holds only its model class; and `mimo` (MiMo-7B,
`mtp_mimo.py`), whose layers under `model.mtp_layers.*` differ in names and order but not in kind.
A model of another architecture, or one whose weights carry no MTP layer, is refused
(`ModelLoadError`). What `MtpDrafter` needs of a family's module (`model.mtp`): `__call__(
embeddings, hidden, cache)`, the output at each position (the next chained input), and
`head_input(out)`, what the model's head (`output_head`) takes from it.

The module, at sequence position p: x = eh_proj(concat(enorm(embed(t_p)), hnorm(h_(p-1)))), one
transformer block (with its own KV cache), and the shared head lm_head(norm(.)) predicts t_(p+1).
`h_(p-1)` is the target's last hidden state (after its final norm) at the position before. Drafting
K tokens after `pending` (t_n): the first from (t_n, h_(n-1)); each next one from the drafted token
and the MTP block's own output for the one before (the module chained on itself), as vLLM does.

`MtpDrafter` is the `speculative.Drafter` for it: the target's verification pass returns its
hidden states, the ones of the tokens kept become the next step's input, and the chained entries
are cut from the MTP cache so that every kept entry comes from the target's true hidden states.
On the serialized route the prompt's hidden states are captured during prefill
(`MtpDrafter.during_prefill`, through the model's `hidden_capture`) and fed to the block chunk by
chunk, so the block attends over the prompt and the first speculative step drafts. Positions whose
hidden states were never seen are not in its cache: a prefix restored from the prefix cache (the
block's cache is not snapshotted), the prompt on the batched route (its prefill is the batch's),
and stretches decoded in a batch with other rows; after such a gap the first step is a plain
target step (k = 0) that supplies the hidden state to draft from. Gaps lower the acceptance rate,
never the output: verification is the target's, with the same acceptance code as a draft model
(`speculative.Speculator.step`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import mlx.core as mx
from mlx.nn import Linear, Module, RMSNorm  # type: ignore[attr-defined]
from mlx_lm.models import deepseek_v3
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from trio_mlx.errors import ModelLoadError

_T = TypeVar("_T")

#: MTP weights other than the transformer block's, and where they go in our module (None: dropped,
#: the module uses the model's own embedding and head, which these duplicate)
_HEAD_PARTS: dict[str, str | None] = {
    "enorm.": "enorm.",
    "hnorm.": "hnorm.",
    "eh_proj.": "eh_proj.",
    "shared_head.norm.": "norm.",
    "shared_head.head.": None,
    "embed_tokens.": None,
}


class NextnMtp(Module):  # type: ignore[misc]
    """A DeepSeek-V3-style MTP module around a family's own transformer `block` (see the module
    docstring); `__call__` returns the block's output (before `norm`), `logits` the shared
    head's. `block(x, mask, cache)` is one decoder layer of the family."""

    def __init__(self, width: int, eps: float, block: Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(width, eps=eps)
        self.hnorm = RMSNorm(width, eps=eps)
        self.eh_proj = Linear(2 * width, width, bias=False)
        self.block = block
        self.norm = RMSNorm(width, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        x = self.eh_proj(mx.concatenate([self.enorm(embeddings), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        out: mx.array = self.block(x, mask, cache)
        return out

    def head_input(self, out: mx.array) -> mx.array:
        """What the model's head takes from the module's output `out` (the shared head's norm)."""
        normed: mx.array = self.norm(out)
        return normed


class HiddenCapture:
    """While `on`, the model's calls leave their last hidden states (B, N, D) in `hidden`.
    A plain object, not an array or module: MLX does not count it among the parameters."""

    __slots__ = ("hidden", "on")

    def __init__(self) -> None:
        self.on = False
        self.hidden: Any = None


def output_head(model: Any) -> Callable[[mx.array], mx.array]:
    """`model`'s head: its `lm_head`, or its embedding's transpose when the two are tied."""
    head = getattr(model, "lm_head", None)
    if head is not None:
        return cast(Callable[[mx.array], mx.array], head)
    return cast(Callable[[mx.array], mx.array], model.model.embed_tokens.as_linear)


def forward_capturing(model: Any, inputs: mx.array, cache: Any) -> mx.array:
    """`model`'s logits over `inputs` (its `model` trunk, then its head), leaving the trunk's
    hidden states in `model.hidden_capture` while it is on: the `__call__` of the MTP classes."""
    hidden = model.model(inputs, cache)
    if model.hidden_capture.on:
        model.hidden_capture.hidden = hidden
    return output_head(model)(hidden)


def keep_nextn_layer(
    weights: dict[str, Any],
    first: int,
    sanitize: Callable[[dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """The checkpoint's `weights` sanitized by the family's own `sanitize`, plus its first MTP
    layer (`model.layers.{first}.*`, `first` = num_hidden_layers) as `mtp.*` for a `NextnMtp`
    (further MTP depths are dropped: only the first is used). The block goes through `sanitize`
    as a layer 0 (expert stacking, MLA projections, fp8 / int4 weights), the head parts beside
    it under a name `sanitize` leaves alone. Raises `ModelLoadError` when there is no such
    layer."""
    own = f"model.layers.{first}."
    mtp_raw: dict[str, Any] = {}
    for key in list(weights):
        if key.startswith(own):
            mtp_raw[key[len(own) :]] = weights.pop(key)
        elif _layer_index(key) > first:
            weights.pop(key)
    if not mtp_raw:
        raise ModelLoadError(
            f"--mtp: the checkpoint carries no MTP layer (no model.layers.{first}.* weights)"
        )
    staged: dict[str, Any] = {}
    for key, value in mtp_raw.items():
        head = next((p for p in _HEAD_PARTS if key.startswith(p)), None)
        if head is None:
            staged[f"model.layers.0.{key}"] = value
        elif _HEAD_PARTS[head] is not None:
            staged[f"mtp_head.{key}"] = value
    sanitized = sanitize(staged)
    out = dict(sanitize(weights))
    for key, value in sanitized.items():
        if key.startswith("model.layers.0."):
            out["mtp.block." + key[len("model.layers.0.") :]] = value
        else:
            rest = key[len("mtp_head.") :]
            head = next(p for p in _HEAD_PARTS if rest.startswith(p))
            out["mtp." + str(_HEAD_PARTS[head]) + rest[len(head) :]] = value
    return out


class DeepseekV3WithMtp(deepseek_v3.Model):
    """mlx-lm's DeepSeek-V3 model plus its MTP module (`mtp`), whose weights `sanitize` keeps."""

    def __init__(self, config: deepseek_v3.ModelArgs) -> None:
        super().__init__(config)
        block = deepseek_v3.DeepseekV3DecoderLayer(config, config.num_hidden_layers)
        self.mtp = NextnMtp(config.hidden_size, config.rms_norm_eps, block)
        self.hidden_capture = HiddenCapture()

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return forward_capturing(self, inputs, cache)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return keep_nextn_layer(weights, self.args.num_hidden_layers, super().sanitize)


def _layer_index(key: str) -> int:
    if not key.startswith("model.layers."):
        return -1
    part = key.split(".")[2]
    return int(part) if part.isdigit() else -1


#: model_type -> (module, class) of our model class carrying the MTP module: one module a family
#: beside this one (imported when asked for), sharing `NextnMtp` and `keep_nextn_layer`
_MTP_CLASSES: dict[str, tuple[str, str]] = {
    "deepseek_v3": (__name__, "DeepseekV3WithMtp"),
    "glm4_moe": ("trio_mlx.engine.mtp_glm4_moe", "Glm4MoeWithMtp"),
    "glm4_moe_lite": ("trio_mlx.engine.mtp_glm4_moe_lite", "Glm4MoeLiteWithMtp"),
    "mimo": ("trio_mlx.engine.mtp_mimo", "MimoWithMtp"),
}


def mtp_architectures() -> tuple[str, ...]:
    """The model types `--mtp` supports."""
    return tuple(sorted(_MTP_CLASSES))


def _mtp_class(model_type: str) -> type[Module]:
    module_name, class_name = _MTP_CLASSES[model_type]
    cls: type[Module] = getattr(importlib.import_module(module_name), class_name)
    return cls


def load_mtp_model(path: Path) -> tuple[Module, dict[str, Any]]:
    """Load the mlx-lm model in `path` with its MTP module (the model gains `.mtp`).

    Raises `ModelLoadError` for an architecture without MTP support here, a config that declares
    no MTP layer, or weights without one."""
    from mlx_lm.utils import _get_classes, load_model

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}/config.json: {exc}") from exc
    model_type = config.get("model_type")
    if model_type not in _MTP_CLASSES:
        raise ModelLoadError(
            f"{path}: --mtp needs a model whose checkpoint carries multi-token-prediction heads; "
            f"model_type {model_type!r} has none supported here (supported: "
            f"{', '.join(mtp_architectures())})"
        )
    if not config.get("num_nextn_predict_layers"):
        raise ModelLoadError(
            f"{path}: --mtp: the config declares no MTP layer (num_nextn_predict_layers is "
            f"{config.get('num_nextn_predict_layers')!r})"
        )

    def classes(config: dict[str, Any]) -> tuple[type[Module], type]:
        _model_class, args_class = _get_classes(config)
        return _mtp_class(model_type), args_class

    try:
        model, loaded_config = load_model(path, get_model_classes=classes)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return model, loaded_config


class MtpState:
    """One sequence's MTP side: the block's KV cache, and the target's hidden states (`hidden`,
    shape (n, D)) of the positions `hidden_at` .. `hidden_at + n - 1`, not yet fed to the block."""

    __slots__ = ("cache", "chained", "hidden", "hidden_at", "last")

    def __init__(self) -> None:
        self.cache = KVCache()
        self.hidden: Any = None
        self.hidden_at = 0
        #: entries added this step from the block's own outputs (cut after verification)
        self.chained = 0
        #: the block's output at the last position fed (the next chained input)
        self.last: Any = None


class MtpDrafter:
    """`speculative.Drafter` drafting with `model.mtp` (a model from `load_mtp_model`)."""

    def __init__(self, model: Any) -> None:
        if not hasattr(model, "mtp"):
            raise ValueError("the model has no MTP module (load it with load_mtp_model)")
        self._model = model
        self._mtp = model.mtp
        self._head = output_head(model)

    def open(self) -> MtpState:
        return MtpState()

    def during_prefill(
        self, state: MtpState, run: Callable[[], _T], fed: Callable[[], Sequence[int]]
    ) -> _T:
        """Run `run` (one prefill chunk, or the first token, of the sequence whose cache holds
        `fed()`) with the target's hidden states captured, and feed them to the MTP block: so it
        sees the prompt too, and the first speculative step can draft."""
        capture: HiddenCapture | None = getattr(self._model, "hidden_capture", None)
        if capture is None:
            return run()
        start = len(fed())
        capture.on, capture.hidden = True, None
        try:
            result = run()
        finally:
            capture.on = False
        hidden, capture.hidden = capture.hidden, None
        tokens = fed()
        if hidden is not None and len(tokens) > start:
            self._absorb(state, start, hidden[0, : len(tokens) - start], tokens)
        return result

    def _absorb(self, state: MtpState, start: int, rows: mx.array, tokens: Sequence[int]) -> None:
        """Take the target's hidden states `rows` of positions `start`..: feed the block every
        position whose token is known (all but the last one's successor); keep the last row."""
        if state.hidden is not None and state.hidden_at + int(state.hidden.shape[0]) == start:
            hidden = mx.concatenate([state.hidden, rows.astype(state.hidden.dtype)])
            at = state.hidden_at
        else:
            hidden, at = rows, start
        end = at + int(hidden.shape[0])
        if end - at > 1:
            ids = mx.array(list(tokens[at + 1 : end]), dtype=mx.uint32)
            embeddings = self._model.model.embed_tokens(ids[None])
            self._mtp(embeddings, hidden[None, :-1].astype(embeddings.dtype), state.cache)
            mx.async_eval(state.cache.state)
        state.hidden, state.hidden_at = hidden[-1:], end - 1

    def prepare(self, state: MtpState, history: Sequence[int]) -> tuple[bool, int]:
        """Whether the step may draft: the target's hidden state of the last history position is
        at hand (the previous step's verification made it)."""
        if state.hidden is None:
            return False, 0
        return state.hidden_at + int(state.hidden.shape[0]) == len(history), 0

    def _logits(self, out: mx.array) -> mx.array:
        logits: mx.array = self._head(self._mtp.head_input(out[:, -1:, :]))[:, -1, :]
        return logits

    def start(self, state: MtpState, history: Sequence[int], pending: int) -> mx.array:
        """Feed the positions after `hidden_at` (their tokens with the hidden states before
        them) up to `pending`; the logits for the token after `pending`, shape (1, V)."""
        tokens = mx.array([*history[state.hidden_at + 1 :], pending], dtype=mx.uint32)
        embeddings = self._model.model.embed_tokens(tokens[None])
        out = self._mtp(embeddings, state.hidden[None].astype(embeddings.dtype), state.cache)
        state.hidden = None
        state.last = out[:, -1:, :]
        state.chained = 0
        return self._logits(out)

    def extend(self, state: MtpState, token: mx.array) -> mx.array:
        """Feed a drafted `token` (shape (1,)) with the block's previous output."""
        embeddings = self._model.model.embed_tokens(token[None])
        out = self._mtp(embeddings, state.last, state.cache)
        state.last = out
        state.chained += 1
        return self._logits(out)

    def verify(
        self, forward: Callable[[Any, Any, list[Any]], Any], tokens: mx.array, cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """The target's pass over `tokens` (shape (1, k + 1)): its logits (k + 1, V) and hidden
        states (k + 1, D), the trunk run through `forward` (on CUDA the padded pass,
        `padded_attention`, with the mask kind the family's attention takes)."""
        hidden = forward(self._model.model, tokens, cache)
        return self._head(hidden)[0], hidden[0]

    def settle(
        self, state: MtpState, history: Sequence[int], fed: int, extra: mx.array | None
    ) -> None:
        """After verification: drop the chained entries, keep the hidden states of the `fed`
        positions the target's cache kept (from len(history) on)."""
        if state.chained:
            state.cache.trim(state.chained)
            state.chained = 0
        state.last = None
        assert extra is not None
        state.hidden = extra[:fed]
        state.hidden_at = len(history)
