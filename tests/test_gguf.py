"""GGUF -> mlx-lm conversion: tensor types, q/k row order, config, tokenizer, corrupt input.

Synthetic GGUF files come from `gguf_writer` (written in-test, a few hundred KB each); a converted
model must give the same logits as an mlx-lm llama built directly from the weights the file's bytes
decode to. The bundled SmolLM2 file is converted once per module for its shapes, config and
tokenizer; its end-to-end answer is the one `slow` test. No network; the cache is a tmp dir.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.utils import load_model

import gguf_writer as gw
from trio_mlx.engine.default_model import default_gguf_path
from trio_mlx.engine.gguf import convert_gguf, llama3_rope_factors
from trio_mlx.engine.gguf_reader import read_gguf_header
from trio_mlx.errors import ModelLoadError

TOKENS = mx.array([[1, 50, 70, 100, 3, 200, 42, 7, 150, 9, 260, 33]])
TYPES = {
    "F32": gw.F32,
    "F16": gw.F16,
    "BF16": gw.BF16,
    "Q4_0": gw.Q4_0,
    "Q4_1": gw.Q4_1,
    "Q8_0": gw.Q8_0,
    "Q4_K": gw.Q4_K,
    "Q6_K": gw.Q6_K,
}
#: Super-block types need rows of 256 values.
K_QUANT_SIZES: dict[str, Any] = {"hidden": 256, "ffn": 256}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def reference_logits(tiny: gw.TinyLlama, tokens: mx.array = TOKENS) -> mx.array:
    model = llama.Model(llama.ModelArgs.from_dict(tiny.config))
    model.load_weights([(k, mx.array(v)) for k, v in tiny.weights.items()])
    return model(tokens)


def converted_logits(out_dir: Path, tokens: mx.array = TOKENS) -> mx.array:
    model, _config = load_model(out_dir)
    return model(tokens).astype(mx.float32)


def assert_same_logits(got: mx.array, want: mx.array, *, exact: bool) -> None:
    """Dense weights match to float rounding; MLX's quantized layers compute in float16 (the
    embedding lookup, the dequantized values), which leaves ~1e-3 relative differences."""
    scale = float(mx.abs(want).max())
    tolerance = 1e-5 * scale if exact else 1e-2 * scale
    assert float(mx.abs(got - want).max()) <= tolerance


# --- every tensor type, and the q/k row order ---------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
def test_each_tensor_type_converts_to_the_model_its_bytes_encode(
    tmp_path: Path, type_name: str
) -> None:
    sizes = K_QUANT_SIZES if type_name.endswith("_K") else {}
    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf", matrix_type=TYPES[type_name], **sizes)
    out = convert_gguf(tiny.path, tmp_path / "out")
    exact = type_name in ("F32", "F16", "BF16", "Q4_K")
    assert_same_logits(converted_logits(out), reference_logits(tiny), exact=exact)


def test_unpermuted_q_k_rows_would_not_match_the_reference(tmp_path: Path) -> None:
    """The comparison above has teeth: a file whose q/k rows are *not* in llama.cpp's order
    converts to a different model, because the converter reorders them."""
    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf", matrix_type=gw.Q4_1, permute=False)
    got = converted_logits(convert_gguf(tiny.path, tmp_path / "out"))
    want = reference_logits(tiny)
    assert float(mx.abs(got - want).max()) > 0.2 * float(mx.abs(want).max())


@pytest.mark.parametrize(
    ("type_name", "bits"), [("Q4_0", 4), ("Q4_1", 4), ("Q8_0", 8), ("Q4_K", 4)]
)
def test_quantized_types_stay_quantized(tmp_path: Path, type_name: str, bits: int) -> None:
    sizes = K_QUANT_SIZES if type_name.endswith("_K") else {}
    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf", matrix_type=TYPES[type_name], **sizes)
    model, config = load_model(convert_gguf(tiny.path, tmp_path / "out"))
    layer = model.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.mlp.down_proj):
        assert isinstance(module, nn.QuantizedLinear)
        assert (module.bits, module.group_size) == (bits, 32)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert config["quantization"] == {"group_size": 32, "bits": bits}


@pytest.mark.parametrize(
    ("type_name", "dtype"), [("F32", mx.float32), ("F16", mx.float16), ("BF16", mx.bfloat16)]
)
def test_dense_types_keep_their_dtype(tmp_path: Path, type_name: str, dtype: mx.Dtype) -> None:
    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf", matrix_type=TYPES[type_name])
    model, config = load_model(convert_gguf(tiny.path, tmp_path / "out"))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == dtype
    assert "quantization" not in config


def test_mixed_types_get_a_per_module_quantization_config(tmp_path: Path) -> None:
    types = {
        "token_embd": gw.Q8_0,
        "output": gw.Q4_K,
        "blk.0.attn_v": gw.Q6_K,
        "blk.0.ffn_down": gw.F16,
        "blk.1.attn_q": gw.Q4_0,
        "blk.1.ffn_up": gw.BF16,
    }
    tiny = gw.write_tiny_llama(
        tmp_path / "tiny.gguf", matrix_type=gw.Q4_1, types=types, tied=False, **K_QUANT_SIZES
    )
    out = convert_gguf(tiny.path, tmp_path / "out")
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert quantization == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
        "model.layers.0.mlp.down_proj": False,
        "model.layers.0.self_attn.v_proj": False,
        "model.layers.1.mlp.up_proj": False,
    }
    model, _ = load_model(out)
    assert isinstance(model.lm_head, nn.QuantizedLinear)
    assert isinstance(model.model.layers[0].self_attn.v_proj, nn.Linear)
    assert_same_logits(converted_logits(out), reference_logits(tiny), exact=False)


# --- config -------------------------------------------------------------------------------------


def test_config_carries_the_llama_hyperparameters(tmp_path: Path) -> None:
    tiny = gw.write_tiny_llama(
        tmp_path / "tiny.gguf",
        heads=8,
        kv_heads=2,
        layers=3,
        extra_metadata={
            "llama.rope.freq_base": 500000.0,
            "llama.attention.layer_norm_rms_epsilon": 1e-6,
            "llama.context_length": 4096,
            "tokenizer.ggml.eot_token_id": 0,
        },
    )
    config = json.loads((convert_gguf(tiny.path, tmp_path / "out") / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 64
    assert config["intermediate_size"] == 128
    assert config["num_hidden_layers"] == 3
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 2)
    assert config["head_dim"] == 8
    assert config["rope_theta"] == 500000.0
    assert config["rms_norm_eps"] == 1e-6
    assert config["max_position_embeddings"] == 4096
    assert config["vocab_size"] == len(gw.TOKENS)
    assert config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == 1
    assert config["eos_token_id"] == [2, 0]  # eos, then end-of-turn


def test_an_output_tensor_means_untied_embeddings(tmp_path: Path) -> None:
    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf", tied=False)
    out = convert_gguf(tiny.path, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert_same_logits(converted_logits(out), reference_logits(tiny), exact=True)


def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    factors = llama3_rope_factors(scaling, 16, 10000.0)
    tiny = gw.write_tiny_llama(
        tmp_path / "tiny.gguf",
        rope_scaling=scaling,
        extra_metadata={"llama.rope.scaling.original_context_length": 64},
        extra_tensors=[gw.Tensor("rope_freqs.weight", gw.F32, (8,), factors.tobytes())],
    )
    out = convert_gguf(tiny.path, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == scaling
    assert_same_logits(converted_logits(out), reference_logits(tiny), exact=True)


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path: Path) -> None:
    odd = np.linspace(1, 3, 8, dtype=np.float32)
    tiny = gw.write_tiny_llama(
        tmp_path / "tiny.gguf",
        extra_tensors=[gw.Tensor("rope_freqs.weight", gw.F32, (8,), odd.tobytes())],
    )
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        convert_gguf(tiny.path, tmp_path / "out")


def test_linear_rope_scaling_comes_from_the_metadata(tmp_path: Path) -> None:
    tiny = gw.write_tiny_llama(
        tmp_path / "tiny.gguf",
        rope_scaling={"type": "linear", "factor": 4.0},
        extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    )
    out = convert_gguf(tiny.path, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {
        "type": "linear",
        "factor": 4.0,
    }
    assert_same_logits(converted_logits(out), reference_logits(tiny), exact=True)


# --- tokenizer ----------------------------------------------------------------------------------


def test_the_converted_directory_loads_with_its_tokenizer_and_chat_template(
    tmp_path: Path,
) -> None:
    import mlx_lm

    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf")
    _model, tokenizer = mlx_lm.load(str(convert_gguf(tiny.path, tmp_path / "out")))
    ids = tokenizer.encode("the theme")
    assert [gw.TOKENS[i] for i in ids] == ["t", "he", "Ġthe", "m", "e"]
    assert tokenizer.decode(ids) == "the theme"
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- the header reader --------------------------------------------------------------------------


def test_the_reader_returns_every_metadata_value_type_as_plain_python(tmp_path: Path) -> None:
    metadata = {
        "u8": gw.Typed(gw.UINT8, 200),
        "i8": gw.Typed(gw.INT8, -5),
        "u16": gw.Typed(gw.UINT16, 60000),
        "i16": gw.Typed(gw.INT16, -300),
        "u32": gw.Typed(gw.UINT32, 4_000_000_000),
        "i32": gw.Typed(gw.INT32, -7),
        "u64": gw.Typed(gw.UINT64, 2**40),
        "i64": gw.Typed(gw.INT64, -(2**40)),
        "f32": gw.Typed(gw.FLOAT32, 1e-5),
        "f64": gw.Typed(gw.FLOAT64, 0.1),
        "flag": gw.Typed(gw.BOOL, True),
        "text": "héllo",
        "words": ["a", "", "ü"],
        "floats": gw.Typed(gw.FLOAT32, [0.5, 2.0], array=True),
        "longs": gw.Typed(gw.UINT64, [1, 2**40], array=True),
    }
    path = gw.write_gguf(tmp_path / "meta.gguf", metadata, [])
    assert read_gguf_header(path).metadata == {
        "u8": 200,
        "i8": -5,
        "u16": 60000,
        "i16": -300,
        "u32": 4_000_000_000,
        "i32": -7,
        "u64": 2**40,
        "i64": -(2**40),
        "f32": 1e-5,
        "f64": 0.1,
        "flag": True,
        "text": "héllo",
        "words": ["a", "", "ü"],
        "floats": [0.5, 2.0],
        "longs": [1, 2**40],
    }


def test_the_reader_gives_shapes_outermost_first_and_absolute_offsets(tmp_path: Path) -> None:
    tensors = [
        gw.Tensor("a", gw.F32, (3, 5), bytes(60)),
        gw.Tensor("b", gw.Q8_0, (2, 64), bytes(2 * 2 * 34)),
    ]
    header = read_gguf_header(gw.write_gguf(tmp_path / "t.gguf", {}, tensors))
    a, b = header.tensors["a"], header.tensors["b"]
    assert (a.shape, a.ggml_type.name, a.nbytes) == ((3, 5), "F32", 60)
    assert (b.shape, b.ggml_type.name, b.nbytes) == ((2, 64), "Q8_0", 136)
    assert a.offset == header.data_offset
    assert b.offset == header.data_offset + 64  # 60 bytes, padded to the alignment of 32


# --- refusals and corrupt files -----------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> bytes:
    return gw.write_tiny_llama(tmp_path / "good.gguf", matrix_type=gw.Q4_1).path.read_bytes()


def assert_refused(gguf: Path, out: Path, *reason: str) -> None:
    with pytest.raises(ModelLoadError) as caught:
        convert_gguf(gguf, out)
    message = str(caught.value)
    assert str(gguf) in message
    for part in reason:
        assert part in message
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    assert_refused(tmp_path / "nope.gguf", tmp_path / "out", "no such file")


def test_random_bytes_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_refused(path, tmp_path / "out", "not a GGUF file")


def test_a_wrong_magic_is_refused(tmp_path: Path, tiny_gguf: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + tiny_gguf[4:])
    assert_refused(path, tmp_path / "out", "not a GGUF file")


def test_an_unknown_version_is_refused(tmp_path: Path, tiny_gguf: bytes) -> None:
    path = tmp_path / "v9.gguf"
    path.write_bytes(tiny_gguf[:4] + struct.pack("<I", 9) + tiny_gguf[8:])
    assert_refused(path, tmp_path / "out", "version 9")


def test_truncated_files_are_refused_at_every_kind_of_cut(tmp_path: Path, tiny_gguf: bytes) -> None:
    header = read_gguf_header(tmp_path / "good.gguf")
    first_tensor = min(t.offset for t in header.tensors.values())
    cuts = {
        "empty": 0,
        "inside the magic": 3,
        "inside the counts": 20,
        "inside the metadata": 200,
        "inside the vocabulary": 2000,
        "at the tensor data": header.data_offset,
        "inside the first tensor": first_tensor + 10,
        "halfway": len(tiny_gguf) // 2,
        "one byte short": len(tiny_gguf) - 1,
    }
    for what, cut in cuts.items():
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(tiny_gguf[:cut])
        with pytest.raises(ModelLoadError) as caught:
            convert_gguf(path, tmp_path / f"out-{cut}")
        assert str(path) in str(caught.value), what
        assert not (tmp_path / f"out-{cut}").exists(), what


def test_corrupted_bytes_never_crash_the_process(tmp_path: Path, tiny_gguf: bytes) -> None:
    """Flip random bytes in the header: every result is a conversion or a ModelLoadError."""
    header_end = read_gguf_header(tmp_path / "good.gguf").data_offset
    rng = np.random.default_rng(7)
    for trial in range(60):
        data = bytearray(tiny_gguf)
        for position in rng.integers(0, header_end, size=3):
            data[position] = int(rng.integers(0, 256))
        path = tmp_path / f"fuzz-{trial}.gguf"
        path.write_bytes(bytes(data))
        try:
            convert_gguf(path, tmp_path / f"out-{trial}")
        except ModelLoadError as exc:
            assert str(path) in str(exc)


def test_an_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    tiny = gw.write_tiny_llama(
        tmp_path / "qwen.gguf", extra_metadata={"general.architecture": "qwen2"}
    )
    assert_refused(tiny.path, tmp_path / "out", "unsupported architecture 'qwen2'")


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    tiny = gw.write_tiny_llama(tmp_path / "q5.gguf", types={"blk.1.ffn_up": gw.Q5_0})
    assert_refused(tiny.path, tmp_path / "out", "blk.1.ffn_up.weight (Q5_0)", "supported:")


def test_a_non_default_alignment_is_honoured(tmp_path: Path) -> None:
    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf", matrix_type=gw.Q8_0, alignment=256)
    out = convert_gguf(tiny.path, tmp_path / "out")
    assert_same_logits(converted_logits(out), reference_logits(tiny), exact=False)


def test_an_unknown_tensor_is_refused(tmp_path: Path) -> None:
    extra = gw.Tensor("blk.0.ffn_gate_exps.weight", gw.F32, (4, 64), bytes(4 * 64 * 4))
    tiny = gw.write_tiny_llama(tmp_path / "moe.gguf", extra_tensors=[extra])
    assert_refused(tiny.path, tmp_path / "out", "blk.0.ffn_gate_exps.weight")


def test_a_missing_tensor_is_refused(tmp_path: Path) -> None:
    tiny = gw.write_tiny_llama(tmp_path / "holey.gguf", omit=["blk.1.ffn_down.weight"])
    assert_refused(tiny.path, tmp_path / "out", "missing tensor", "blk.1.ffn_down.weight")


def test_an_existing_output_directory_is_not_overwritten(tmp_path: Path) -> None:
    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="already exists"):
        convert_gguf(tiny.path, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_an_interrupted_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio_mlx.engine.gguf as gguf_module

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    tiny = gw.write_tiny_llama(tmp_path / "tiny.gguf")
    monkeypatch.setattr(gguf_module, "write_tokenizer_files", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny.path, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]


# --- the bundled SmolLM2 file -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    started = time.monotonic()
    out = convert_gguf(default_gguf_path(), tmp_path_factory.mktemp("smollm2") / "model")
    print(f"converted the bundled SmolLM2 in {time.monotonic() - started:.2f} s")
    yield out


def test_bundled_model_config(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert {k: config[k] for k in config if "quantization" not in k} == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    # Its token embedding is Q8_0, everything else Q4_1.
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
    }


def test_bundled_model_tensor_shapes(smollm2_dir: Path) -> None:
    weights = mx.load(str(smollm2_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    assert shapes["model.embed_tokens.weight"] == (49152, 576 * 8 // 32)
    assert shapes["model.embed_tokens.scales"] == (49152, 576 // 32)
    layer = "model.layers.29."
    assert shapes[layer + "self_attn.q_proj.weight"] == (576, 576 * 4 // 32)
    assert shapes[layer + "self_attn.k_proj.weight"] == (192, 576 * 4 // 32)
    assert shapes[layer + "self_attn.k_proj.biases"] == (192, 576 // 32)
    assert shapes[layer + "mlp.down_proj.weight"] == (576, 1536 * 4 // 32)
    assert shapes[layer + "mlp.gate_proj.scales"] == (1536, 576 // 32)
    assert shapes[layer + "input_layernorm.weight"] == (576,)
    assert shapes["model.norm.weight"] == (576,)
    assert "lm_head.weight" not in shapes
    assert len([k for k in shapes if k.startswith("model.layers.")]) == 30 * (7 * 3 + 2)


def test_bundled_tokenizer_round_trips_and_has_the_chat_template(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for text in ("Hello, world!", "  two spaces, 12345 digits", "Ünïcödé ✓ 🙂\n\tend"):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("12") == [tokenizer.convert_tokens_to_ids(c) for c in "12"]
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_bundled_model_answers_paris_greedily(smollm2_dir: Path) -> None:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(smollm2_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "Paris" in mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
