"""Tiny random MTP models (DeepSeek-V3, GLM-4.5 MoE, GLM-4.7-Flash, MiMo), SmolLM2's tokenizer.

Like `tiny_model.py`, but the architecture is mlx-lm's `deepseek_v3` (MLA attention; a dense first
layer and a small mixture of experts after it), `glm4_moe_lite` (the same kind: MLA, dense then
MoE) or `glm4_moe` (grouped-query attention with q/k norms, biases and partial RoPE; the same
dense-then-MoE layout), and the weights carry, as those
checkpoints do, one multi-token-prediction layer under `model.layers.{num_hidden_layers}` (enorm,
hnorm, eh_proj, a transformer block, shared_head.norm, and copies of the embedding and head),
which mlx-lm's own loader would refuse (strict loading) and `engine/mtp.py` keeps; or mlx-lm's
`mimo` (a dense Qwen2-style model) with MiMo's MTP layer under `model.mtp_layers.0`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from trio_mlx.engine.default_model import default_gguf_path
from trio_mlx.engine.gguf_tokenizer import write_tokenizer_files

TINY_MTP_CONFIG = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


TINY_GLM4_MOE_MTP_CONFIG = {
    "model_type": "glm4_moe",
    "architectures": ["Glm4MoeForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": True,
    "attention_bias": True,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_MIMO_MTP_CONFIG = {
    "model_type": "mimo",
    "architectures": ["MiMoForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_GLM4_MOE_LITE_MTP_CONFIG = {
    **{k: v for k, v in TINY_MTP_CONFIG.items() if k not in ("architectures",)},
    "model_type": "glm4_moe_lite",
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "q_lora_rank": 32,
    "rms_norm_eps": 1e-5,
}

#: the families `build_tiny_mtp_model` builds: their config and mlx-lm module and decoder layer
FAMILIES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo")


def _family(name: str) -> tuple[dict[str, Any], Any, Any]:
    if name == "deepseek_v3":
        from mlx_lm.models import deepseek_v3

        return TINY_MTP_CONFIG, deepseek_v3, deepseek_v3.DeepseekV3DecoderLayer
    if name == "glm4_moe":
        from mlx_lm.models import glm4_moe

        return TINY_GLM4_MOE_MTP_CONFIG, glm4_moe, glm4_moe.DecoderLayer
    if name == "glm4_moe_lite":
        from mlx_lm.models import glm4_moe_lite

        config = TINY_GLM4_MOE_LITE_MTP_CONFIG
        return config, glm4_moe_lite, glm4_moe_lite.Glm4MoeLiteDecoderLayer
    if name == "mimo":
        from mlx_lm.models import mimo

        return TINY_MIMO_MTP_CONFIG, mimo, mimo.TransformerBlock
    raise ValueError(f"no tiny MTP model of family {name!r} (have {', '.join(FAMILIES)})")


def _scaled(params: dict[str, mx.array]) -> dict[str, mx.array]:
    # Larger than default init so that the logits are spread out and greedy choices are stable.
    return {k: v * 4.0 if v.ndim == 2 and "embed_q" not in k else v for k, v in params.items()}


def _mimo_mtp_layer(args: Any, layer_class: Any, *, echo: bool) -> dict[str, mx.array]:
    """MiMo's MTP layer as its checkpoints lay it out: under `model.mtp_layers.0`, a Qwen2-style
    decoder layer's weights and its own norms and `input_proj` (over [hidden | embedding]).
    `echo`: input_proj = [I | 0] and the block's output projections zero."""
    prefix = "model.mtp_layers.0."
    width = args.hidden_size
    params = {
        prefix + key: value
        for key, value in _scaled(dict(tree_flatten(layer_class(args).parameters()))).items()
    }
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        params[f"{prefix}{norm}.weight"] = mx.ones((width,))
    params[prefix + "input_proj.weight"] = (
        4.0 * mx.random.normal((width, 2 * width)) * ((2 * width) ** -0.5)
    )
    if echo:
        eye = mx.concatenate([mx.eye(width), mx.zeros((width, width))], axis=1)
        params[prefix + "input_proj.weight"] = eye
        for part in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            params[prefix + part] = mx.zeros_like(params[prefix + part])
    return params


def _routed(params: dict[str, mx.array]) -> dict[str, mx.array]:
    # The router's weights (zero at init) random, so that tokens go to different experts.
    return {
        k: mx.random.normal(v.shape) * 0.5 if k.endswith("mlp.gate.weight") else v
        for k, v in params.items()
    }


def build_tiny_mtp_model(
    out_dir: Path,
    *,
    seed: int = 0,
    with_mtp: bool = True,
    echo: bool = False,
    copy_target: bool = False,
    family: str = "deepseek_v3",
) -> Path:
    """Write a `family` model directory with random weights (an MTP layer unless `with_mtp` is
    False: then the config declares none either) and the SmolLM2 tokenizer into `out_dir`.
    The main weights depend on `seed` only. `echo`: an MTP layer that passes the target's hidden
    state through unchanged (eh_proj = [0 | I], the block's output projections zero), so that it
    predicts again the token the target predicted at the position before: its drafts are the
    pending token repeated, accepted exactly where the target repeats a token. `copy_target`:
    the main layers' output projections zero and the head the embedding, so that the target
    predicts its input token again (greedy output: the prompt's last token repeated). `family`:
    one of `FAMILIES`."""
    family_config, module, layer_class = _family(family)

    out_dir.mkdir(parents=True, exist_ok=True)
    _weights, metadata = mx.load(str(default_gguf_path()), return_metadata=True)
    write_tokenizer_files(metadata, out_dir, source="SmolLM2 GGUF")
    config = dict(family_config)
    mx.random.seed(seed)
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    params = _routed(_scaled(dict(tree_flatten(model.parameters()))))
    if copy_target:
        for key in list(params):
            if key.endswith(("o_proj.weight", "down_proj.weight")):
                params[key] = mx.zeros_like(params[key])
        params["lm_head.weight"] = params["model.embed_tokens.weight"]
    if with_mtp and family == "mimo":
        params.update(_mimo_mtp_layer(args, layer_class, echo=echo))
    elif with_mtp:
        n = args.num_hidden_layers
        block = layer_class(args, n)
        prefix = f"model.layers.{n}."
        for key, value in _routed(_scaled(dict(tree_flatten(block.parameters())))).items():
            params[prefix + key] = value
        width = args.hidden_size
        params[prefix + "enorm.weight"] = mx.ones((width,))
        params[prefix + "hnorm.weight"] = mx.ones((width,))
        params[prefix + "shared_head.norm.weight"] = mx.ones((width,))
        params[prefix + "eh_proj.weight"] = (
            4.0 * mx.random.normal((width, 2 * width)) * ((2 * width) ** -0.5)
        )
        if echo:
            eye = mx.concatenate([mx.zeros((width, width)), mx.eye(width)], axis=1)
            params[prefix + "eh_proj.weight"] = eye
            for part in (
                "self_attn.o_proj.weight",
                "mlp.switch_mlp.down_proj.weight",
                "mlp.shared_experts.down_proj.weight",
            ):
                params[prefix + part] = mx.zeros_like(params[prefix + part])
        params[prefix + "embed_tokens.weight"] = params["model.embed_tokens.weight"]
        params[prefix + "shared_head.head.weight"] = params["lm_head.weight"]
    else:
        config["num_nextn_predict_layers"] = 0
    mx.save_safetensors(str(out_dir / "model.safetensors"), params)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
