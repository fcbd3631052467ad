"""A tiny random Qwen3.5 vision-language model and a tiny random DFlash drafter for it, built
offline from mlx-vlm's own classes (`mlx_vlm.models.qwen3_5`,
`mlx_vlm.speculative.drafters.qwen3_dflash`): the pair the mlx-vlm drafter tests use.

- target: Qwen3.5's hybrid language model (text hidden 64, 4 layers: linear attention (gated
  delta) and full attention alternating, 4 heads / 2 KV heads of 16, mrope sections [2, 3, 3]),
  its vision tower (2 blocks, width 32, patch 16, merge 2, no deepstack), tests/tiny_vlm.py's
  tokenizer (SmolLM2 plus the Qwen vision tokens at 49152-49155) and chat template, an image
  processor for which a 64x64 image is 4 image tokens. Weights scaled up as tiny_vlm.py does,
  so that the image changes the greedy output.
- drafter: a one-layer DFlash drafter (`qwen3_dflash`: `dflash_config` in its config), reading
  the target's layers 1 and 3, block size 4; it uses the target's embeddings and output layer.
  Random: it proposes tokens the target mostly refuses, which is what a lossless check needs
  (every round verifies, rolls the target's caches back and takes the target's token).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

import tiny_vlm

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5",
    "hidden_size": 64,
    "intermediate_size": 128,
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": 49156,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "type": "default",
        "mrope_section": [2, 3, 3],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
    },
}

VISION_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5",
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "in_channels": 3,
    "deepstack_visual_indexes": [],
}

#: pixels of the smallest and largest image after resizing (multiples of (16*2)^2 = 1024)
MIN_PIXELS = 1024
MAX_PIXELS = 1024 * 64


def build_tiny_qwen3_5(out_dir: Path, *, seed: int = 0) -> Path:
    """Write the tiny Qwen3.5 directory (config, random weights, tokenizer, image processor)."""
    arch = importlib.import_module("mlx_vlm.models.qwen3_5")
    from mlx_vlm.utils import update_module_configs

    out_dir.mkdir(parents=True, exist_ok=True)
    tiny_vlm._write_tokenizer(out_dir)
    tiny_vlm._write_image_processor(
        out_dir,
        MAX_PIXELS,
        min_pixels=MIN_PIXELS,
        patch_size=16,
        processor_class="Qwen3VLProcessor",
    )
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": TEXT_CONFIG,
        "vision_config": VISION_CONFIG,
        "image_token_id": tiny_vlm.IMAGE_TOKEN_ID,
        "video_token_id": tiny_vlm.VIDEO_TOKEN_ID,
        "vision_start_token_id": tiny_vlm.VISION_START_ID,
        "vision_end_token_id": tiny_vlm.VISION_END_ID,
        "vocab_size": TEXT_CONFIG["vocab_size"],
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    settings = json.loads(json.dumps(config))
    model_config = update_module_configs(
        arch.ModelConfig.from_dict(settings), arch, settings, ["text", "vision"]
    )
    model = arch.Model(model_config)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2 and "conv1d" not in name:
            value = value * 4.0
        if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
            value = value * 3.0
        params[name] = value
    mx.save_safetensors(str(out_dir / "model.safetensors"), params)
    return out_dir


def build_tiny_dflash_drafter(
    out_dir: Path, *, hidden_size: int = 64, block_size: int = 4, seed: int = 1
) -> Path:
    """Write a tiny random DFlash drafter for `build_tiny_qwen3_5`'s target (`hidden_size`
    other than 64 makes one that does not fit it)."""
    drafters = importlib.import_module("mlx_vlm.speculative.drafters.qwen3_dflash")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": TEXT_CONFIG["vocab_size"],
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": [1, 3]},
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    model = drafters.Model(drafters.ModelConfig.from_dict(config))
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out_dir
