"""A tiny randomly initialised Qwen2-VL, Qwen2.5-VL or LLaVA, built offline: the one recipe tests,
benchmarks and the README use for a vision-language model.

- weights: mlx-vlm's own `qwen2_vl.Model` (or `qwen2_5_vl.Model`), scaled down (text hidden 64,
  2 layers, 4 heads / 2 KV heads, mrope sections [2, 3, 3]; vision 2 blocks, embed 32, patch 14,
  merge 2; Qwen2.5-VL's tower: width 32, windows of 56 pixels, block 1 of full attention),
  saved in mlx-vlm's sanitized layout. The residual output projections are scaled up so that an
  image visibly changes the greedy output (plain random init gives the same answer whatever
  the image).
- tokenizer: SmolLM2's byte-level BPE (rebuilt from the bundled GGUF, as `tiny_model.py` does)
  plus Qwen2-VL's `<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>` (ids
  49152-49155), Qwen2-VL's chat template, EOS `<|im_end|>`.
- image processor: `preprocessor_config.json` for mlx-vlm's numpy Qwen image processor, mean/std
  0.5, small `min_pixels`/`max_pixels` so that a 56x56 image is 4 image tokens.

LLaVA (`model_type="llava"`: a family without MRoPE, its tokens at the cache offset as a text
model's) is built the same way: mlx-vlm's `llava.Model` (llama text model of the same tiny shape,
a CLIP vision tower of 2 layers, width 32, patch 14 over 56x56 images: 16 image tokens), the same
SmolLM2 tokenizer plus `<image>` (id 49152) and a ChatML template, and transformers-format
processor files (`preprocessor_config.json` for a `CLIPImageProcessor`, `processor_config.json`
for the `LlavaProcessor` mlx-vlm loads).

`python tests/tiny_vlm.py OUT_DIR [qwen2_5_vl|llava]` writes one (for a benchmark or to try the
README's examples).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from trio_mlx.engine.default_model import default_gguf_path
from trio_mlx.engine.gguf_tokenizer import write_tokenizer_files

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 49152, 49153, 49154, 49155

#: Qwen2-VL's chat template (the structure of the published one: a default system prompt, image
#: and video placeholders inside the user turn, `<|im_start|>assistant` as the generation prompt).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen2_vl",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 49156,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "sliding_window": 2048,
    "use_sliding_window": False,
}

VISION_CONFIG: dict[str, Any] = {
    "model_type": "qwen2_vl",
    "depth": 2,
    "embed_dim": 32,
    "hidden_size": 64,  # the merger's output: the text model's hidden size
    "num_heads": 2,
    "mlp_ratio": 2,  # an int: transformers' strict Qwen2VLConfig refuses 2.0
    "in_channels": 3,
    "in_chans": 3,
    "patch_size": 14,
    "spatial_patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

#: What a Qwen2.5-VL tower needs beyond Qwen2-VL's: `hidden_size` is the tower's own width there
#: and `out_hidden_size` the merger's output (the text model's hidden size); attention in windows
#: of `window_size` pixels (a multiple of patch x merge = 28) except in `fullatt_block_indexes`.
QWEN2_5_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "tokens_per_second": 2,
}
#: model_type -> (HF architecture, the tiny vision settings over VISION_CONFIG)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", {}),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", QWEN2_5_VISION_CONFIG),
}

#: pixels of the smallest and largest image after resizing (multiples of (14*2)^2 = 784)
MIN_PIXELS = 784
MAX_PIXELS = 784 * 64


def tiny_vlm_config(
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    model_type: str = "qwen2_vl",
) -> dict[str, Any]:
    """config.json: the text settings at the root (mlx-vlm reads them there) and in
    `text_config` (transformers reads them there). `model_type` is one of `ARCHITECTURES`;
    `text` / `vision` override the tiny shape (the benchmarks build real shapes this way)."""
    architecture, tiny_vision = ARCHITECTURES[model_type]
    text_config = {**TEXT_CONFIG, **(text or {}), "model_type": model_type}
    vision_config = {**VISION_CONFIG, **tiny_vision, **(vision or {}), "model_type": model_type}
    return {
        **text_config,
        "architectures": [architecture],
        "text_config": dict(text_config),
        "vision_config": vision_config,
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _write_tokenizer(
    out_dir: Path,
    tokens: tuple[str, ...] = VISION_TOKENS,
    ids: tuple[int, ...] = (VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID),
    template: str = CHAT_TEMPLATE,
) -> None:
    """SmolLM2's tokenizer plus `tokens` (as `ids`), `template` its chat template."""
    from transformers import AutoTokenizer

    copied = os.environ.get("TRIO_MLX_BENCH_TOKENIZER")  # a host without the GGUF (benchmarks)
    if copied:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(copied) / name).exists():
                shutil.copy(Path(copied) / name, out_dir / name)
    else:
        _weights, metadata = mx.load(str(default_gguf_path()), return_metadata=True)
        write_tokenizer_files(metadata, out_dir, source="SmolLM2 GGUF")
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    added = tokenizer.convert_tokens_to_ids(list(tokens))
    assert added == list(ids), added
    tokenizer.chat_template = template
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))


