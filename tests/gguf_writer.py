"""A minimal GGUF writer and the block quantizers of llama.cpp's simple formats, for tests.

Written from the GGUF format description (header, metadata key/values, tensor infos, aligned
tensor data, little-endian throughout) so that tests can make small GGUF files of every tensor
type the converter accepts, with weights whose dequantized values the test knows exactly.

Each quantizer returns the encoded bytes *and* the values a correct decoder must produce from them
(computed here in numpy from the bytes' own fields), so a test compares against the encoding, not
against the original floats.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"

# GGML tensor types (llama.cpp's `ggml_type`).
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 8, 12, 14, 30

# GGUF metadata value types.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = range(10)
UINT64, INT64, FLOAT64 = 10, 11, 12

_SCALAR_FORMATS = {
    UINT8: "<B",
    INT8: "<b",
    UINT16: "<H",
    INT16: "<h",
    UINT32: "<I",
    INT32: "<i",
    FLOAT32: "<f",
    BOOL: "<?",
    UINT64: "<Q",
    INT64: "<q",
    FLOAT64: "<d",
}


@dataclass(frozen=True)
class Typed:
    """A metadata value with an explicit GGUF type (for arrays: the element type)."""

    kind: int
    value: Any
    array: bool = False


@dataclass(frozen=True)
class Tensor:
    """A tensor to write: `shape` in MLX/numpy order (rows first), `data` already encoded."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: bytes


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _scalar(kind: int, value: Any) -> bytes:
    if kind == STRING:
        return _string(str(value))
    return struct.pack(_SCALAR_FORMATS[kind], value)


def _infer(value: Any) -> Typed:
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(BOOL, value)
    if isinstance(value, int):
        return Typed(UINT32, value)
    if isinstance(value, float):
        return Typed(FLOAT32, value)
    if isinstance(value, str):
        return Typed(STRING, value)
    if isinstance(value, Sequence) and value and isinstance(value[0], str):
        return Typed(STRING, list(value), array=True)
    if isinstance(value, Sequence):
        return Typed(INT32, list(value), array=True)
    raise TypeError(f"cannot infer a GGUF type for {value!r}")


def _metadata_value(value: Any) -> bytes:
    typed = _infer(value)
    if typed.array:
        items = b"".join(_scalar(typed.kind, v) for v in typed.value)
        return struct.pack("<IIQ", ARRAY, typed.kind, len(typed.value)) + items
    return struct.pack("<I", typed.kind) + _scalar(typed.kind, typed.value)


