"""MiMo (mlx-lm's `mimo`, Xiaomi MiMo-7B) with its multi-token-prediction layer. Runner thread.

MiMo checkpoints (`num_nextn_predict_layers` in the config) carry their MTP layers under
`model.mtp_layers.{i}`, which mlx-lm's `sanitize` drops. Each is, at sequence position p: x =
input_proj(concat(hidden_layernorm(h_(p-1)), token_layernorm(embed(t_p)))) (the hidden state
first: the other order from DeepSeek-V3's), one Qwen2-style decoder layer (`input_layernorm`,
`self_attn`, `post_attention_layernorm`, `mlp`: mlx-lm's `mimo.TransformerBlock`, with its own KV
cache), then `final_layernorm`; the model's head over that output predicts t_(p+1), and the
normed output is what the next chained step takes as its hidden state. `MimoWithMtp` keeps the
first layer (`model.mtp_layers.0`) as `mtp.*`; `mtp.MtpDrafter` drafts with it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.nn import Linear, Module, RMSNorm  # type: ignore[attr-defined]
from mlx_lm.models import mimo
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from trio_mlx.engine.mtp import HiddenCapture, forward_capturing
from trio_mlx.errors import ModelLoadError

_LAYERS = "model.mtp_layers."
#: the MTP layer's own parts (the rest is its decoder block)
_OWN_PARTS = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")


class MimoMtp(Module):  # type: ignore[misc]
    """One MiMo MTP layer (see the module docstring); `__call__` returns its normed output."""

    def __init__(self, args: mimo.ModelArgs) -> None:
        super().__init__()
        width = args.hidden_size
        self.token_layernorm = RMSNorm(width, eps=args.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(width, eps=args.rms_norm_eps)
        self.input_proj = Linear(2 * width, width, bias=False)
        self.block = mimo.TransformerBlock(args)
        self.final_layernorm = RMSNorm(width, eps=args.rms_norm_eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        x = self.input_proj(
            mx.concatenate(
                [self.hidden_layernorm(hidden), self.token_layernorm(embeddings)], axis=-1
            )
        )
        mask = create_attention_mask(x, cache, return_array=True)
        out: mx.array = self.final_layernorm(self.block(x, mask, cache))
        return out

    def head_input(self, out: mx.array) -> mx.array:
        """The head takes the output as it is (already `final_layernorm`ed)."""
        return out


class MimoWithMtp(mimo.Model):
    """mlx-lm's MiMo model plus its first MTP layer (`mtp`), whose weights `sanitize` keeps;
    `hidden_capture` as `mtp.DeepseekV3WithMtp`'s."""

    def __init__(self, args: mimo.ModelArgs) -> None:
        super().__init__(args)
        self.mtp = MimoMtp(args)
        self.hidden_capture = HiddenCapture()

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return forward_capturing(self, inputs, cache)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        """mlx-lm's own (which drops every MTP layer), plus the first MTP layer as `mtp.*`
        (further ones are dropped: only the first is used). Raises `ModelLoadError` when the
        weights have none."""
        own = _LAYERS + "0."
        kept: dict[str, Any] = {}
        for key in [k for k in weights if k.startswith(own)]:
            value = weights.pop(key)
            rest = key[len(own) :]
            if "rotary_emb." in rest:
                continue
            name = rest if rest.startswith(_OWN_PARTS) else "block." + rest
            kept["mtp." + name] = value
        if not kept:
            raise ModelLoadError(f"--mtp: the checkpoint carries no MTP layer (no {own}* weights)")
        out = dict(super().sanitize(weights))
        out.update(kept)
        return out
