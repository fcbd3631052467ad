"""Benchmark subjects: mlx-lm model directories built or found locally, never downloaded.

- `tiny`: a random 2-layer llama (hidden 64) with the SmolLM2 tokenizer, as the tests build it
  (weights scaled up so that greedy choices are stable), context 8192 so 2k-token prompts fit;
- `smollm2`: the bundled SmolLM2-135M-Instruct, converted by trio-mlx (the directory that
  `trio-mlx serve` with no model uses, under ~/.cache/trio-mlx/converted/);
- `smollm2-fp16`, `smollm2-fp32`: the same weights dequantized (a dense target for which the
  bundled 4-bit model is a real draft);
- `synthetic:<shape>-<dtype>` and `synthetic:<shape>-q<bits>`: a random-weight llama of a real
  shape, e.g. `synthetic:llama-1b-bf16`, `synthetic:llama-8b-q4` (bfloat16 weights quantized to
  4 bits, group size 64). Throughput does not depend on weight values; report it as synthetic.

Every built directory carries the SmolLM2 tokenizer and chat template (from the bundled GGUF).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "tiny16": {  # the tiny model's layers, 16 of them: a CPU stand-in for a launch-bound step
        "hidden_size": 64,
        "num_hidden_layers": 16,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "llama-1b": {  # Llama-3.2-1B
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "llama-8b": {  # Llama-3-8B
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}

BASE_CONFIG = {
    "model_type": "llama",
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class Subject:
    spec: str  # as given on the command line
    path: Path
    description: str
    synthetic: bool  # random weights


def write_tokenizer(out: Path) -> None:
    """Write the SmolLM2 tokenizer files (tokenizer.json, tokenizer_config.json, chat template).

    From $TRIO_MLX_BENCH_TOKENIZER's directory when it is set (the GPU host cannot fetch the GGUF).
    """
    import shutil

    import mlx.core as mx

    staged = os.environ.get("TRIO_MLX_BENCH_TOKENIZER")
    if staged:
        out.mkdir(parents=True, exist_ok=True)
        for item in Path(staged).iterdir():
            shutil.copy(item, out / item.name)
        return

    from trio_mlx.engine.default_model import default_gguf_path
    from trio_mlx.engine.gguf_tokenizer import write_tokenizer_files

    _weights, metadata = mx.load(str(default_gguf_path()), return_metadata=True)
    write_tokenizer_files(metadata, out, source="SmolLM2 GGUF")


def build_llama(
    out: Path,
    shape: str,
    *,
    dtype: str = "bfloat16",
    bits: int | None = None,
    scale: float = 1.0,
    seed: int = 0,
    tokenizer_from: Path | None = None,
) -> Path:
    """Write a random-weight llama of `shape` as an mlx-lm directory (kept if already complete)."""
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    out.mkdir(parents=True, exist_ok=True)
    config: dict[str, object] = {**BASE_CONFIG, **SHAPES[shape]}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params = model.parameters()
    if scale != 1.0:
        params = tree_map(lambda p: p * scale if p.ndim == 2 else p, params)
    model.update(tree_map(lambda p: p.astype(getattr(mx, dtype)), params))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    tmp = out / "partial.safetensors"  # mx adds .safetensors to other names
    mx.save_safetensors(str(tmp), weights)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, out / name)
    else:
        write_tokenizer(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out / "model.safetensors")
    return out


def build_dequantized(source: Path, out: Path, dtype: str) -> Path:
    """A dense copy of the quantized mlx-lm model in `source` (its weights dequantized to
    `dtype`, same tokenizer): a target for which the quantized original is a real draft."""
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model, load_model

    model, config = load_model(source)
    dequantize_model(model)
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "partial.safetensors"), weights)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    (out / "partial.safetensors").rename(out / "model.safetensors")
    return out


def structural_copy(module: Any) -> Any:
    """A copy of an `mlx.nn.Module` tree whose modules are new objects and whose arrays are the
    same: changing the copy's structure in place (trio-mlx's `compiled_decode` fuses projections
    at load) leaves the original's untouched, for no memory."""
    import copy

    import mlx.nn as nn

    if isinstance(module, nn.Module):
        new = copy.copy(module)
        for key, value in module.items():
            dict.__setitem__(new, key, structural_copy(value))
        return new
    if isinstance(module, list):
        return [structural_copy(v) for v in module]
    if isinstance(module, dict):
        return {k: structural_copy(v) for k, v in module.items()}
    return module


def _tokenizer_dir() -> Path | None:
    """Where to copy the tokenizer from instead of the bundled GGUF (for hosts without it)."""
    where = os.environ.get("TRIO_MLX_BENCH_TOKENIZER")
    return Path(where) if where else None


def resolve_subject(spec: str, workdir: Path) -> Subject:
    """The model directory for a `--model` spec (see the module docstring).

    Built directories take their tokenizer from $TRIO_MLX_BENCH_TOKENIZER (a directory holding
    tokenizer.json and tokenizer_config.json) when set, else from the bundled GGUF.
    """
    tok = _tokenizer_dir()
    if spec == "tiny":
        path = build_llama(workdir / "tiny", "tiny", dtype="float32", scale=4.0, tokenizer_from=tok)
        return Subject(spec, path, "random llama, 2 layers, hidden 64, fp32", True)
    if spec == "smollm2":
        from trio_mlx.engine.model_spec import resolve_model_path

        path = resolve_model_path(None).path
        return Subject(spec, path, "SmolLM2-135M-Instruct Q4_1 (bundled GGUF, converted)", False)
    if spec in ("smollm2-fp16", "smollm2-fp32"):
        from trio_mlx.engine.model_spec import resolve_model_path

        dtype = {"smollm2-fp16": "float16", "smollm2-fp32": "float32"}[spec]
        path = build_dequantized(resolve_model_path(None).path, workdir / spec, dtype)
        return Subject(spec, path, f"SmolLM2-135M-Instruct Q4_1 dequantized to {dtype}", False)
    if spec.startswith("synthetic:"):
        name = spec.split(":", 1)[1]
        shape, _, kind = name.rpartition("-")
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r} in {spec!r}: {sorted(SHAPES)}")
        dtypes = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
        if kind in dtypes:
            path = build_llama(workdir / name, shape, dtype=dtypes[kind], tokenizer_from=tok)
            return Subject(spec, path, f"random llama {shape} shape, {kind}", True)
        if kind.startswith("q") and kind[1:].isdigit():
            path = build_llama(
                workdir / name, shape, dtype="bfloat16", bits=int(kind[1:]), tokenizer_from=tok
            )
            return Subject(spec, path, f"random llama {shape} shape, {kind[1:]}-bit (g64)", True)
        raise SystemExit(f"unknown kind {kind!r} in {spec!r}: bf16, fp16, fp32 or q<bits>")
    path = Path(spec).expanduser()
    if (path / "config.json").exists():
        return Subject(spec, path, f"mlx-lm directory {path.name}", False)
    raise SystemExit(f"unknown model {spec!r}: tiny, smollm2, synthetic:<shape>-<kind>, or a dir")
