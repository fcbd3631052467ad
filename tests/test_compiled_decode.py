"""The compiled decode path (`compiled_decode`: fused projections, a traced one-token step over a
KV cache of bucketed size) gives the plain path's tokens, on the tiny random model in float32.

Unit level (`ActiveSequence` with small buckets, so that one generation crosses several): greedy,
seeded sampling, logprobs with a penalty. Engine level (the default buckets, a generation crossing
from the 256- into the 512-position bucket): with the prefix cache restoring into the bucketed
cache, after an abort, and on the batched route (fused projections). Each compares against an
engine or a sequence with the option off, and checks that the traced step really ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio

import trio_mlx
from model_wrappers import _Wrapped, wrapping_loader
from tiny_model import build_in_memory
from trio_mlx.cli import build_parser
from trio_mlx.engine.compiled_step import CompiledDecode, bucket_size, unsupported_reason
from trio_mlx.engine.decode import ActiveSequence, GenerationJob, PrefillPlan
from trio_mlx.engine.fused import fuse_projections
from trio_mlx.engine.loading import load_model
from trio_mlx.http.server import settings_from_args
from trio_mlx.types import SamplingParams

PROMPT = tuple(range(5, 45))


def generate(
    model: Any,
    params: SamplingParams,
    compiled: CompiledDecode | None,
    prompt: tuple[int, ...],
    vocab: int = 49152,
) -> tuple[list[int], list[float], ActiveSequence]:
    seq = ActiveSequence(
        GenerationJob(1, prompt, params),
        model,
        frozenset(),
        PrefillPlan(2048),
        vocab_size=vocab,
        compiled=compiled,
    )
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(params.max_tokens + len(prompt) + 2):  # bounded: one token or chunk a step
        if seq.finished:
            break
        result = seq.step()
        tokens += result.tokens
        logprobs += [lp.logprob for lp in result.logprobs]
    assert seq.finished
    return tokens, logprobs, seq


class CountingSteps:
    """Counts `CompiledDecode.step` calls (on any thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = CompiledDecode.step

        def counted(decoder: CompiledDecode, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(decoder, *args, **kwargs)

        monkeypatch.setattr(CompiledDecode, "step", counted)


def test_buckets_double_then_grow_linearly() -> None:
    assert [bucket_size(n) for n in (1, 256, 257, 600, 4096, 4097, 9000)] == [
        256,
        256,
        512,
        1024,
        4096,
        8192,
        12288,
    ]
    assert [bucket_size(n, first=16) for n in (1, 17, 41, 65)] == [16, 32, 64, 128]
    with pytest.raises(ValueError):
        bucket_size(0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=90, temperature=0.0),
        SamplingParams(max_tokens=90, temperature=0.8, top_p=0.9, seed=11),
        SamplingParams(
            max_tokens=60, temperature=0.0, logprobs=True, top_logprobs=3, repetition_penalty=1.3
        ),
    ],
    ids=["greedy", "seeded-sampling", "logprobs-penalty"],
)
def test_a_generation_across_buckets_has_the_plain_tokens(
    tiny_model_dir: Path, params: SamplingParams
) -> None:
    model = load_model(tiny_model_dir).model
    plain, plain_lp, _ = generate(model, params, None, PROMPT)
    # 16-position buckets: 40 prompt tokens + up to 90 more cross 64 and 128.
    tokens, lp, seq = generate(model, params, CompiledDecode(model, first_bucket=16), PROMPT)
    assert tokens == plain and len(tokens) > 30
    assert lp == pytest.approx(plain_lp, abs=1e-5)
    offset = seq.cache[0].offset
    assert offset > 64 and seq.cache[0].keys.shape[2] == bucket_size(offset, first=16)


def test_fused_projections_keep_the_tokens_and_the_weights(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0)
    model = load_model(tiny_model_dir).model
    plain, _, _ = generate(model, params, None, PROMPT)
    size = sum(v.nbytes for _, v in _leaves(model))
    mx.eval(model.parameters())
    mx.clear_cache()
    active = mx.get_active_memory()
    assert fuse_projections(model) == 4  # 2 layers x (q/k/v, gate/up)
    # the replaced weights are not kept in MLX's buffer cache (~9 GB on an 8B bf16 model)
    assert mx.get_cache_memory() == 0 and mx.get_active_memory() <= active
    assert "qkv_proj" in model.layers[0].self_attn and "q_proj" not in model.layers[0].self_attn
    assert sum(v.nbytes for _, v in _leaves(model)) == size  # each weight counted once
    assert generate(model, params, None, PROMPT)[0] == plain
    assert generate(model, params, CompiledDecode(model, first_bucket=16), PROMPT)[0] == plain
    assert fuse_projections(model) == 0  # already fused


