"""The lean one-token step (`engine/lean_step.py`, `lean_decode`) is the model's own arithmetic in
fewer graph nodes: on the CPU in float32 its logits equal the model's bit for bit, for llama,
qwen2 (biased projections) and qwen3 (q/k norms), fused or not, quantized or not, across the KV
cache's growth; through the engine, on both routes, it gives the plain path's tokens with the
prefix cache, an abort, seeded sampling and logprobs, and it really runs."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

import trio_mlx
from model_wrappers import wrapping_loader
from test_compiled_decode import PROMPT, Delegating, _batched_script, _script, generate
from tiny_model import build_in_memory
from trio_mlx.cli import build_parser
from trio_mlx.engine.fast_decode import prepare_fast_decode, prepare_lean_step
from trio_mlx.engine.fused import fuse_projections
from trio_mlx.engine.lean_step import LeanStep
from trio_mlx.engine.loading import load_model
from trio_mlx.http.server import settings_from_args
from trio_mlx.types import SamplingParams


@pytest.mark.parametrize(
    ("kind", "tied", "variant"),
    [
        ("llama", True, "plain"),
        ("llama", True, "fused"),
        ("llama", False, "quantized"),
        ("qwen2", True, "fused"),
        ("qwen2", False, "plain"),
        ("qwen3", True, "quantized+fused"),
        ("qwen3", False, "fused"),
    ],
)
def test_the_logits_are_the_models_own(kind: str, tied: bool, variant: str) -> None:
    """300 steps after a 20-token prompt: past the 256 positions where `KVCache` grows."""
    model = build_in_memory(kind, tied=tied)
    if "quantized" in variant:
        nn.quantize(model, group_size=32, bits=4)
    if "fused" in variant:
        assert fuse_projections(model) == 4
    lean = LeanStep(model)
    own, ours = make_prompt_cache(model), make_prompt_cache(model)
    prompt = mx.array([list(range(5, 25))])
    model(prompt, cache=own)
    model(prompt, cache=ours)
    token = mx.array([7])
    for _ in range(300):
        expected = model(token[None], cache=own)[:, -1, :]
        got = lean.logits(token, ours)
        assert got.shape == expected.shape == (1, 4096)
        assert mx.array_equal(got, expected).item()
        token = mx.argmax(expected, axis=-1)
    assert ours[0].offset == own[0].offset == 320
    following = mx.argmax(model(token[None], cache=own)[:, -1, :], axis=-1)
    assert mx.array_equal(lean.step(token, ours, greedy=True), following).item()


def _merged(model: Any, prompts: list[list[int]]) -> list[Any]:
    """A batch cache (mlx-lm's `BatchKVCache`, left-padded) holding each prompt's prefill."""
    caches = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    return [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]


@pytest.mark.parametrize(
    ("kind", "variant"),
    [("llama", "fused"), ("qwen2", "plain"), ("qwen3", "quantized+fused")],
)
def test_a_batch_has_the_models_logits(kind: str, variant: str) -> None:
    """`batch_logits`: three rows of different lengths (left padding, a mask) over mlx-lm's
    batch cache, 240 steps, past its growth at 256 positions: the model's own batched logits
    bit for bit on the CPU in float32."""
    model = build_in_memory(kind)
    if "quantized" in variant:
        nn.quantize(model, group_size=32, bits=4)
    if "fused" in variant:
        assert fuse_projections(model) == 4
    lean = LeanStep(model)
    prompts = [list(range(5, 5 + n)) for n in (4, 11, 30)]
    own, ours = _merged(model, prompts), _merged(model, prompts)
    tokens = mx.array([7, 8, 9])
    for _ in range(240):
        expected = model(tokens[:, None], cache=own)[:, -1, :]
        got = lean.batch_logits(tokens, ours)
        assert got.shape == expected.shape == (3, 4096)
        assert mx.array_equal(got, expected).item()
        tokens = mx.argmax(expected, axis=-1)
    assert ours[0].keys.shape[2] > 256  # it grew


def _nodes(output: Any) -> dict[str, int]:
    """The graph's nodes behind `output`, by primitive."""
    dot = io.StringIO()
    mx.export_to_dot(dot, output)
    counts: dict[str, int] = {}
    for name in re.findall(r'label ="([A-Za-z]+)', dot.getvalue()):
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_the_step_has_fewer_nodes_than_the_models(tiny_model_dir: Path) -> None:
    """The reason it exists: on the fused model, fewer graph nodes a step, the ones it removes
    being the layout bookkeeping of the batch and sequence axes (a tenth of them left). On the
    CPU the fast norm, rope and attention show as their fallback graphs, the same on both sides;
    on a GPU, where they are one node each, the share removed is larger."""
    model = load_model(tiny_model_dir).model
    fuse_projections(model)
    lean = LeanStep(model)
    cache = make_prompt_cache(model)
    model(mx.array([list(PROMPT)]), cache=cache)
    mx.eval([c.state for c in cache])
    token = mx.array([9])
    logits = model(token[None], cache=cache)[:, -1, :]
    own = _nodes(logits)
    mx.eval(logits, [c.state for c in cache])  # nothing of this step in the next one's graph
    for layer in cache:
        layer.trim(1)
    ours = _nodes(lean.logits(token, cache))
    assert sum(ours.values()) < sum(own.values())
    layout = ("Transpose", "Flatten", "Unflatten")
    assert sum(ours.get(n, 0) for n in layout) * 6 <= sum(own.get(n, 0) for n in layout)
    assert ours["Matmul"] == own["Matmul"]  # the same products


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=90, temperature=0.0),
        SamplingParams(max_tokens=90, temperature=0.8, seed=5),
        SamplingParams(max_tokens=90, temperature=0.0, logprobs=True, repetition_penalty=1.3),
    ],
    ids=["greedy", "seeded", "logprobs+penalty"],
)
def test_a_sequence_has_the_plain_tokens(tiny_model_dir: Path, params: SamplingParams) -> None:
    model = load_model(tiny_model_dir).model
    plain, plain_lp, _ = generate(model, params, None, PROMPT)
    fuse_projections(model)
    tokens, lp, _ = generate(model, params, LeanStep(model), PROMPT)
    assert tokens == plain and len(tokens) == 90
    assert lp == plain_lp