def _write_image_processor(
    out_dir: Path,
    max_pixels: int = MAX_PIXELS,
    *,
    min_pixels: int = MIN_PIXELS,
    patch_size: int = 14,
    processor_class: str = "Qwen2VLProcessor",
) -> None:
    """Qwen2-VL's image processor settings (mlx-vlm's numpy one), sized for tiny images; the
    keywords let a Qwen3-class recipe (`tiny_vlm_drafter.py`) use it too."""
    settings = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(settings, indent=2))


LLAVA_IMAGE_TOKEN, LLAVA_IMAGE_TOKEN_ID = "<image>", 49152
#: the tiny LLaVA's images: resized and cropped to this square (patch 14: 4x4 patches)
LLAVA_IMAGE_SIZE = 56

#: a ChatML template with LLaVA's `<image>` placeholder before the user's text
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<image>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_llava_config() -> dict[str, Any]:
    """config.json of the tiny LLaVA: a llama text model of `TEXT_CONFIG`'s shape (plain rope)
    and a CLIP tower; the image features of the tower's second-to-last layer, CLS dropped."""
    text = {
        key: TEXT_CONFIG[key]
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
            "tie_word_embeddings",
        )
    }
    text |= {"model_type": "llama", "vocab_size": LLAVA_IMAGE_TOKEN_ID + 1}
    vision = {
        "model_type": "clip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "image_size": LLAVA_IMAGE_SIZE,
        "patch_size": 14,
        "projection_dim": 32,
        "num_channels": 3,
        "layer_norm_eps": 1e-5,
    }
    return {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "image_token_index": LLAVA_IMAGE_TOKEN_ID,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": text["vocab_size"],
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _write_llava_processor(out_dir: Path) -> None:
    """transformers' LLaVA processor files: a `CLIPImageProcessor` (resize and crop to 56x56,
    mean/std 0.5) and the processor's settings (16 image tokens: 4x4 patches + CLS - CLS)."""
    size = LLAVA_IMAGE_SIZE
    image = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_resize": True,
        "size": {"shortest_edge": size},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": size, "width": size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    processor = {
        "processor_class": "LlavaProcessor",
        "image_token": LLAVA_IMAGE_TOKEN,
        "patch_size": 14,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,
    }
    (out_dir / "processor_config.json").write_text(json.dumps(processor, indent=2))


def build_tiny_vlm(
    out_dir: Path,
    *,
    seed: int = 0,
    model_type: str = "qwen2_vl",
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    max_pixels: int = MAX_PIXELS,
    dtype: Any = None,
) -> Path:
    """Write a tiny Qwen2-VL directory (config, random weights, tokenizer, image processor).
    `model_type` ("qwen2_vl", "qwen2_5_vl": its tiny tower; "llava": the tiny LLaVA, whose
    shape `text` / `vision` / `max_pixels` do not change), `text`, `vision`, `max_pixels` and
    `dtype` build other shapes with the same tokenizer (benchmarks: `bench/multimodal.py`)."""
    import importlib

    from mlx_vlm.utils import update_module_configs

    arch = importlib.import_module(f"mlx_vlm.models.{model_type}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if model_type == "llava":
        _write_tokenizer(
            out_dir, (LLAVA_IMAGE_TOKEN,), (LLAVA_IMAGE_TOKEN_ID,), LLAVA_CHAT_TEMPLATE
        )
        _write_llava_processor(out_dir)
        config = tiny_llava_config()
    else:
        _write_tokenizer(out_dir)
        _write_image_processor(out_dir, max_pixels)
        config = tiny_vlm_config(text, vision, model_type)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    settings = json.loads(json.dumps(config))
    model_config = update_module_configs(
        arch.ModelConfig.from_dict(settings), arch, settings, ["text", "vision"]
    )
    model = arch.Model(model_config)
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2:
            value = value * 4.0
        if name.endswith(
            ("o_proj.weight", "down_proj.weight", "mlp.fc2.weight", "attn.proj.weight")
        ):
            value = value * 3.0
        if model_type == "llava" and name.endswith("out_proj.weight"):  # CLIP's attention
            value = value * 3.0
        params[name] = value if dtype is None else value.astype(dtype)
    mx.save_safetensors(str(out_dir / "model.safetensors"), params)
    return out_dir


if __name__ == "__main__":
    # python tests/tiny_vlm.py OUT_DIR [MODEL_TYPE]
    print(build_tiny_vlm(Path(sys.argv[1]), model_type=(sys.argv[2:] or ["qwen2_vl"])[0]))
