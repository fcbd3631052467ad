"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

The result is what `mlx_lm.load` reads: `config.json` (the llama hyper-parameters from the GGUF
metadata, plus a per-module `quantization` map), `model.safetensors` and the tokenizer files.

How tensors come across:
- Q4_0, Q4_1 and Q8_0 stay quantized: `mlx.core.load` already unpacks them into MLX's affine layout
  (`weight` uint32, `scales`, `biases`; group size 32; 4, 4 and 8 bits). Nothing is re-quantized.
- Q4_K (as in the common Q4_K_M files) is repacked losslessly into MLX's 4-bit, group-32 layout
  (see `gguf_quants`).
- F32, F16 and BF16 stay dense in their own dtype.
- Q6_K is dequantized to float16 by MLX's loader (its groups of 16 have no MLX quantized form):
  exact values, but dense, about 2.4 times its GGUF size in memory.
- Every other type is refused with a `ModelLoadError` naming the tensor and its type.

llama.cpp's converter reorders the rows of `attn_q` / `attn_k` within each head (it interleaves the
two rotary halves); this module undoes that, so that mlx-lm's llama (rotate-half RoPE) sees the
original order. Quantization groups run along rows, so whole rows of weight/scales/biases move.

Conversion is atomic: everything is written into a hidden sibling directory which is renamed onto
`out_dir` at the end, so an interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from trio_mlx.engine.gguf_quants import bf16_array, q4_k_to_mlx
from trio_mlx.engine.gguf_reader import GGUFHeader, TensorInfo, read_gguf_header, read_tensor_bytes
from trio_mlx.engine.gguf_tokenizer import write_tokenizer_files
from trio_mlx.errors import ModelLoadError

log = logging.getLogger(__name__)

#: GGML types kept quantized, and their MLX affine (bits, group size).
_KEPT_QUANTIZED: Mapping[str, tuple[int, int]] = {
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q8_0": (8, 32),
    "Q4_K": (4, 32),
}
#: GGML types loaded dense: in their own dtype, or dequantized to float16 by MLX's loader.
_DENSE = frozenset({"F32", "F16", "BF16", "Q6_K"})
SUPPORTED_TENSOR_TYPES = tuple(sorted({*_KEPT_QUANTIZED, *_DENSE}))

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
_WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class _Target:
    """Where one GGUF tensor goes: the mlx-lm module path, the parameter, the q/k head count."""

    module: str
    param: str
    rope_heads: int | None


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert the llama GGUF file `gguf_path` into a new mlx-lm model directory `out_dir`.

    `out_dir` must not exist yet (or be an empty directory); its parent is created. Returns
    `out_dir`. Raises `ModelLoadError`, naming the file and the reason, for a missing, corrupt or
    truncated file, an architecture other than llama, or a tensor type that cannot be loaded; on
    any failure nothing is left at `out_dir`.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    started = time.monotonic()
    header = read_gguf_header(gguf_path)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(f"{out_dir}: already exists and is not an empty directory")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
        staging.chmod(0o755)  # mkdtemp's 0o700 would make the model private to this user
    except OSError as exc:
        raise ModelLoadError(f"{out_dir}: cannot create: {exc.strerror or exc}") from exc
    try:
        _write_model_files(header, staging)
        os.replace(staging, out_dir)  # atomic; replaces only an empty directory
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelLoadError(f"{out_dir}: cannot write the converted model: {exc}") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("converted %s into %s in %.1f s", gguf_path, out_dir, time.monotonic() - started)
    return out_dir


