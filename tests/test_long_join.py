"""A prompt of several prefill chunks arriving while rows decode joins the batch one step after
its last chunk (`BatchDecoder.join`'s `defer_long`): its tokens and its companions' stay each
one's alone, and an abort while it waits to join leaves nothing behind."""

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
from trio_mlx.engine import scheduling
from trio_mlx.engine.batch import BatchDecoder

SHORT = ["Hello there", "Tell me about the sea", "Why is the sky blue?"]
#: chunks of at most this many prompt tokens: the long prompt takes several
STEP = 16


def no_eos(eos_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy, EOS banned: a row decodes all its `max_tokens`."""
    return {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logit_bias": {token: -100.0 for token in eos_ids},
    }


def long_prompt() -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(100, 40_000) for _ in range(8 * STEP + 5)]


async def alone(model_dir: Path, prompts: list[Any], params: list[dict[str, Any]]) -> list[Any]:
    async with trio_mlx.open_engine(model_dir, max_num_seqs=1) as engine:
        pairs = zip(prompts, params, strict=True)
        return [(await engine.generate(p, **k)).tokens for p, k in pairs]


def eos_ids(model_dir: Path) -> list[int]:
    from trio_mlx.engine.loading import load_model

    return sorted(load_model(model_dir).eos_token_ids)


@pytest.fixture(autouse=True)
def whole_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of `STEP` tokens while rows decode (the tiny model's decode step is a few ms on
    this CPU, and a chunk held to two of them could take a token or two: the short rows would
    be done before the long prompt is in)."""
    monkeypatch.setattr(scheduling, "DEFAULT_DECODE_SHARE", 1000.0)


@pytest.mark.usefixtures("batch_pipeline")
async def test_a_long_prompt_joins_a_step_after_its_last_chunk_with_its_tokens_alone(
    tiny_model_dir: Path,
) -> None:
    eos = eos_ids(tiny_model_dir)
    short, long = no_eos(eos, 40), no_eos(eos, 12)
    prompts = [*SHORT, long_prompt()]
    expected = await alone(tiny_model_dir, prompts, [short] * 3 + [long])
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=4, prefill_step_size=STEP
    ) as engine:
        results: dict[int, list[int]] = {}
        decoding = trio.Event()

        async def stream(i: int) -> None:
            tokens: list[int] = []
            async for out in engine.stream_generate(prompts[i], **(long if i == 3 else short)):
                tokens.extend(out.new_tokens)
                if len(tokens) >= 2 and i == 0:
                    decoding.set()
            results[i] = tokens

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(stream, i)
            await decoding.wait()
            nursery.start_soon(stream, 3)  # arrives while the short rows decode
        assert [results[i] for i in range(4)] == expected
        runner = engine.get_stats()["runner"]
        assert runner["deferred_joins"] == 1  # the long one; the short ones joined at once
        await assert_idle(engine)


async def test_an_abort_while_a_long_prompt_waits_to_join_leaves_the_others_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eos = eos_ids(tiny_model_dir)
    short = no_eos(eos, 60)
    expected = await alone(tiny_model_dir, SHORT, [short] * 3)
    hold = hold_the_runner_intake(monkeypatch)
    deferred = threading.Event()
    join = BatchDecoder.join

    def held_after_deferring(self: BatchDecoder, *, defer_long: bool = False) -> int:
        before = self.deferred_joins
        joined = join(self, defer_long=defer_long)
        if self.deferred_joins > before:  # the runner waits at its next step's intake
            hold.close()
            deferred.set()
        return joined

    monkeypatch.setattr(BatchDecoder, "join", held_after_deferring)
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=4, prefill_step_size=STEP
    ) as engine:
        results: dict[int, list[int]] = {}
        decoding = trio.Event()
        long_tokens: list[int] = []

        async def stream(i: int) -> None:
            tokens: list[int] = []
            async for out in engine.stream_generate(SHORT[i], **short):
                tokens.extend(out.new_tokens)
                if len(tokens) >= 2 and i == 0:
                    decoding.set()
            results[i] = tokens

        async def long(scope: trio.CancelScope) -> None:
            with scope:
                async for out in engine.stream_generate(long_prompt(), **no_eos(eos, 12)):
                    long_tokens.extend(out.new_tokens)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(stream, i)
            await decoding.wait()
            scope = trio.CancelScope()
            nursery.start_soon(long, scope)
            await eventually(deferred.is_set)
            await eventually(hold.held.is_set)  # ready, not joined, the runner held
            scope.cancel()  # the client goes away
            await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == 3)
            hold.open()
        assert long_tokens == []
        assert [results[i] for i in range(3)] == expected
        runner = engine.get_stats()["runner"]
        assert runner["deferred_joins"] == 1 and runner["aborted"] >= 1
        await assert_idle(engine)
