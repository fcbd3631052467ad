"""A waiting prompt's prefill chunk in the decode step's pass (`mixed_step`): on the tiny fp32
model, every request's greedy tokens equal the same request run alone, whether the chunks run
plain or padded to width buckets, in both pipeline modes; an arrival aborted between two of its
mixed chunks leaves the others' tokens as they were and nothing held."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from runner_intake import hold_the_runner_intake
from servers import eventually
from test_batching import assert_idle
from test_long_join import eos_ids, no_eos
from trio_mlx.actors import batch_loop
from trio_mlx.engine import mixed_step, scheduling
from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.engine.batch_join import PrefillResult

STEP = 32
BLOCK = 8
LENGTHS = {1: 150, 2: 333, 3: 90}


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(100, 40_000) for _ in range(LENGTHS[i])]


def running_params(eos: list[int]) -> dict[str, Any]:
    """The running stream: greedy, EOS banned, long enough to outlast the arrivals."""
    return no_eos(eos, 160)


ARRIVING = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(autouse=True)
def mixing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BatchDecoder, "mixed_prefill", True)
    # chunks of the whole step while rows decode, apart or in the pass: the arrivals are in well
    # before the running stream ends (the tiny model's step is a few ms on this CPU), and the
    # chunks' sizes do not hang on this machine's timing
    monkeypatch.setattr(scheduling, "DEFAULT_DECODE_SHARE", 1000.0)
    monkeypatch.setattr(scheduling, "DEFAULT_MIXED_SHARE", 1000.0)
    monkeypatch.setattr(scheduling, "MIXED_FIRST_TOKENS", STEP)


async def alone(model_dir: Path, eos: list[int]) -> dict[int, list[int]]:
    async with trio_mlx.open_engine(model_dir, max_num_seqs=1) as engine:
        out = {0: (await engine.generate("Once upon a time", **running_params(eos))).tokens}
        for i in LENGTHS:
            out[i] = (await engine.generate(prompt(i), **ARRIVING)).tokens
    return out


async def arrivals_during_a_decode(
    model_dir: Path, eos: list[int], *, on_mixed: Any = None
) -> tuple[dict[int, list[int]], dict[str, Any], dict[int, trio.CancelScope]]:
    """One stream decodes while three long prompts arrive; each one's tokens, the runner's
    stats and the arrivals' cancel scopes. `on_mixed(scopes)`, if given, runs in the nursery
    once the runner has started."""
    async with trio_mlx.open_engine(
        model_dir,
        max_num_seqs=4,
        prefill_step_size=STEP,
        prefill_block=BLOCK,
        cache_memory_bytes=0,
    ) as engine:
        outputs: dict[int, list[int]] = {}
        started = trio.Event()
        scopes = {i: trio.CancelScope() for i in LENGTHS}

        async def running() -> None:
            async for out in engine.stream_generate("Once upon a time", **running_params(eos)):
                started.set()
                outputs.setdefault(0, []).extend(out.new_tokens)

        async def arriving(i: int) -> None:
            await started.wait()
            with scopes[i]:
                outputs[i] = list((await engine.generate(prompt(i), **ARRIVING)).tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(running)
            for i in LENGTHS:
                nursery.start_soon(arriving, i)
            if on_mixed is not None:
                await started.wait()
                await on_mixed(engine, scopes)
        await assert_idle(engine)
        runner = engine.get_stats()["runner"]
        # the step records count the prompt tokens each step carried in its pass
        steps = engine._runner.counters.recent_steps
        runner["step_mixed_tokens"] = sum(s.mixed_tokens for s in steps)
        return outputs, runner, scopes


@pytest.mark.usefixtures("batch_pipeline")
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
async def test_chunks_in_the_decode_pass_give_every_request_its_tokens_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, padded: bool
) -> None:
    eos = eos_ids(tiny_model_dir)
    expected = await alone(tiny_model_dir, eos)
    if padded:  # the chunks' attention over width buckets, as on CUDA
        monkeypatch.setattr(batch_loop, "padded_prefill_default", lambda: True)
    carried: list[int] = []  # chunks a pass carried
    forward = mixed_step.forward

    def counted(model: Any, inputs: Any, cache: Any, chunks: Any, **kwargs: Any) -> Any:
        carried.append(len(chunks))
        return forward(model, inputs, cache, chunks, **kwargs)

    monkeypatch.setattr(mixed_step, "forward", counted)
    outputs, runner, _ = await arrivals_during_a_decode(tiny_model_dir, eos)
    assert outputs == expected
    # most of the arrivals' prompt tokens rode in decode steps (the first arrival's first chunk
    # may come before its companions decode, and a chunk may find no row to ride with)
    assert runner["mixed_chunks"] >= 6, runner
    assert runner["step_mixed_tokens"] >= runner["mixed_chunks"], runner  # a token a chunk at least
    # where a prompt's last chunk left some of the step's budget, the next prompt took it
    assert max(carried) >= 2, carried


async def test_an_abort_between_mixed_chunks_disturbs_no_one(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eos = eos_ids(tiny_model_dir)
    expected = await alone(tiny_model_dir, eos)
    hold = hold_the_runner_intake(monkeypatch)
    mixed_lengths: list[int] = []
    seen = threading.Event()
    take = BatchDecoder.take_mixed

    def held_after_a_mixed_chunk(self: BatchDecoder) -> list[PrefillResult]:
        results = take(self)
        for result in results:
            seq = result.seq
            if not seen.is_set() and seq.prompt_done < len(seq.job.prompt_tokens) - STEP:
                mixed_lengths.append(len(seq.job.prompt_tokens))
                hold.close()  # the runner waits at its next step's intake
                seen.set()
        return results

    monkeypatch.setattr(BatchDecoder, "take_mixed", held_after_a_mixed_chunk)
    aborted: list[int] = []

    async def abort_the_mixed_one(engine: trio_mlx.Engine, scopes: dict[int, Any]) -> None:
        await eventually(hold.held.is_set)  # a prompt has had a chunk mixed and has more to go
        (i,) = [i for i, n in LENGTHS.items() if n == mixed_lengths[0]]
        in_flight = engine.get_stats()["runner"]["requests_in_flight"]
        scopes[i].cancel()  # the client goes away mid-admission
        await eventually(
            lambda: engine.get_stats()["runner"]["requests_in_flight"] == in_flight - 1
        )
        aborted.append(i)
        hold.open()

    outputs, runner, _ = await arrivals_during_a_decode(
        tiny_model_dir, eos, on_mixed=abort_the_mixed_one
    )
    (gone,) = aborted
    assert gone not in outputs
    assert outputs == {i: expected[i] for i in expected if i != gone}
    assert runner["aborted"] >= 1 and runner["mixed_chunks"] >= 1


def test_only_plain_caches_and_chunks_of_the_batch_model_mix(tiny_model_dir: Path) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    from trio_mlx.engine.batch_sequence import BatchSequence
    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.engine.loading import load_model
    from trio_mlx.engine.prompt_cache import make_cache
    from trio_mlx.types import SamplingParams

    loaded = load_model(tiny_model_dir)
    assert mixed_step.prepare(loaded.model)
    assert not mixed_step.prepare(object())  # no architecture the dispatcher reaches
    job = GenerationJob(1, tuple(range(5, 105)), SamplingParams(max_tokens=2))
    seq = BatchSequence(
        job,
        loaded.model,
        vocab_size=len(loaded.tokenizer),
        plan=PrefillPlan(STEP),
        max_kv_size=None,
        cache=None,
        cached_tokens=0,
        split_at_store_points=False,
    )
    rows = make_cache(loaded.model)
    assert mixed_step.mixable(rows, seq)
    rotating = [RotatingKVCache(max_size=64) for _ in rows]
    assert not mixed_step.mixable(rotating, seq)  # a rotating batch cache runs apart
    seq.prefill_model = loaded.model  # a prompt with media: its own model
    assert not mixed_step.mixable(rows, seq)


async def test_a_prompt_restored_from_the_prefix_cache_mixes_from_where_its_cache_ends(
    tiny_model_dir: Path,
) -> None:
    """The prompt after a conversation's first turn: its cached prefix is restored, and its
    chunks ride in decode steps from there, at their true positions."""
    eos = eos_ids(tiny_model_dir)
    first_turn = prompt(2)
    rng = random.Random(5)
    second_turn = first_turn + [rng.randrange(100, 40_000) for _ in range(120)]
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        expected = (await engine.generate(second_turn, **ARRIVING)).tokens
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=4, prefill_step_size=STEP, prefill_block=BLOCK
    ) as engine:
        await engine.generate(first_turn, **ARRIVING)  # its prompt's snapshot is stored
        got: list[int] = []
        started = trio.Event()

        async def running(scope: trio.CancelScope) -> None:
            with scope:
                async for _ in engine.stream_generate("Once upon a time", **running_params(eos)):
                    started.set()

        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            nursery.start_soon(running, scope)
            await started.wait()
            got = list((await engine.generate(second_turn, **ARRIVING)).tokens)
            scope.cancel()
        assert got == expected
        assert engine.get_cache_stats()["hits"] >= 1
        assert engine.get_stats()["runner"]["mixed_chunks"] >= 2
        await assert_idle(engine)


@pytest.mark.parametrize(
    ("tied", "fused"),
    [(True, False), (False, False), (False, True)],
    ids=["tied-head", "own-head", "fused-projections"],
)
def test_the_mixed_pass_gives_the_rows_their_logits_and_the_chunk_its_cache(
    tied: bool, fused: bool
) -> None:
    """One pass against the plain ones, float32 on the CPU: the rows' logits (the batch's
    left-padded rows of different lengths) and two chunks' keys and values (one from the middle
    of its prompt, one a fresh prompt's whole rest); also with the projections fused, as on a
    GPU (`fused.fuse_projections`)."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from trio_mlx.engine.batch_sequence import BatchSequence
    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.types import SamplingParams

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=300,
        tie_word_embeddings=tied,
    )
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    if fused:
        from trio_mlx.engine.fused import fuse_projections

        assert fuse_projections(model) == 2 * args.num_hidden_layers
    assert mixed_step.prepare(model)
    lengths, inputs = (5, 9, 7), mx.array([11, 12, 13], dtype=mx.uint32)

    def batch() -> list[BatchKVCache]:
        caches = []
        for i, length in enumerate(lengths):
            cache = [KVCache() for _ in model.layers]
            model(mx.arange(20 + i, 20 + i + length, dtype=mx.uint32)[None], cache=cache)
            caches.append(cache)
        return [BatchKVCache.merge([c[layer] for c in caches]) for layer in range(2)]

    def sequence(request: int, prompt: tuple[int, ...]) -> BatchSequence:
        return BatchSequence(
            GenerationJob(request, prompt, SamplingParams(max_tokens=1)),
            model,
            vocab_size=args.vocab_size,
            plan=PrefillPlan(16),
            max_kv_size=None,
            cache=None,
            cached_tokens=0,
            split_at_store_points=False,
        )

    # two chunks in the pass: one from position 16 of a long prompt, one a fresh prompt's first
    long, fresh = tuple(range(40, 90)), tuple(range(100, 110))
    ahead, starting = sequence(1, long), sequence(2, fresh)
    ahead.prefill_chunk(model, 16)
    rows = batch()
    chunks = [mixed_step.plan(seq, 16, rungs=False) for seq in (ahead, starting)]
    logits, done = mixed_step.forward(model, inputs, rows, chunks)
    plain_rows = batch()
    expected = model(inputs[:, None], cache=plain_rows)[:, -1, :]
    assert [n for n, _ in done] == [16, 9] and (ahead.prompt_done, starting.prompt_done) == (32, 9)
    assert mx.allclose(logits, expected, atol=1e-4).item()
    for seq, prompt, held in ((ahead, long, 32), (starting, fresh, 9)):
        alone = [KVCache() for _ in model.layers]
        model(mx.array(prompt[:held], dtype=mx.uint32)[None], cache=alone)
        for mixed_layer, plain_layer in zip(seq.cache, alone, strict=True):
            assert mixed_layer.offset == plain_layer.offset == held
            for got, want in (
                (mixed_layer.keys, plain_layer.keys),
                (mixed_layer.values, plain_layer.values),
            ):
                assert mx.allclose(got[..., :held, :], want[..., :held, :], atol=1e-4).item()
    for mixed_layer, plain_layer in zip(rows, plain_rows, strict=True):
        assert mx.allclose(mixed_layer.keys, plain_layer.keys, atol=1e-5).item()


