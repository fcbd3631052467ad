"""A tiny randomly initialised llama with the real SmolLM2 tokenizer, for tests.

Built from the bundled GGUF's tokenizer metadata by the same conversion code the engine uses, so the
tokenizer, chat template and special tokens are the real ones; only the weights are random (and
tiny: 2 layers, hidden 64), which makes a forward pass take about a millisecond.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from trio_mlx.engine.default_model import default_gguf_path
from trio_mlx.engine.gguf_tokenizer import write_tokenizer_files

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def build_in_memory(model_type: str, *, tied: bool = True, seed: int = 3) -> Any:
    """A tiny random model of mlx-lm's `model_type` (llama, qwen2, qwen3, ...) in memory, no
    tokenizer: `TINY_CONFIG`'s sizes with a vocabulary of 4,096 and an explicit head size of 16,
    weights scaled up as `build_tiny_model`'s."""
    import importlib

    from mlx.utils import tree_map

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {
        **{k: v for k, v in TINY_CONFIG.items() if k not in ("bos_token_id", "eos_token_id")},
        "model_type": model_type,
        "vocab_size": 4096,
        "head_dim": 16,
        "tie_word_embeddings": tied,
    }
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def build_tiny_model(out_dir: Path, *, seed: int = 0, **overrides: object) -> Path:
    """Write an mlx-lm directory with random weights and the SmolLM2 tokenizer into `out_dir`."""
    from mlx_lm.models import llama

    out_dir.mkdir(parents=True, exist_ok=True)
    _weights, metadata = mx.load(str(default_gguf_path()), return_metadata=True)
    write_tokenizer_files(metadata, out_dir, source="SmolLM2 GGUF")
    config = {**TINY_CONFIG, **overrides}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Larger than default init so that the logits are spread out and greedy choices are stable.
    params = {k: v * 4.0 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out_dir / "model.safetensors"), params)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def build_perturbed_copy(source: Path, out_dir: Path, *, noise: float, seed: int = 1) -> Path:
    """A copy of the model in `source` (same config and tokenizer) with every weight matrix
    perturbed by Gaussian noise of `noise` times its own standard deviation: a draft model that
    agrees with its source on most tokens but not all."""
    import shutil

    shutil.copytree(source, out_dir)
    weights = mx.load(str(source / "model.safetensors"))
    assert isinstance(weights, dict)
    key = mx.random.key(seed)
    perturbed = {}
    for name, value in sorted(weights.items()):
        if value.ndim == 2:
            key, sub = mx.random.split(key)
            value = value + noise * mx.std(value) * mx.random.normal(value.shape, key=sub)
        perturbed[name] = value
    mx.save_safetensors(str(out_dir / "model.safetensors"), perturbed)
    return out_dir


def build_other_tokenizer_copy(source: Path, out_dir: Path) -> Path:
    """A copy of the model in `source` whose tokenizer gives two tokens each other's ids."""
    import shutil

    shutil.copytree(source, out_dir)
    path = out_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["t"], vocab["u"] = vocab["u"], vocab["t"]
    path.write_text(json.dumps(tokenizer))
    return out_dir
