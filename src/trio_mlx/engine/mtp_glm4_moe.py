"""GLM-4.5 / GLM-4.6 (mlx-lm's `glm4_moe`) with its multi-token-prediction layer. Runner thread.

GLM-4.5/4.6 MoE checkpoints (`num_nextn_predict_layers: 1` in the config) carry one MTP layer laid
out as DeepSeek-V3's: under `model.layers.{num_hidden_layers}`, `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` (and copies of the embedding and head, `embed_tokens`, `shared_head.head`),
around one GLM decoder layer (grouped-query attention with partial RoPE and, GLM's own, q/k norms
and attention biases; a mixture of experts, the MTP layer's index being past
`first_k_dense_replace`). mlx-lm's `sanitize` drops it; `Glm4MoeWithMtp` keeps it as `mtp.*`
through the shared `mtp.keep_nextn_layer`, and `mtp.MtpDrafter` drafts with it as with DeepSeek-V3
(the module and the drafting are `mtp.py`'s; only the block is GLM's).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import glm4_moe

from trio_mlx.engine.mtp import HiddenCapture, NextnMtp, forward_capturing, keep_nextn_layer


class Glm4MoeWithMtp(glm4_moe.Model):
    """mlx-lm's GLM-4.5/4.6 MoE model plus its MTP module (`mtp`), whose weights `sanitize`
    keeps; `hidden_capture` as `mtp.DeepseekV3WithMtp`'s."""

    def __init__(self, config: glm4_moe.ModelArgs) -> None:
        super().__init__(config)
        block = glm4_moe.DecoderLayer(config, config.num_hidden_layers)
        self.mtp = NextnMtp(config.hidden_size, config.rms_norm_eps, block)
        self.hidden_capture = HiddenCapture()

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return forward_capturing(self, inputs, cache)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return keep_nextn_layer(weights, self.args.num_hidden_layers, super().sanitize)