def _write_model_files(header: GGUFHeader, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files into `out_dir`."""
    gguf_path = header.path
    architecture = header.metadata.get("general.architecture")
    if architecture != "llama":
        raise ModelLoadError(
            f"{gguf_path}: unsupported architecture {architecture!r} "
            "(trio-mlx converts llama-architecture GGUF files only)"
        )
    hparams = _LlamaParams.from_header(header)
    targets = _plan(header, hparams)
    arrays = _load_arrays(header)
    weights, quantized = _convert_tensors(header, arrays, targets)
    config = hparams.config(header, _quantization_config(header, targets, quantized))
    try:
        mx.save_safetensors(str(out_dir / _WEIGHTS_FILE), weights, metadata={"format": "mlx"})
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    except (OSError, RuntimeError) as exc:  # MLX reports a failed write as RuntimeError
        raise ModelLoadError(f"{out_dir}: cannot write: {exc}") from exc
    write_tokenizer_files(header.metadata, out_dir, source=str(gguf_path))


@dataclass(frozen=True)
class _LlamaParams:
    """The llama hyper-parameters a GGUF file's metadata and tensor table determine."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    rope_scaling: dict[str, Any] | None

    @classmethod
    def from_header(cls, header: GGUFHeader) -> _LlamaParams:
        meta, path = header.metadata, header.path

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"llama.{key}", default)
            if isinstance(value, list):  # per-layer values: only uniform ones fit llama
                if not value or any(v != value[0] for v in value):
                    raise ModelLoadError(f"{path}: llama.{key} varies across layers")
                value = value[0]
            if value is None:
                raise ModelLoadError(f"{path}: the GGUF metadata has no llama.{key}")
            return value

        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        kv_heads = int(get("attention.head_count_kv", heads))
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise ModelLoadError(f"{path}: {heads} attention heads and {kv_heads} KV heads")
        head_dim = int(get("attention.key_length", hidden // heads))
        if head_dim <= 0 or head_dim % 2:
            raise ModelLoadError(f"{path}: head size {head_dim} is not a positive even number")
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise ModelLoadError(f"{path}: different key and value head sizes are not supported")
        if int(get("rope.dimension_count", head_dim)) != head_dim:
            raise ModelLoadError(f"{path}: partial rotary embeddings are not supported")
        embedding = header.tensors.get("token_embd.weight")
        if embedding is None or len(embedding.shape) != 2 or embedding.shape[1] != hidden:
            raise ModelLoadError(f"{path}: no token_embd.weight of width {hidden}")
        theta = float(get("rope.freq_base", 10000.0))
        layers = int(get("block_count"))
        if not 0 < layers <= len(header.tensors):  # each layer is at least one tensor
            raise ModelLoadError(f"{path}: block_count {layers} does not fit its tensors")
        return cls(
            hidden_size=hidden,
            num_layers=layers,
            intermediate_size=int(get("feed_forward_length")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=theta,
            context_length=int(get("context_length", 2048)),
            vocab_size=embedding.shape[0],
            tied_embeddings="output.weight" not in header.tensors,
            rope_scaling=_rope_scaling(header, head_dim, theta),
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape each GGUF weight must have, by tensor kind (`attn_q`, `token_embd`, ...)."""
        hidden, ffn = self.hidden_size, self.intermediate_size
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "token_embd": (self.vocab_size, hidden),
            "output": (self.vocab_size, hidden),
            "output_norm": (hidden,),
            "attn_norm": (hidden,),
            "ffn_norm": (hidden,),
            "attn_q": (q_rows, hidden),
            "attn_k": (kv_rows, hidden),
            "attn_v": (kv_rows, hidden),
            "attn_output": (hidden, q_rows),
            "ffn_gate": (ffn, hidden),
            "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn),
        }

    def config(self, header: GGUFHeader, quantization: dict[str, Any] | None) -> dict[str, Any]:
        """The mlx-lm / Hugging Face `config.json` contents."""
        meta = header.metadata
        eos = [
            meta[key]
            for key in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            )
            if isinstance(meta.get(key), int)
        ]
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.context_length,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tied_embeddings,
            "attention_bias": "blk.0.attn_q.bias" in header.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in header.tensors,
        }
        if isinstance(meta.get("tokenizer.ggml.bos_token_id"), int):
            config["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
        if eos:
            unique = list(dict.fromkeys(eos))
            config["eos_token_id"] = unique[0] if len(unique) == 1 else unique
        if quantization is not None:
            config["quantization"] = quantization
            config["quantization_config"] = quantization
        return config


def _rope_scaling(header: GGUFHeader, head_dim: int, theta: float) -> dict[str, Any] | None:
    """The `rope_scaling` entry: linear from the metadata, or llama3 from a `rope_freqs` tensor."""
    meta, path = header.metadata, header.path
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "linear":
        return {"type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    if kind not in ("none", None):
        raise ModelLoadError(f"{path}: unsupported rope scaling {kind!r}")
    info = header.tensors.get(_ROPE_FREQS)
    if info is None:
        return None
    if info.ggml_type.name != "F32" or info.shape != (head_dim // 2,):
        raise ModelLoadError(f"{path}: rope_freqs.weight is not {head_dim // 2} float32 values")
    factors = np.frombuffer(read_tensor_bytes(header, _ROPE_FREQS), dtype="<f4")
    # llama.cpp stores Llama 3's frequency-dependent rope factors as a tensor; mlx-lm computes
    # them from four numbers. Llama 3.x uses low/high frequency factors 1 and 4; recompute the
    # factors from those and accept only an exact fit.
    original = int(meta.get("llama.rope.scaling.original_context_length", 8192))
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    if not np.allclose(llama3_rope_factors(scaling, head_dim, theta), factors, rtol=1e-4):
        raise ModelLoadError(f"{path}: rope_freqs.weight does not match Llama 3 rope scaling")
    return scaling


def llama3_rope_factors(scaling: Mapping[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """The per-frequency divisors that Llama 3 rope scaling applies (llama.cpp's `rope_freqs`)."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (original / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium)
    )
    return out.astype(np.float32)


def _plan(header: GGUFHeader, hparams: _LlamaParams) -> dict[str, _Target]:
    """Map every GGUF tensor to its mlx-lm parameter; refuse unknown names and types up front."""
    path = header.path
    unsupported = [
        f"{t.name} ({t.ggml_type.name})"
        for t in header.tensors.values()
        if t.name != _ROPE_FREQS and t.ggml_type.name not in SUPPORTED_TENSOR_TYPES
    ]
    if unsupported:
        shown = ", ".join(unsupported[:3]) + (", ..." if len(unsupported) > 3 else "")
        raise ModelLoadError(
            f"{path}: {len(unsupported)} tensor(s) of a type trio-mlx cannot load: {shown} "
            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
        )
    shapes = hparams.weight_shapes()
    targets: dict[str, _Target] = {}
    for name, info in header.tensors.items():
        if name == _ROPE_FREQS:
            continue
        base, _, param = name.rpartition(".")
        match = _LAYER_NAME.fullmatch(name)
        if base in _GLOBAL_TENSORS and param == "weight":
            kind, module, heads = base, _GLOBAL_TENSORS[base], None
        elif match is not None and match[2] in _LAYER_TENSORS:
            layer, kind = int(match[1]), match[2]
            if layer >= hparams.num_layers:
                raise ModelLoadError(f"{path}: tensor {name!r} is past block_count")
            module = f"model.layers.{layer}.{_LAYER_TENSORS[kind]}"
            heads = {"attn_q": hparams.num_heads, "attn_k": hparams.num_kv_heads}.get(kind)
        else:
            raise ModelLoadError(f"{path}: unexpected tensor {name!r} for a llama model")
        expected = shapes[kind] if param == "weight" else shapes[kind][:1]
        if info.shape != expected:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has shape {info.shape}, "
                f"expected {expected} from the metadata"
            )
        targets[name] = _Target(module, param, heads)

    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{kind}.weight" for i in range(hparams.num_layers) for kind in _LAYER_TENSORS
    ]
    missing = [name for name in required if name not in header.tensors]
    if missing:
        raise ModelLoadError(f"{path}: missing tensor(s) {', '.join(missing[:5])}")
    return targets


def _load_arrays(header: GGUFHeader) -> dict[str, mx.array]:
    """All tensors as MLX arrays (MLX's names: `X.weight`, and `X.scales` / `X.biases`)."""
    try:
        arrays = mx.load(str(header.path), format="gguf")
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelLoadError(f"{header.path}: MLX cannot read it: {exc}") from exc
    assert isinstance(arrays, dict)
    for info in header.tensors.values():
        kind = info.ggml_type.name
        if kind == "BF16":
            arrays[info.name] = bf16_array(read_tensor_bytes(header, info.name), info.shape)
        elif kind == "Q4_K":
            if len(info.shape) != 2:
                raise ModelLoadError(f"{header.path}: Q4_K tensor {info.name!r} is not a matrix")
            weight, scales, biases = q4_k_to_mlx(read_tensor_bytes(header, info.name), info.shape)
            stem = info.name.removesuffix(".weight")
            arrays.update({info.name: weight, f"{stem}.scales": scales, f"{stem}.biases": biases})
    return arrays


def _unpermute_rows(a: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k row order: per head, rows (half, 2) -> (2, half)."""
    rows = a.shape[0]
    return a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _convert_tensors(
    header: GGUFHeader, arrays: dict[str, mx.array], targets: Mapping[str, _Target]
) -> tuple[dict[str, mx.array], dict[str, tuple[int, int]]]:
    """The mlx-lm weights, and the (bits, group size) of each module kept quantized."""
    weights: dict[str, mx.array] = {}
    quantized: dict[str, tuple[int, int]] = {}
    for name, target in targets.items():
        info: TensorInfo = header.tensors[name]
        parts = {target.param: arrays[name]}
        if info.ggml_type.name in _KEPT_QUANTIZED:
            stem = name.removesuffix(".weight")
            parts["scales"] = arrays[f"{stem}.scales"]
            parts["biases"] = arrays[f"{stem}.biases"]
            quantized[target.module] = _KEPT_QUANTIZED[info.ggml_type.name]
        for param, value in parts.items():
            if target.rope_heads is not None:
                value = _unpermute_rows(value, target.rope_heads)
            weights[f"{target.module}.{param}"] = value
    return weights, quantized


def _quantization_config(
    header: GGUFHeader, targets: Mapping[str, _Target], quantized: Mapping[str, tuple[int, int]]
) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry: the most common (bits, group size) as the default, and an
    entry per module that differs from it (`False` for a dense matrix, a dict for other bits)."""
    if not quantized:
        return None
    (bits, group_size), _ = Counter(quantized.values()).most_common(1)[0]
    config: dict[str, Any] = {"group_size": group_size, "bits": bits}
    matrices = sorted(
        {t.module for name, t in targets.items() if len(header.tensors[name].shape) == 2}
    )
    for module in matrices:
        params = quantized.get(module)
        if params is None:
            config[module] = False
        elif params != (bits, group_size):
            config[module] = {"group_size": params[1], "bits": params[0]}
    return config
