"""GLM-4.7-Flash (mlx-lm's `glm4_moe_lite`) with its multi-token-prediction layer. Runner thread.

GLM-4.7-Flash checkpoints (`num_nextn_predict_layers: 1`) carry one MTP layer laid out as
DeepSeek-V3's (under `model.layers.{num_hidden_layers}`: `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, copies of the embedding and head) around one of its own decoder layers: MLA
attention (DeepSeek-V3's kind, a boolean mask in the padded verification pass) and a mixture of
experts. mlx-lm's `sanitize` drops every layer from `num_hidden_layers` on; `Glm4MoeLiteWithMtp`
keeps the first as `mtp.*` through the shared `mtp.keep_nextn_layer` (its block through mlx-lm's
own sanitize as a layer 0: expert stacking, the `kv_b_proj` split), and `mtp.MtpDrafter` drafts
with it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import glm4_moe_lite

from trio_mlx.engine.mtp import HiddenCapture, NextnMtp, forward_capturing, keep_nextn_layer


class Glm4MoeLiteWithMtp(glm4_moe_lite.Model):
    """mlx-lm's GLM-4.7-Flash model plus its MTP module (`mtp`), whose weights `sanitize` keeps;
    `hidden_capture` as `mtp.DeepseekV3WithMtp`'s."""

    def __init__(self, config: glm4_moe_lite.ModelArgs) -> None:
        super().__init__(config)
        block = glm4_moe_lite.Glm4MoeLiteDecoderLayer(config, config.num_hidden_layers)
        self.mtp = NextnMtp(config.hidden_size, config.rms_norm_eps, block)
        self.hidden_capture = HiddenCapture()

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return forward_capturing(self, inputs, cache)

    def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
        return keep_nextn_layer(weights, self.args.num_hidden_layers, super().sanitize)