def gguf_bytes(
    metadata: Mapping[str, Any], tensors: Sequence[Tensor], *, alignment: int = 32
) -> bytes:
    """A whole GGUF (version 3) file as bytes."""
    out = bytearray(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _metadata_value(value)
    offset = 0
    offsets = []
    for tensor in tensors:
        offsets.append(offset)
        offset += -(-len(tensor.data) // alignment) * alignment
    for tensor, tensor_offset in zip(tensors, offsets, strict=True):
        dims = tuple(reversed(tensor.shape))  # GGML lists the innermost dimension first
        out += _string(tensor.name) + struct.pack("<I", len(dims))
        out += struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", tensor.ggml_type, tensor_offset)
    out += b"\0" * (-len(out) % alignment)
    for tensor in tensors:
        out += tensor.data + b"\0" * (-len(tensor.data) % alignment)
    return bytes(out)


def write_gguf(
    path: Path, metadata: Mapping[str, Any], tensors: Sequence[Tensor], *, alignment: int = 32
) -> Path:
    path.write_bytes(gguf_bytes(metadata, tensors, alignment=alignment))
    return path


# --- encoders: each returns (bytes, the values a decoder must produce) -------------------------


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """32 4-bit values per block -> 16 bytes: byte j holds value j (low) and j + 16 (high)."""
    q = q.astype(np.uint8)
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _blocks(w: np.ndarray) -> np.ndarray:
    if w.shape[-1] % 32:
        raise ValueError("the last dimension must be a multiple of 32")
    return w.astype(np.float32).reshape(-1, 32)


def encode_f32(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    w = w.astype(np.float32)
    return w.tobytes(), w


def encode_f16(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    h = w.astype(np.float16)
    return h.tobytes(), h.astype(np.float32)


def encode_bf16(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    bits = w.astype(np.float32).view(np.uint32) >> 16  # truncation is a valid encoding
    values = (bits << 16).view(np.float32).reshape(w.shape)
    return bits.astype(np.uint16).tobytes(), values


def encode_q4_0(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    blocks = _blocks(w)
    extreme = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    d = (extreme / -8).astype(np.float16)
    d32 = d.astype(np.float32)
    inv = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    q = np.clip(np.floor(blocks * inv[:, None] + 8.5), 0, 15).astype(np.uint8)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), _pack_nibbles(q)], axis=1)
    values = (q.astype(np.float32) - 8) * d32[:, None]
    return raw.tobytes(), values.reshape(w.shape)


def encode_q4_1(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    blocks = _blocks(w)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    inv = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    q = np.clip(np.round((blocks - m32[:, None]) * inv[:, None]), 0, 15).astype(np.uint8)
    header = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2)], 1)
    raw = np.concatenate([header, _pack_nibbles(q)], axis=1)
    values = q.astype(np.float32) * d32[:, None] + m32[:, None]
    return raw.tobytes(), values.reshape(w.shape)


def encode_q8_0(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    blocks = _blocks(w)
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    inv = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    q = np.clip(np.round(blocks * inv[:, None]), -127, 127).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    values = q.astype(np.float32) * d32[:, None]
    return raw.tobytes(), values.reshape(w.shape)


def encode_q6_k(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q6_K super-blocks of 256: 6-bit values split over `ql` (low 4 bits) and `qh` (high 2),
    16 int8 group scales (groups of 16) and an f16 super scale; value = d * scale[g] * (q - 32)."""
    if w.size % 256:
        raise ValueError("Q6_K needs a multiple of 256 values")
    groups = w.astype(np.float32).reshape(-1, 16, 16)
    n = groups.shape[0]
    group_scale = np.abs(groups).max(axis=2) / 31
    d = (group_scale.max(axis=1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    scales = np.round(np.divide(group_scale, d32, out=np.zeros_like(group_scale), where=d32 != 0))
    scales = scales.astype(np.int8)
    step = (d32 * scales)[:, :, None]
    q = np.round(np.divide(groups, step, out=np.zeros_like(groups), where=step != 0)) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(n, 256)
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for half in range(2):  # each half of 128 values uses 64 bytes of ql and 32 of qh
        base = 128 * half
        for l in range(32):  # noqa: E741  (the format's own index name)
            q1, q2, q3, q4 = (q[:, base + l + 32 * k] for k in range(4))
            ql[:, 64 * half + l] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            ql[:, 64 * half + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            qh[:, 32 * half + l] = (
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
            )
    raw = np.concatenate([ql, qh, scales.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    sub_scale = np.repeat(scales.astype(np.float32), 16, axis=1)
    values = d32 * sub_scale * (q.astype(np.float32) - 32)
    return raw.tobytes(), values.reshape(w.shape)


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: within each head, interleave the two rope halves."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode_q4_k(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q4_K super-blocks of 256: f16 `d` and `dmin`, 12 bytes packing eight 6-bit group scales
    and eight 6-bit group mins (groups of 32), 128 bytes of 4-bit quants;
    value = d * scale[g] * q - dmin * min[g]. The values are decoded from the bytes, as a reader
    of the format would."""
    if w.size % 256:
        raise ValueError("Q4_K needs a multiple of 256 values")
    groups = w.astype(np.float32).reshape(-1, 8, 32)
    n = groups.shape[0]
    lo = np.minimum(groups.min(axis=2), 0)
    group_scale, group_min = (groups.max(axis=2) - lo) / 15, -lo
    d = (group_scale.max(axis=1) / 63).astype(np.float16)
    dmin = (group_min.max(axis=1) / 63).astype(np.float16)
    d32, m32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.round(np.divide(group_scale, d32, out=np.zeros_like(group_scale), where=d32 != 0))
    mn = np.round(np.divide(group_min, m32, out=np.zeros_like(group_min), where=m32 != 0))
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    step, offset = (d32 * sc)[:, :, None], (m32 * mn)[:, :, None]
    q = np.round(np.divide(groups + offset, step, out=np.zeros_like(groups), where=step != 0))
    q = np.clip(q, 0, 15).astype(np.uint8)
    packed_scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    )
    # Four runs of 32 bytes: a run's low nibbles hold group 2k, its high nibbles group 2k + 1.
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    raw = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales, qs],
        axis=1,
    )
    return raw.tobytes(), _decode_q4_k(raw).reshape(w.shape)