@pytest.mark.parametrize(
    ("padded", "chosen", "expected"),
    [(True, None, True), (False, None, False), (True, "off", False), (False, "on", True)],
)
def test_chunks_ride_in_the_decode_pass_by_default_where_prefill_chunks_are_padded(
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    padded: bool,
    chosen: str | None,
    expected: bool,
) -> None:
    """By default the decode pass carries the chunks where the batch pads its prefill chunks to
    recurring shapes (MLX's CUDA backend, measured to pay there), not elsewhere (the CPU);
    `TRIO_MLX_MIXED_STEP=on|off` decides instead where set."""
    from mlx_lm import load

    from trio_mlx.engine.decode import PrefillPlan

    monkeypatch.setattr(BatchDecoder, "mixed_prefill", None)
    if chosen is None:
        monkeypatch.delenv("TRIO_MLX_MIXED_STEP", raising=False)
    else:
        monkeypatch.setenv("TRIO_MLX_MIXED_STEP", chosen)
    model, _ = load(str(tiny_model_dir))
    decoder = BatchDecoder(
        model,
        frozenset(),
        vocab_size=int(model.args.vocab_size),
        plan=PrefillPlan(STEP, tail=BLOCK, block=BLOCK),
        padded_prefill=padded,
    )
    assert decoder.mixing is expected
