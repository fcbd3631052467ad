"""Quantized layers routed by rows (`engine/quantized_rows.py`, `dequantize_from_rows`): an input
of at least the threshold's rows is multiplied by the dequantized weight, fewer rows by the
quantized kernel, on a tiny random llama quantized to 4 bits and run on the CPU in float32, with
the routing forced on (it is off by default on the CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
import trio
from mlx.utils import tree_flatten
from mlx_lm.models import llama

import trio_mlx
from runner_intake import IntakeHold, hold_the_runner_intake
from servers import eventually
from trio_mlx.cli import build_parser
from trio_mlx.config import EngineConfig
from trio_mlx.engine import quantized_rows
from trio_mlx.engine.compiled_step import CompiledDecode
from trio_mlx.engine.fast_decode import prepare_fast_decode
from trio_mlx.engine.loading import load_model
from trio_mlx.engine.quantized_rows import (
    RowRoutedEmbedding,
    RowRoutedLinear,
    resolve_threshold,
    route_rows,
    unroute_rows,
)
from trio_mlx.http.server import settings_from_args

GROUP_SIZE, BITS = 32, 4
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog because",
    "Once upon a time",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]


class Products:
    """Records the input shape of every routed product, by branch (on any thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dense: list[tuple[int, ...]] = []
        self.quantized: list[tuple[int, ...]] = []
        for kind in (RowRoutedLinear, RowRoutedEmbedding):
            for branch in ("dense", "quantized"):
                monkeypatch.setattr(kind, branch, self._recording(getattr(kind, branch), branch))

    def _recording(self, original: Any, branch: str) -> Any:
        def recorded(layer: Any, x: Any) -> Any:
            getattr(self, branch).append(tuple(x.shape))
            return original(layer, x)

        return recorded

    def clear(self) -> None:
        self.dense.clear()
        self.quantized.clear()


def quantized_tiny(model_dir: Path) -> Any:
    model = load_model(model_dir).model
    nn.quantize(model, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def quantized_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a 4-bit mlx-lm directory (its embedding and tied head quantized too)."""
    from mlx_lm.utils import load_model as load_mlx_lm

    out = tmp_path_factory.mktemp("models") / "tiny-llama-q4"
    shutil.copytree(tiny_model_dir, out)
    model, config = load_mlx_lm(tiny_model_dir)
    nn.quantize(model, group_size=GROUP_SIZE, bits=BITS)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": GROUP_SIZE, "bits": BITS}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(autouse=True)
def quantized_weights_stay_quantized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path must not turn the 4-bit weights into float32 (`cpu_path`)."""
    monkeypatch.setenv("TRIO_MLX_CPU_WEIGHTS", "as-stored")


def test_many_rows_take_the_dequantized_product_within_rounding(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = quantized_tiny(tiny_model_dir)
    layer = model.layers[0].mlp.down_proj
    head = model.model.embed_tokens
    x = mx.random.normal((3, 1, 128), key=mx.random.key(1))  # a decode batch of 3
    h = mx.random.normal((1, 5, 64), key=mx.random.key(2))  # a prefill chunk of 5
    ids = mx.array([[5, 9, 300]])
    expected, expected_head, looked_up = layer(x), head.as_linear(h), head(ids)
    assert route_rows(model, 2) == 2 * 7 + 1  # 7 projections a layer, and the embedding
    products = Products(monkeypatch)
    out, out_head = layer(x), head.as_linear(h)
    assert products.dense == [(3, 1, 128), (1, 5, 64)] and products.quantized == []
    assert mx.allclose(out, expected, rtol=1e-5, atol=1e-5).item()
    assert mx.allclose(out_head, expected_head, rtol=1e-5, atol=1e-4).item()
    weight = mx.dequantize(
        layer.weight, layer.scales, layer.biases, group_size=GROUP_SIZE, bits=BITS
    )
    assert mx.array_equal(out, x @ weight.T).item()  # exactly the dense product
    assert mx.array_equal(head(ids), looked_up).item()  # the lookup is not routed
    assert len(products.dense) == 2


def test_fewer_rows_take_the_quantized_kernel_bit_for_bit(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = quantized_tiny(tiny_model_dir)
    layer, head = model.layers[1].self_attn.q_proj, model.model.embed_tokens
    one_row = mx.random.normal((1, 1, 64), key=mx.random.key(3))
    three_rows = mx.random.normal((3, 64), key=mx.random.key(4))
    batch_step = mx.random.normal((3, 1, 64), key=mx.random.key(5))  # folded to (3, 64)
    inputs = [one_row, three_rows, batch_step]
    expected = [layer(x) for x in inputs] + [head.as_linear(one_row), head.as_linear(batch_step)]
    route_rows(model, 4)
    products = Products(monkeypatch)
    got = [layer(x) for x in inputs] + [head.as_linear(one_row), head.as_linear(batch_step)]
    assert products.dense == [] and len(products.quantized) == 5
    assert [g.shape for g in got] == [e.shape for e in expected]
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, expected, strict=True))
    layer(mx.zeros((2, 2, 64)))  # 4 rows: the threshold itself is dense
    assert products.dense == [(2, 2, 64)]


def test_routing_changes_the_class_only_and_can_be_undone(tiny_model_dir: Path) -> None:
    model = quantized_tiny(tiny_model_dir)
    arrays = {k: v for k, v in tree_flatten(model.parameters())}
    tokens = mx.array([list(range(5, 25))])
    before = model(tokens)
    assert route_rows(model, 2) == 15
    assert isinstance(model.layers[0].mlp.up_proj, nn.QuantizedLinear)  # still one
    assert route_rows(model, 3) == 15  # routed again: the new threshold
    assert model.layers[0].mlp.up_proj.dequantize_from_rows == 3
    after = {k: v for k, v in tree_flatten(model.parameters())}
    assert after.keys() == arrays.keys() and all(after[k] is arrays[k] for k in arrays)
    assert mx.allclose(model(tokens), before, rtol=1e-5, atol=1e-4).item()
    assert unroute_rows(model) == 15
    assert type(model.layers[0].mlp.up_proj) is nn.QuantizedLinear
    assert mx.array_equal(model(tokens), before).item()
    with pytest.raises(ValueError):
        route_rows(model, 0)


def test_dense_weights_are_temporaries_of_about_one_layer() -> None:
    """Dequantized weights live while their product is computed, about a layer's worth at a
    time (not the model's), and none is kept after the pass."""
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 8,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    assert route_rows(model, 2) == 8 * 7 + 1
    dense_bytes = [
        4 * m.weight.shape[0] * m.weight.shape[1] * 32 // 4
        for m in model.modules()
        if isinstance(m, RowRoutedLinear | RowRoutedEmbedding)
    ]
    layer_bytes = 4 * 256 * (4 * 256 + 3 * 1024)  # one layer's seven projections in float32
    tokens = mx.array([list(range(16))])
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = model(tokens)
    mx.eval(out)
    peak = mx.get_peak_memory() - base
    assert peak < 2 * layer_bytes < sum(dense_bytes) / 3
    assert mx.get_active_memory() - base == out.nbytes  # the logits, nothing else kept


def test_the_fused_projections_are_routed_too(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused first, then routed (`prepare_fast_decode`'s order): the fused q/k/v and gate/up
    layers take the dense product, and the logits stay the plain model's within rounding."""
    model = quantized_tiny(tiny_model_dir)
    tokens = mx.array([list(range(5, 25))])
    expected = model(tokens)
    assert prepare_fast_decode(model, False, True, dequantize_from_rows=2) is None
    attention = model.layers[0].self_attn
    assert isinstance(attention.qkv_proj, RowRoutedLinear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, RowRoutedLinear)
    products = Products(monkeypatch)
    assert mx.allclose(model(tokens), expected, rtol=1e-5, atol=1e-4).item()
    # per layer: qkv, o, gate_up, down; the head is lazy work of the same pass
    assert len(products.dense) == 2 * 4 + 1 and products.quantized == []


def test_a_traced_batch_step_keeps_the_branch_of_its_rows(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mx.compile` traces once per input shape: a batch of 3 traces the dense product, a batch
    of 1 the quantized one, and both give the plain model's logits."""
    from mlx_lm.models.cache import BatchKVCache

    model = quantized_tiny(tiny_model_dir)
    route_rows(model, 2)
    decoder = CompiledDecode(model, first_bucket=16)
    products = Products(monkeypatch)
    for rows in (3, 1):
        prompt = mx.array([list(range(7, 17))] * rows)
        caches = [BatchKVCache([0] * rows) for _ in model.layers]
        plain = [BatchKVCache([0] * rows) for _ in model.layers]
        model(prompt, cache=caches)
        model(prompt, cache=plain)
        token = mx.array([3] * rows)
        products.clear()
        traced = decoder.batch_logits(token, caches)
        branch = products.dense if rows >= 2 else products.quantized
        assert len(branch) == 2 * 7 + 1  # traced: each layer's products, the head
        step = model(token[:, None], cache=plain)[:, -1, :]
        assert mx.allclose(traced, step, rtol=1e-5, atol=1e-4).item()


async def batch_of_four(model_dir: Path, hold: IntakeHold, rows: int) -> list[list[int]]:
    """`PROMPTS` admitted at one step boundary and decoded together (greedy, 12 tokens each) by
    an engine with `dequantize_from_rows=rows`."""
    results: list[list[int]] = [[] for _ in PROMPTS]
    async with trio_mlx.open_engine(
        model_dir, max_num_seqs=4, prefill_chunk_seconds=60.0, dequantize_from_rows=rows
    ) as engine:

        async def one(i: int) -> None:
            out = await engine.generate(PROMPTS[i], max_tokens=12, temperature=0.0)
            results[i] = list(out.tokens)

        hold.close()  # the runner takes all four at one step boundary
        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
            await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == 4)
            hold.open()
        stats = engine.get_stats()["runner"]
    assert stats["batching"] is True
    assert max(int(size) for size in stats["batch_sizes"]) == 4
    assert all(len(tokens) == 12 for tokens in results)
    return results


async def test_a_batch_of_requests_gives_the_same_tokens_routed_or_not(
    quantized_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched route with the routing forced on at 2 rows: the decode batch and the prefill
    chunks take the dense product, single rows the quantized one, and the greedy tokens are
    those of the same batch with it off."""
    products = Products(monkeypatch)
    hold = hold_the_runner_intake(monkeypatch)
    routed = await batch_of_four(quantized_dir, hold, 2)
    decode_batches = {shape[0] for shape in products.dense if shape[1] == 1}
    chunks = [shape for shape in products.dense if shape[0] == 1 and shape[1] > 1]
    assert max(decode_batches) == 4 and chunks
    assert all(shape[0] * shape[1] == 1 for shape in products.quantized)
    products.clear()
    assert await batch_of_four(quantized_dir, hold, 0) == routed
    assert products.dense == [] and products.quantized == []  # off: nothing routed


async def test_the_cpu_default_leaves_the_layers_alone(quantized_dir: Path) -> None:
    models = []

    def loader(spec: Any) -> Any:
        loaded = load_model(spec)
        models.append(loaded.model)
        return loaded

    async with trio_mlx.open_engine(quantized_dir, max_num_seqs=2, loader=loader) as engine:
        out = await engine.generate("Hello", max_tokens=3, temperature=0.0)
    assert len(out.tokens) == 3
    assert type(models[0].layers[0].mlp.down_proj) is nn.QuantizedLinear


def test_the_threshold_by_backend() -> None:
    assert quantized_rows.default_threshold() is None  # the CPU backend
    assert resolve_threshold(None) is None
    assert resolve_threshold(0) is None
    assert resolve_threshold(16) == 16


def test_the_cuda_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert quantized_rows.default_threshold() == quantized_rows.CUDA_DEQUANTIZE_FROM_ROWS == 128
    assert resolve_threshold(None) == 128 and resolve_threshold(0) is None


def test_the_option_reaches_the_engine_config() -> None:
    def option(*argv: str) -> Any:
        args = build_parser().parse_args(["serve", *argv])
        return settings_from_args(args).engine_options["dequantize_from_rows"]

    assert option() is None and EngineConfig().dequantize_from_rows is None
    for given, value in (("16", 16), ("0", 0)):
        assert option("--dequantize-from-rows", given) == value
        assert EngineConfig(dequantize_from_rows=value).dequantize_from_rows == value
    for wrong in (-1, True, 2.5):
        with pytest.raises(ValueError, match="dequantize_from_rows"):
            EngineConfig(dequantize_from_rows=wrong)  # type: ignore[arg-type]