def test_fused_quantized_projections_keep_the_logits(tiny_model_dir: Path) -> None:
    import mlx.nn as nn

    model = load_model(tiny_model_dir).model
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([PROMPT])
    before = model(tokens)
    assert fuse_projections(model) == 4
    assert mx.allclose(model(tokens), before, atol=1e-4).item()


def test_models_it_does_not_know_run_the_plain_path(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir).model
    assert unsupported_reason(model) is None
    assert unsupported_reason(_Wrapped(model)) is not None
    assert fuse_projections(_Wrapped(model)) == 0


def _leaves(model: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return list(tree_flatten(model.parameters()))


# ---- through the engine -----------------------------------------------------------------------

LONG_PROMPT = [(7 * i) % 30000 + 100 for i in range(220)]  # 220 + 80 tokens: 256 -> 512


async def _script(engine: trio_mlx.Engine) -> list[list[int]]:
    """A long generation, a conversation continuing it (a prefix-cache hit on the cache it left),
    an aborted one, and a request continuing the aborted one."""
    first = await engine.generate(LONG_PROMPT, max_tokens=80, temperature=0.0)
    follow = LONG_PROMPT + list(first.tokens) + [300, 301, 302]
    second = await engine.generate(follow, max_tokens=20, temperature=0.0)
    assert second.cached_tokens > len(LONG_PROMPT)
    aborted: list[int] = []
    other = [p + 1 for p in LONG_PROMPT]
    async for out in engine.stream_generate(other, max_tokens=200, temperature=0.0):
        aborted += out.new_tokens
        if len(aborted) >= 40:
            break  # leaving the stream aborts the request
    again = await engine.generate(other + aborted[:36], max_tokens=30, temperature=0.0)
    seeded = await engine.generate(LONG_PROMPT, max_tokens=60, temperature=0.9, seed=3)
    return [list(first.tokens), list(second.tokens), aborted[:40], list(again.tokens),
            list(seeded.tokens)]  # fmt: skip


async def test_the_engine_gives_the_plain_tokens_with_the_prefix_cache_and_aborts(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = CountingSteps(monkeypatch)
    async with trio_mlx.open_engine(tiny_model_dir, compiled_decode=True, max_num_seqs=1) as engine:
        compiled = await _script(engine)
    assert steps.calls > 200
    calls = steps.calls
    async with trio_mlx.open_engine(
        tiny_model_dir, compiled_decode=False, max_num_seqs=1
    ) as engine:
        plain = await _script(engine)
    assert steps.calls == calls  # the plain engine never traced
    assert compiled == plain
    assert len(compiled[0]) == 80  # crossed into the second bucket


async def test_fused_projections_alone_give_the_plain_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU default (fused projections, the plain step) on the CPU, where rounding cannot
    split a tie: the same tokens, the prefix cache and an abort included, and nothing traced."""
    import trio_mlx.engine.fast_decode as fast_decode

    steps = CountingSteps(monkeypatch)
    groups: list[int] = []

    def counted(model: Any) -> int:
        groups.append(fuse_projections(model))
        return groups[-1]

    monkeypatch.setattr(fast_decode, "fuse_projections", counted)
    async with trio_mlx.open_engine(tiny_model_dir, fused_projections=True) as engine:
        fused = await _script(engine)
    assert steps.calls == 0
    assert groups == [4]  # two layers, attention and MLP each
    async with trio_mlx.open_engine(tiny_model_dir, fused_projections=False) as engine:
        plain = await _script(engine)
    assert fused == plain


async def _batched_script(engine: trio_mlx.Engine) -> list[list[int]]:
    """Rows of different lengths joining at different times and leaving at different times (one
    crossing from the 256- into the 512-position bucket), one aborted mid-way, and a request
    continuing a finished one from the prefix cache."""
    prompts = [[(11 * i + k) % 30000 + 100 for i in range(30 + 100 * k)] for k in range(3)]
    budgets = [24, 40, 60]  # the third: 230 + 60 positions
    results: list[list[int]] = [[] for _ in range(5)]

    async def one(k: int) -> None:
        if k == 2:
            await trio.sleep(0.05)  # joins a running batch
        out = await engine.generate(prompts[k], max_tokens=budgets[k], temperature=0.0)
        results[k] = list(out.tokens)

    async def aborted() -> None:
        async for out in engine.stream_generate(prompts[0][::-1], max_tokens=200, temperature=0):
            results[3] += out.new_tokens
            if len(results[3]) >= 12:
                break
        results[3] = results[3][:12]

    async with trio.open_nursery() as nursery:
        for k in range(3):
            nursery.start_soon(one, k)
        nursery.start_soon(aborted)
    follow = prompts[1] + results[1] + [500, 501]
    out = await engine.generate(follow, max_tokens=16, temperature=0.0)
    results[4] = list(out.tokens)
    return results


async def test_the_batched_route_gives_the_plain_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    original = CompiledDecode.batch_logits

    def counted(decoder: CompiledDecode, *args: Any) -> Any:
        calls.append(args[1][0].keys.shape[0])  # rows in the step
        return original(decoder, *args)

    monkeypatch.setattr(CompiledDecode, "batch_logits", counted)
    monkeypatch.setenv("TRIO_MLX_COMPILED_BATCH", "on")
    fused = []

    def loader(spec: Any) -> Any:
        loaded = load_model(spec)
        fused.append(loaded.model)
        return loaded

    async with trio_mlx.open_engine(
        tiny_model_dir, compiled_decode=True, max_num_seqs=4, loader=loader
    ) as engine:
        batched = await _batched_script(engine)
    assert "qkv_proj" in fused[0].layers[0].self_attn
    assert len(calls) > 60 and max(calls) > 1
    async with trio_mlx.open_engine(tiny_model_dir, compiled_decode=False, max_num_seqs=4) as e:
        assert batched == await _batched_script(e)
    assert [len(r) for r in batched[:3]] == [24, 40, 60]
    monkeypatch.delenv("TRIO_MLX_COMPILED_BATCH")
    steps = len(calls)
    async with trio_mlx.open_engine(tiny_model_dir, compiled_decode=True, max_num_seqs=4) as e:
        assert batched == await _batched_script(e)  # fused projections only
    assert len(calls) == steps


class Delegating(_Wrapped):
    """The real model behind a wrapper: not a model class the traced step knows."""

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        return self._inner(tokens, cache=cache)


async def test_a_wrapped_model_serves_on_the_plain_path(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = CountingSteps(monkeypatch)
    async with trio_mlx.open_engine(
        tiny_model_dir, compiled_decode=True, loader=wrapping_loader(Delegating)[0]
    ) as engine:
        out = await engine.generate(PROMPT, max_tokens=8, temperature=0.0)
    assert len(out.tokens) == 8 and steps.calls == 0


def test_serve_passes_the_option() -> None:
    options = settings_from_args(build_parser().parse_args(["serve"])).engine_options
    assert options["compiled_decode"] is None
    for flag, value in (("--compiled-decode", True), ("--no-compiled-decode", False)):
        args = build_parser().parse_args(["serve", flag])
        assert settings_from_args(args).engine_options["compiled_decode"] is value


def test_the_attention_dispatcher_routes_only_the_traced_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA kernel cannot run here: its stand-in (`reference_attention`, the arithmetic the
    kernel implements) takes the traced layers' attention; every other call is mlx-lm's. (A head
    size of 32: the kernel's smallest.)"""
    from tiny_model import build_tiny_model
    from trio_mlx.engine import decode_attention

    calls: list[tuple[int, ...]] = []

    def stand_in(queries: Any, keys: Any, values: Any, offset: Any, scale: float) -> Any:
        calls.append(tuple(keys.shape))
        return decode_attention.reference_attention(queries, keys, values, offset, scale)

    monkeypatch.setattr(decode_attention, "decode_attention", stand_in)
    params = SamplingParams(max_tokens=60, temperature=0.0)
    model_dir = build_tiny_model(tmp_path / "heads-32", hidden_size=128, intermediate_size=256)
    model = load_model(model_dir).model
    plain, _, _ = generate(model, params, None, PROMPT)
    decoder = CompiledDecode(model, first_bucket=16, attention_kernel=True)
    tokens, _, _ = generate(model, params, decoder, PROMPT)
    assert tokens == plain
    assert {shape[2] for shape in calls} == {64, 128}  # traced once per bucket, two layers each
    assert len(calls) == 2 * 2
    assert generate(model, params, None, PROMPT)[0] == plain  # the plain path is untouched
    assert len(calls) == 4


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_the_other_architectures_give_the_plain_tokens(kind: str) -> None:
    """qwen2 (biased q/k/v projections) and qwen3 (q/k norms, an explicit head size), random and
    tiny, built in memory: fused and traced, the plain path's tokens."""
    model = build_in_memory(kind)
    params = SamplingParams(max_tokens=60, temperature=0.0)
    prompt = tuple(range(5, 45))
    plain, _, _ = generate(model, params, None, prompt, vocab=4096)
    assert unsupported_reason(model) is None
    assert fuse_projections(model) == 4
    decoder = CompiledDecode(model, first_bucket=16)
    assert generate(model, params, decoder, prompt, vocab=4096)[0] == plain


def test_the_default_is_off_and_asked_for_it_fuses_and_traces(
    tiny_model_dir: Path,
) -> None:
    from trio_mlx.engine.fast_decode import prepare_fast_decode

    assert mx.default_device() == mx.cpu
    model = load_model(tiny_model_dir).model
    assert prepare_fast_decode(model, None) is None
    assert "q_proj" in model.layers[0].self_attn  # untouched: both default to off on the CPU
    assert prepare_fast_decode(model, False) is None
    assert "q_proj" in model.layers[0].self_attn
    fused_only = load_model(tiny_model_dir).model
    assert prepare_fast_decode(fused_only, False, True) is None  # fused, plain step
    assert "qkv_proj" in fused_only.layers[0].self_attn
    assert isinstance(prepare_fast_decode(model, True), CompiledDecode)
    assert "qkv_proj" in model.layers[0].self_attn
    assert prepare_fast_decode(Delegating(load_model(tiny_model_dir).model), True) is None


def test_after_the_warm_up_a_generation_traces_nothing(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(tiny_model_dir).model
    decoder = CompiledDecode(model)
    traces: list[int] = []
    trace = decoder._trace

    def counted(greedy: bool, tokens: Any, offset: Any, *arrays: Any) -> Any:
        traces.append(arrays[0].shape[2])
        return trace(greedy, tokens, offset, *arrays)

    monkeypatch.setattr(decoder, "_trace", counted)
    assert decoder.warm_up()
    assert sorted(set(traces)) == [256, 512, 1024, 2048, 4096] and len(traces) == 10
    params = SamplingParams(max_tokens=60, temperature=0.0)
    prompt = tuple(LONG_PROMPT)  # 220 + 60: 256 -> 512
    plain, _, _ = generate(model, params, None, prompt)
    assert generate(model, params, decoder, prompt)[0] == plain
    assert len(traces) == 10


async def test_small_batches_take_the_traced_step_and_give_the_plain_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`traced_batch_rows`: batches of 2 to N rows decode through the traced step (traced at
    load), a lone row and larger batches through the plain one; the tokens are the plain
    route's, an abort and a prefix-cache hit included."""
    calls: list[int] = []
    original = CompiledDecode.batch_logits

    def counted(decoder: CompiledDecode, *args: Any) -> Any:
        calls.append(args[1][0].keys.shape[0])  # rows in the step
        return original(decoder, *args)

    monkeypatch.setattr(CompiledDecode, "batch_logits", counted)
    monkeypatch.delenv("TRIO_MLX_COMPILED_BATCH", raising=False)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4, traced_batch_rows=3) as e:
        traced = await _batched_script(e)
        runner = e.get_stats()["runner"]
    assert calls and set(calls) <= {2, 3}  # never a lone row, never 4
    assert runner["traced_steps"] == len(calls)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4, traced_batch_rows=0) as e:
        plain = await _batched_script(e)
        assert e.get_stats()["runner"]["traced_steps"] == 0
    assert traced == plain
    assert [len(r) for r in traced[:3]] == [24, 40, 60]
    steps = len(calls)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as e:  # the CPU's default
        assert plain == await _batched_script(e)
    assert len(calls) == steps


def test_the_traced_batch_is_traced_at_load_for_each_row_count(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir).model
    decoder = CompiledDecode(model)
    traced: list[tuple[int, int]] = []
    original = decoder._trace_batch

    def counted(tokens: Any, idx: Any, offset: Any, left: Any, *arrays: Any) -> Any:
        traced.append((int(tokens.shape[0]), int(arrays[0].shape[2])))
        return original(tokens, idx, offset, left, *arrays)

    decoder._batch = mx.compile(counted)
    assert decoder.warm_up_batch(range(2, 4), up_to=1024)
    assert traced == [(b, s) for b in (2, 3) for s in (256, 512, 1024)]


def test_the_serve_flag_sets_the_traced_batch_rows() -> None:
    args = build_parser().parse_args(["serve", "--traced-batch-rows", "4"])
    assert settings_from_args(args).engine_options["traced_batch_rows"] == 4
    default = settings_from_args(build_parser().parse_args(["serve"]))
    assert default.engine_options["traced_batch_rows"] is None
    with pytest.raises(ValueError, match="traced_batch_rows"):
        trio_mlx.EngineConfig(model=None, traced_batch_rows=-1)
