"""Continuous batching (`max_num_seqs > 1`) on the tiny fp32 model: every request's output in a
batch equals the same request run alone on the serialized route, whatever joins or leaves the
batch around it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from model_wrappers import FaultyModel, wrapping_loader
from runner_intake import hold_the_runner_intake
from servers import eventually

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog because",
    "Once upon a time",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24",
    "Paris is the capital of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor",
]
SYSTEM = {"role": "system", "content": "You are a terse assistant that answers in one word."}


async def alone(model_dir: Path, prompts: list[str], **sampling: Any) -> list[list[int]]:
    """Each prompt run by itself on the serialized route."""
    async with trio_mlx.open_engine(model_dir, max_num_seqs=1) as engine:
        return [(await engine.generate(p, **sampling)).tokens for p in prompts]


async def together(engine: trio_mlx.Engine, prompts: list[str], **sampling: Any) -> list[Any]:
    outputs: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        outputs[i] = await engine.generate(prompts[i], **sampling)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return outputs


async def assert_idle(engine: trio_mlx.Engine) -> None:
    """Nothing holds a slot, nothing waits, and the runner's batch empties (its counters are
    updated at the end of the step that delivered the last finish)."""
    await eventually(lambda: not engine.get_stats()["runner"]["live_sequences"])
    stats = engine.get_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["slot_holders"] == []
    assert stats["runner"]["live_sequences"] == 0 and stats["runner"]["requests_in_flight"] == 0
    assert stats["kv_reserved_bytes"] == 0


@pytest.mark.usefixtures("batch_pipeline")
async def test_eight_prompts_in_one_batch_equal_each_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampling = {"max_tokens": 10, "temperature": 0.0}
    expected = await alone(tiny_model_dir, PROMPTS, **sampling)
    hold = hold_the_runner_intake(monkeypatch)
    # Chunks cut by the plan alone, not by a pace measured on a busy machine: the eight prompts
    # prefill in one step and join the batch together.
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=8, prefill_chunk_seconds=60.0
    ) as engine:
        hold.close()  # the runner takes all eight at one step boundary
        async with trio.open_nursery() as nursery:
            outputs: list[Any] = [None] * 8

            async def one(i: int) -> None:
                outputs[i] = await engine.generate(PROMPTS[i], **sampling)

            for i in range(8):
                nursery.start_soon(one, i)
            await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == 8)
            hold.open()
        stats = engine.get_stats()
        assert [o.tokens for o in outputs] == expected
        assert all(o.finish_reason == "length" for o in outputs)
        assert stats["runner"]["batching"] is True
        assert max(int(size) for size in stats["runner"]["batch_sizes"]) == 8
        slowest = stats["runner"]["slowest_recent_step"]  # phases within the step's time
        assert slowest["seconds"] >= slowest["decode_s"] + slowest["prefill_s"] > 0
        assert slowest["steps_after_join"] in (None, *range(1, 12))  # one join, ten steps after
        assert slowest["rows"] + slowest["prompt_tokens"] > 0 and slowest["mixed_tokens"] == 0
        # every prompt token but each prompt's last went in a step's chunks (the last is fed
        # by the first decode step), the eight prompts in one step with no row decoding yet
        steps = list(engine._runner.counters.recent_steps)
        prompts = sum(o.prompt_tokens - o.cached_tokens for o in outputs)
        assert sum(s.prompt_tokens for s in steps) == prompts - 8
        assert max(s.rows for s in steps) == 8 and steps[0].rows == 0
        await assert_idle(engine)


@pytest.mark.usefixtures("batch_pipeline")
async def test_arrivals_while_a_batch_decodes(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long = {"max_tokens": 30, "temperature": 0.0}
    short = {"max_tokens": 6, "temperature": 0.0}
    expected_long = await alone(tiny_model_dir, PROMPTS[:2], **long)
    expected_short = await alone(tiny_model_dir, PROMPTS[2:5], **short)
    hold = hold_the_runner_intake(monkeypatch)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=5) as engine:
        results: dict[str, Any] = {}

        async def stream(name: str, prompt: str, started: trio.Event | None) -> None:
            tokens: list[int] = []
            async for out in engine.stream_generate(prompt, **long):
                tokens.extend(out.new_tokens)
                if started is not None and len(tokens) >= 3:
                    started.set()
            results[name] = tokens

        async with trio.open_nursery() as nursery:
            first, second = trio.Event(), trio.Event()
            nursery.start_soon(stream, "a", PROMPTS[0], first)
            nursery.start_soon(stream, "b", PROMPTS[1], second)
            await first.wait()
            await second.wait()
            # Both are decoding: three more arrive together (the runner takes them at one step
            # boundary, while the long ones still decode) and join the batch.
            hold.close()
            async with trio.open_nursery() as arrivals:
                for i, prompt in enumerate(PROMPTS[2:5]):
                    arrivals.start_soon(short_one, engine, results, f"s{i}", prompt, short)
                await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == 5)
                hold.open()
        assert [results["a"], results["b"]] == expected_long
        assert [results[f"s{i}"] for i in range(3)] == expected_short
        assert max(int(size) for size in engine.get_stats()["runner"]["batch_sizes"]) >= 3
        await assert_idle(engine)


async def short_one(
    engine: trio_mlx.Engine, results: dict[str, Any], name: str, prompt: str, sampling: Any
) -> None:
    results[name] = (await engine.generate(prompt, **sampling)).tokens


@pytest.mark.usefixtures("batch_pipeline")
async def test_an_abort_and_a_stop_string_mid_batch_leave_the_others_alone(
    tiny_model_dir: Path,
) -> None:
    sampling = {"max_tokens": 24, "temperature": 0.0}
    expected = await alone(tiny_model_dir, PROMPTS[:4], **sampling)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        # The stop string: the text of the third request's tokens 4..6, as generated alone.
        text = engine.tokenizer.decode(expected[2], skip_special_tokens=True)
        reference = engine.tokenizer.decode(expected[2][:4], skip_special_tokens=True)
        stop = text[len(reference) : len(reference) + 5]
        assert stop.strip()
        results: dict[int, Any] = {}

        async def run(i: int) -> None:
            results[i] = await engine.generate(PROMPTS[i], **sampling)

        async def aborted() -> None:
            got: list[int] = []
            async with engine.open_stream(engine.prepare_generate(PROMPTS[1], **sampling)) as out:
                async for part in out:
                    got.extend(part.new_tokens)
                    if len(got) >= 3:
                        break  # the client goes away mid-batch: leaving the block aborts it
            results[1] = got

        async def stopped() -> None:
            results[2] = await engine.generate(PROMPTS[2], stop=stop, **sampling)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 0)
            nursery.start_soon(aborted)
            nursery.start_soon(stopped)
            nursery.start_soon(run, 3)
        assert results[0].tokens == expected[0] and results[3].tokens == expected[3]
        assert results[1] == expected[1][: len(results[1])] and len(results[1]) >= 3
        assert results[2].finish_reason == "stop" and stop not in results[2].text
        assert text.startswith(results[2].text)
        stats = engine.get_stats()
        assert stats["runner"]["aborted"] >= 1
        await assert_idle(engine)


async def test_a_seeded_request_draws_the_same_tokens_whatever_its_companions(
    tiny_model_dir: Path,
) -> None:
    seeded = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        reference = (await engine.generate(PROMPTS[1], **seeded)).tokens
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        outputs: list[Any] = [None] * 4

        async def run(i: int, **sampling: Any) -> None:
            outputs[i] = await engine.generate(PROMPTS[i], **sampling)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial_run(run, 0, max_tokens=12, temperature=0.9, seed=7))
            nursery.start_soon(partial_run(run, 1, **seeded))
            nursery.start_soon(partial_run(run, 2, max_tokens=5, temperature=0.0))
            nursery.start_soon(partial_run(run, 3, max_tokens=12, temperature=1.2))
        assert outputs[1].tokens == reference
        # and again, beside different companions
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial_run(run, 0, max_tokens=3, temperature=0.0))
            nursery.start_soon(partial_run(run, 1, **seeded))
        assert outputs[1].tokens == reference


def partial_run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    async def call() -> None:
        await fn(*args, **kwargs)

    return call


@pytest.mark.usefixtures("batch_pipeline")
async def test_prefix_cache_hits_inside_a_batch_equal_uncached_output(
    tiny_model_dir: Path,
) -> None:
    users = ["What is two plus two?", "Name a colour.", "Say hi.", "Count to three."]
    conversations = [[SYSTEM, {"role": "user", "content": u}] for u in users]
    sampling = {"max_tokens": 8, "temperature": 0.0}
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1, cache_memory_bytes=0) as plain:
        expected = [(await plain.chat(c, **sampling)).tokens for c in conversations]
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        first = await engine.chat(conversations[0], **sampling)  # stores the system prompt
        assert first.tokens == expected[0]
        outputs: list[Any] = [None] * 4

        async def run(i: int) -> None:
            outputs[i] = await engine.chat(conversations[i], **sampling)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(run, i)
        assert [o.tokens for o in outputs] == expected
        assert all(o.cached_tokens > 0 for o in outputs)
        stats = engine.get_cache_stats()
        assert stats["hits"] >= 4 and stats["tokens_saved"] > 0
        await assert_idle(engine)


async def test_a_model_error_fails_only_the_request_it_belongs_to(tiny_model_dir: Path) -> None:
    # A logits processor that raises belongs to one request: only that one fails.
    def broken(tokens: Any, logits: Any) -> Any:
        raise RuntimeError("processor broke")

    sampling = {"max_tokens": 8, "temperature": 0.0}
    expected = await alone(tiny_model_dir, PROMPTS[:2], **sampling)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        bad = engine.prepare_generate(PROMPTS[2], **sampling)
        bad = dataclasses.replace(bad, logits_processors=(broken,))
        outputs: dict[str, Any] = {}

        async def run_bad() -> None:
            async with engine.open_stream(bad) as stream:
                async for out in stream:
                    outputs["bad"] = out

        async def run(i: int) -> None:
            outputs[str(i)] = await engine.generate(PROMPTS[i], **sampling)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 0)
            nursery.start_soon(run_bad)
            nursery.start_soon(run, 1)
        assert outputs["bad"].finish_reason == "error"
        assert "processor broke" in (outputs["bad"].error or "")
        assert [outputs["0"].tokens, outputs["1"].tokens] == expected
        await assert_idle(engine)


async def test_kv_memory_budget_queues_instead_of_crashing(tiny_model_dir: Path) -> None:
    # A budget for about one sequence at its limit: the second waits for the first (wait mode),
    # or is refused at once (fail-fast), although slots are free.
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=4, kv_memory_bytes=1, admission="fail-fast"
    ) as engine:
        async with engine.open_stream(engine.prepare_generate("Hi", max_tokens=40)) as first:
            await first.__anext__()
            try:
                await engine.generate("Hello", max_tokens=4)
            except trio_mlx.EngineBusy as exc:
                assert exc.retry_after is not None and exc.retry_after >= 1
            else:
                raise AssertionError("the KV budget did not refuse the second request")
        stats = engine.get_stats()
        assert stats["memory_waits"] >= 1 and stats["busy_rejections"] >= 1
        assert (await engine.generate("Hello", max_tokens=4)).completion_tokens == 4


async def test_a_long_request_waits_until_the_batch_padded_to_its_width_fits(
    tiny_model_dir: Path,
) -> None:
    """The batch pads every row to its longest: with two short requests running, a long one
    whose own limit fits the budget beside theirs (256 + 256 + 768 of 1,500 positions) would
    make three rows of 768 (2,304), so it waits, a slot free, until it fits (alone), then runs;
    the short ones run to their end undisturbed."""
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=4, kv_memory_bytes=1, admission="wait", max_waiting=4
    ) as engine:
        book = engine._admission.book
        book.account_kv(1500 * book.kv_bytes_per_token, book.kv_bytes_per_token)
        long_prompt = list(range(100, 700))  # 600 tokens: 768 positions with 4 to generate
        results: dict[str, Any] = {}

        async def long_one() -> None:
            results["long"] = await engine.generate(long_prompt, max_tokens=4, temperature=0)

        short = engine.prepare_generate("Hi", max_tokens=20, temperature=0)
        going = trio.Semaphore(0)
        release = trio.Event()

        async def short_one() -> None:
            async with engine.open_stream(short) as stream:
                held = False
                async for out in stream:
                    if not held:  # held at its first output until the long one is seen waiting
                        held = True
                        going.release()
                        await release.wait()
                    if out.finished:
                        results.setdefault("short", []).append(out.completion_tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(short_one)
            nursery.start_soon(short_one)
            await going.acquire()
            await going.acquire()
            nursery.start_soon(long_one)
            await eventually(lambda: engine.get_stats()["waiting"] == 1)
            stats = engine.get_stats()
            assert stats["running"] == 2 and stats["memory_waits"] >= 1
            assert stats["kv_reserved_bytes"] == 2 * 256 * book.kv_bytes_per_token
            assert "long" not in results
            release.set()
        assert results["short"] == [20, 20]
        assert results["long"].completion_tokens == 4
        await assert_idle(engine)


class ForcingProcessor:
    """Forces `token` for its first `lifetime` calls, then retires (records what it was shown)."""

    def __init__(self, token: int, lifetime: int) -> None:
        self.token = token
        self.lifetime = lifetime
        self.lengths: list[int] = []

    @property
    def is_retired(self) -> bool:
        return len(self.lengths) >= self.lifetime

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        assert logits.shape[0] == 1  # its own row of the batch
        self.lengths.append(int(tokens.shape[0]))
        return mx.where(mx.arange(logits.shape[-1]) == self.token, 100.0, logits)


async def test_a_retiring_processor_shapes_only_its_own_row(tiny_model_dir: Path) -> None:
    sampling = {"max_tokens": 10, "temperature": 0.0}
    expected = await alone(tiny_model_dir, PROMPTS[:3], **sampling)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        serial = ForcingProcessor(token=42, lifetime=3)
        request = engine.prepare_generate(PROMPTS[1], **sampling)
        async with engine.open_stream(
            dataclasses.replace(request, logits_processors=(serial,))
        ) as stream:
            forced_alone = [t async for out in stream for t in out.new_tokens]
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        processor = ForcingProcessor(token=42, lifetime=3)
        outputs: dict[int, Any] = {}

        async def forced() -> None:
            request = engine.prepare_generate(PROMPTS[1], **sampling)
            request = dataclasses.replace(request, logits_processors=(processor,))
            async with engine.open_stream(request) as stream:
                outputs[1] = [t async for out in stream for t in out.new_tokens]

        async def run(i: int) -> None:
            outputs[i] = (await engine.generate(PROMPTS[i], **sampling)).tokens

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 0)
            nursery.start_soon(forced)
            nursery.start_soon(run, 2)
        assert outputs[1][:3] == [42, 42, 42] and outputs[1] == forced_alone
        assert processor.lengths == serial.lengths  # shown the same history, then retired
        assert [outputs[0], outputs[2]] == [expected[0], expected[2]]
        await assert_idle(engine)


async def test_a_prefill_failure_fails_only_its_own_request(tiny_model_dir: Path) -> None:
    sampling = {"max_tokens": 8, "temperature": 0.0}
    expected = await alone(tiny_model_dir, [PROMPTS[1], PROMPTS[4]], **sampling)
    loader, _ = wrapping_loader(lambda inner: FaultyModel(inner, poison=31337))
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4, loader=loader) as engine:
        outputs: dict[str, Any] = {}

        async def run(name: str, prompt: Any) -> None:
            async with engine.open_stream(engine.prepare_generate(prompt, **sampling)) as stream:
                async for out in stream:
                    outputs[name] = out

        poisoned = list(engine.prepare_generate(PROMPTS[3]).prompt_tokens)
        poisoned[2] = 31337  # inside the prompt: its prefill raises
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", PROMPTS[1])
            nursery.start_soon(run, "bad", poisoned)
            nursery.start_soon(run, "b", PROMPTS[4])
        assert outputs["bad"].finish_reason == "error" and "poison" in outputs["bad"].error
        assert [outputs["a"].tokens, outputs["b"].tokens] == expected
        assert engine.get_stats()["runner"]["failed"] == 1
        await assert_idle(engine)
        assert (await engine.generate(PROMPTS[0], **sampling)).finish_reason == "length"


class CallCounter:
    """A logits processor that never retires and changes nothing: counts its calls and the
    history length of each."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, tokens: Any, logits: Any) -> Any:
        self.lengths.append(int(tokens.shape[0]))
        return logits


@pytest.mark.usefixtures("batch_pipeline")
@pytest.mark.parametrize("max_num_seqs", [1, 8])
async def test_a_processor_is_called_once_per_token_to_a_length_finish(
    tiny_model_dir: Path, max_num_seqs: int
) -> None:
    """A stateful processor sees exactly one call per token chosen, none for a step after its
    request's last token (a pipelined batch queues the next step before reading the last one:
    a row whose token in flight is its last is chosen without its processors), alone and beside
    a companion that keeps the batch stepping."""
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=max_num_seqs, admission="wait", max_waiting=2
    ) as engine:
        prompt_length = len(engine.prepare_generate(PROMPTS[1]).prompt_tokens)
        for companion in (False, True):
            counter = CallCounter()
            async with trio.open_nursery() as nursery:
                if companion:
                    nursery.start_soon(
                        lambda: engine.generate(PROMPTS[3], max_tokens=24, temperature=0.0)
                    )
                out = await engine.generate(
                    PROMPTS[1], max_tokens=6, temperature=0.0, logits_processors=[counter]
                )
            assert out.finish_reason == "length" and len(out.tokens) == 6
            assert counter.lengths == [prompt_length + i for i in range(6)]
        await assert_idle(engine)