class CountingLogits:
    """Counts `LeanStep.logits` calls (on any thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = LeanStep.logits

        def counted(step: LeanStep, *args: Any) -> Any:
            self.calls += 1
            return original(step, *args)

        monkeypatch.setattr(LeanStep, "logits", counted)


async def test_the_serialized_route_gives_the_plain_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation across the cache's growth, a prefix-cache hit, an abort mid-stream and a
    request continuing it, seeded sampling: the same tokens as with the option off."""
    steps = CountingLogits(monkeypatch)
    async with trio_mlx.open_engine(tiny_model_dir, lean_decode=True, max_num_seqs=1) as engine:
        lean = await _script(engine)
    assert steps.calls > 200
    calls = steps.calls
    async with trio_mlx.open_engine(tiny_model_dir, lean_decode=False, max_num_seqs=1) as engine:
        plain = await _script(engine)
    assert steps.calls == calls
    assert lean == plain and len(lean[0]) == 80


async def test_the_batched_route_gives_the_plain_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows joining and leaving (the lone row takes the lean step, a batch the model's), one
    aborted mid-way, a prefix-cache hit: the same tokens as with the option off."""
    steps = CountingLogits(monkeypatch)
    async with trio_mlx.open_engine(
        tiny_model_dir, lean_decode=True, fused_projections=True, max_num_seqs=4
    ) as engine:
        lean = await _batched_script(engine)
        alone = await _script(engine)
    assert steps.calls > 100
    async with trio_mlx.open_engine(tiny_model_dir, lean_decode=False, max_num_seqs=4) as engine:
        assert lean == await _batched_script(engine)
        assert alone == await _script(engine)
    assert [len(r) for r in lean[:3]] == [24, 40, 60]


async def test_with_lean_batches_on_the_batched_route_gives_the_plain_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TRIO_MLX_LEAN_BATCH=on`: batches of 2 or more rows step through `batch_logits` over the
    engine's batch caches (its masks, ragged and segmented attention): rows joining, leaving,
    one aborted, a prefix-cache hit, the same tokens as with the lean step off."""
    batched = {"calls": 0}
    original = LeanStep.batch_logits

    def counted(step: LeanStep, *args: Any) -> Any:
        batched["calls"] += 1
        return original(step, *args)

    monkeypatch.setattr(LeanStep, "batch_logits", counted)
    monkeypatch.setenv("TRIO_MLX_LEAN_BATCH", "on")
    async with trio_mlx.open_engine(
        tiny_model_dir, lean_decode=True, fused_projections=True, max_num_seqs=4
    ) as engine:
        lean = await _batched_script(engine)
    assert batched["calls"] > 20
    monkeypatch.delenv("TRIO_MLX_LEAN_BATCH")
    async with trio_mlx.open_engine(tiny_model_dir, lean_decode=False, max_num_seqs=4) as engine:
        assert lean == await _batched_script(engine)


async def test_a_model_it_does_not_know_serves_on_the_models_own_step(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = CountingLogits(monkeypatch)
    loader = wrapping_loader(Delegating)[0]
    async with trio_mlx.open_engine(tiny_model_dir, lean_decode=True, loader=loader) as engine:
        out = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
    assert len(out.tokens) == 8 and steps.calls == 0


def test_off_on_the_cpu_unless_asked_for(tiny_model_dir: Path) -> None:
    assert mx.default_device() == mx.cpu
    model = load_model(tiny_model_dir).model
    assert prepare_lean_step(model, None) is None
    assert prepare_lean_step(model, False) is None
    assert isinstance(prepare_lean_step(model, True), LeanStep)
    assert prepare_fast_decode(model, False) is None  # the lean step is built apart
    assert prepare_lean_step(Delegating(model), True) is None
    with pytest.raises(ValueError, match="not a model"):
        LeanStep(Delegating(model))


def test_serve_passes_the_option() -> None:
    options = settings_from_args(build_parser().parse_args(["serve"])).engine_options
    assert options["lean_decode"] is None
    for flag, value in (("--lean-decode", True), ("--no-lean-decode", False)):
        args = build_parser().parse_args(["serve", flag])
        assert settings_from_args(args).engine_options["lean_decode"] is value


@pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])
async def test_structured_output_keeps_its_tokens_and_its_forced_runs(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, max_num_seqs: int
) -> None:
    """Under a grammar the lean step computes the masked steps' logits and the forced runs
    still go through the model in one pass each (the cache stays plain): the same output in
    the same number of decode steps as with the option off."""
    from test_structured_output import FORMAT, PERSON, USER, assert_valid

    steps = CountingLogits(monkeypatch)
    found = []
    for lean in (True, False):
        async with trio_mlx.open_engine(
            tiny_model_dir, lean_decode=lean, max_num_seqs=max_num_seqs
        ) as engine:
            out = await engine.chat(USER, output_format=FORMAT, max_tokens=120, temperature=0)
            found.append(
                (out.tokens, out.finish_reason, engine.get_stats()["runner"]["decode_steps"])
            )
            assert_valid(out.text, PERSON)
        if lean:
            assert steps.calls > 0
    assert found[0] == found[1]
    assert found[0][2] < len(found[0][0]) / 2  # most of the object came in forced runs