def _decode_q4_k(raw: np.ndarray) -> np.ndarray:
    """The Q4_K format's decoding, from the bytes alone."""
    n = raw.shape[0]
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    p = raw[:, 4:16].astype(np.int64)
    values = np.zeros((n, 256), dtype=np.float32)
    for g in range(8):
        if g < 4:
            sc, mn = p[:, g] & 63, p[:, g + 4] & 63
        else:
            sc = (p[:, g + 4] & 0xF) | ((p[:, g - 4] >> 6) << 4)
            mn = (p[:, g + 4] >> 4) | ((p[:, g] >> 6) << 4)
        run = raw[:, 16 + 32 * (g // 2) : 16 + 32 * (g // 2) + 32].astype(np.float32)
        q = run % 16 if g % 2 == 0 else run // 16
        values[:, 32 * g : 32 * g + 32] = d * sc[:, None] * q - dmin * mn[:, None]
    return values


def encode_q5_0_placeholder(w: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Zero-filled Q5_0 blocks (22 bytes per 32 values): a type trio-mlx refuses, so only its
    size matters."""
    return bytes(w.size // 32 * 22), np.full(w.shape, np.nan, dtype=np.float32)


ENCODERS = {
    F32: encode_f32,
    F16: encode_f16,
    BF16: encode_bf16,
    Q4_0: encode_q4_0,
    Q4_1: encode_q4_1,
    Q8_0: encode_q8_0,
    Q6_K: encode_q6_k,
    Q4_K: encode_q4_k,
    Q5_0: encode_q5_0_placeholder,
}


# --- a whole tiny llama -------------------------------------------------------------------------


def _byte_level_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE uses for the 256 byte values (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = [*SPECIAL_TOKENS, *_byte_level_alphabet(), "Ġt", "he", "Ġthe"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_metadata() -> dict[str, Any]:
    """GGUF tokenizer metadata for a small byte-level BPE vocabulary with ChatML specials."""
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS) + [1] * (len(TOKENS) - 3),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


@dataclass
class TinyLlama:
    """A GGUF file and what a correct converter must make of it: the mlx-lm config and the
    weights (float32, Hugging Face names and row order) that its tensors decode to."""

    path: Path
    config: dict[str, Any]
    weights: dict[str, np.ndarray]


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


def write_tiny_llama(
    path: Path,
    *,
    matrix_type: int = F32,
    types: Mapping[str, int] | None = None,
    hidden: int = 64,
    ffn: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool = True,
    permute: bool = True,
    rope_scaling: Mapping[str, Any] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
    extra_tensors: Sequence[Tensor] = (),
    omit: Sequence[str] = (),
    alignment: int = 32,
    seed: int = 0,
) -> TinyLlama:
    """Write a random llama as llama.cpp's converter would (q/k rows permuted unless `permute` is
    False). Every matrix is `matrix_type` unless `types` names its GGUF tensor (without
    `.weight`, e.g. "blk.0.attn_v" or "token_embd"); norms are F32. `extra_tensors` are appended
    and tensors named in `omit` left out, to make files a converter must refuse."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    vocab = len(TOKENS)
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "token_embd": ((vocab, hidden), "model.embed_tokens"),
        "output_norm": ((hidden,), "model.norm"),
    }
    if not tied:
        shapes["output"] = ((vocab, hidden), "lm_head")
    layer_shapes = {
        "attn_norm": (hidden,),
        "attn_q": (heads * head_dim, hidden),
        "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden),
        "attn_output": (hidden, heads * head_dim),
        "ffn_norm": (hidden,),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    for i in range(layers):
        for kind, shape in layer_shapes.items():
            shapes[f"blk.{i}.{kind}"] = (shape, f"model.layers.{i}.{_LAYER_TENSORS[kind]}")

    tensors: list[Tensor] = []
    weights: dict[str, np.ndarray] = {}
    for name, (shape, hf_name) in shapes.items():
        if len(shape) == 1:
            data, values = encode_f32(1.0 + 0.1 * rng.standard_normal(shape))
            ggml_type = F32
        else:
            ggml_type = (types or {}).get(name, matrix_type)
            data, values = ENCODERS[ggml_type](0.2 * rng.standard_normal(shape))
            kind = name.rsplit(".", 1)[-1]
            if permute and kind in ("attn_q", "attn_k"):
                # The GGUF holds permuted rows; the reference keeps the original order.
                data = _permute_encoded_rows(
                    data, shape[0], heads if kind == "attn_q" else kv_heads
                )
        tensors.append(Tensor(f"{name}.weight", ggml_type, shape, data))
        weights[f"{hf_name}.weight"] = values

    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }
    metadata: dict[str, Any] = {
        "general.architecture": "llama",
        "general.name": "tiny llama",
        "llama.block_count": layers,
        "llama.context_length": 512,
        "llama.embedding_length": hidden,
        "llama.feed_forward_length": ffn,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": head_dim,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": vocab,
        **tokenizer_metadata(),
        **(extra_metadata or {}),
    }
    if alignment != 32:
        metadata["general.alignment"] = alignment
    tensors = [t for t in tensors if t.name not in omit] + list(extra_tensors)
    write_gguf(path, metadata, tensors, alignment=alignment)
    return TinyLlama(path, config, weights)


def _permute_encoded_rows(data: bytes, rows: int, heads: int) -> bytes:
    """Reorder an encoded matrix's rows as llama.cpp does for q/k. Every encoding here is
    row-local (a block never spans two rows), so whole rows of bytes move."""
    as_rows = np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)
    return permute_like_llama_cpp(as_rows, heads).tobytes()
