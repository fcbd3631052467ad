"""Prefill in whole shape blocks (`prefill_block`): the forward passes start and end on multiples
of the block whatever the prompt's length, the padding leaves no trace in the cache, and the
output is the same token for token as without blocks, with and without prefix-cache hits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trio_mlx
from model_wrappers import RecordingModel, wrapping_loader
from trio_mlx.engine.decode import ActiveSequence, GenerationJob, PrefillPlan
from trio_mlx.types import GenerationOutput, SamplingParams

BLOCK = 16
STEP = 96  # chunks of up to six blocks; a tail of up to 64 tokens rides with the first token
SYSTEM = {"role": "system", "content": "You answer in riddles, briefly and kindly. " * 5}


def test_the_block_is_used_only_where_it_can_be() -> None:
    def block(step: int, tail: int | None, block: int, trimmable: bool = True) -> int:
        return PrefillPlan.choose(step, tail=tail, block=block, trimmable=trimmable).block

    assert block(2048, 64, 64) == 64
    assert block(2048, 64, 64, trimmable=False) == 1  # the padding could not be cut off
    assert block(100, 64, 64) == 1  # does not divide the chunks
    assert block(2048, 64, 128) == 1  # larger than the fused tail
    assert block(2048, None, 16) == 16  # a default tail grows to hold it
    assert PrefillPlan.choose(2048, tail=None, block=16, trimmable=True).tail == 32
    # Here, on the CPU: no block and no fused tail unless asked for.
    assert PrefillPlan.choose(2048, tail=None, block=None, trimmable=True) == PrefillPlan(2048)
    with pytest.raises(ValueError, match="divide"):
        PrefillPlan(100, 64, 64)


def test_a_restored_cache_must_hold_whole_blocks() -> None:
    job = GenerationJob(1, tuple(range(1, 40)), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="multiple"):
        ActiveSequence(
            job,
            None,
            frozenset(),
            PrefillPlan(STEP, BLOCK, BLOCK),
            vocab_size=100,
            cache=[object()],
            cached_tokens=20,
            split_at_store_points=False,
        )


def assert_blocked(calls: list[tuple[int, int]], prompt_lengths: list[int]) -> None:
    """Every forward pass over more than one token is whole blocks from a block boundary, and
    the first decode step of each request finds exactly its prompt in the cache."""
    for before, fed in calls:
        if fed > 1:
            assert before % BLOCK == 0 and fed % BLOCK == 0, (before, fed)
    starts_of_decode = [before for before, fed in calls if fed == 1]
    for length in prompt_lengths:
        assert length in starts_of_decode  # the padding was trimmed off again


async def run_prompts(
    model_dir: Path, prompts: list[str], **config: Any
) -> tuple[list[GenerationOutput], RecordingModel]:
    loader, made = wrapping_loader(RecordingModel)
    async with trio_mlx.open_engine(
        model_dir, prefill_step_size=STEP, loader=loader, **config
    ) as engine:
        outs = [await engine.generate(p, max_tokens=6, temperature=0.0) for p in prompts]
    return outs, made[0]


async def test_blocked_prefill_gives_the_same_tokens_for_any_prompt_length(
    tiny_model_dir: Path,
) -> None:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "owls",
        "watch",
    ]
    prompts = [" ".join(words[: n % len(words) + 1]) * (1 + n) for n in range(0, 24, 3)]
    blocked, recorder = await run_prompts(
        tiny_model_dir, prompts, prefill_block=BLOCK, cache_memory_bytes=0
    )
    plain, plain_recorder = await run_prompts(
        tiny_model_dir, prompts, prefill_block=1, cache_memory_bytes=0
    )
    lengths = [o.prompt_tokens for o in blocked]
    assert len({n % BLOCK for n in lengths}) > 3 and max(lengths) > 2 * STEP
    assert [o.tokens for o in blocked] == [o.tokens for o in plain]
    assert_blocked(recorder.calls, lengths)
    # Without blocks the same prompts do give ragged shapes (what the blocks are for).
    assert any(fed > 1 and fed % BLOCK for _, fed in plain_recorder.calls)


async def test_cache_hits_start_on_a_block_and_change_nothing(tiny_model_dir: Path) -> None:
    users = ["Where do rivers sleep?", "What has keys but no locks?", "Tell me more, please."]

    async def chats(**config: Any) -> tuple[list[GenerationOutput], RecordingModel]:
        loader, made = wrapping_loader(RecordingModel)
        async with trio_mlx.open_engine(
            tiny_model_dir, prefill_step_size=STEP, loader=loader, **config
        ) as engine:
            outs = []
            messages: list[dict[str, str]] = [SYSTEM]
            for text in users:  # a conversation: each turn extends the previous one
                messages = [*messages, {"role": "user", "content": text}]
                out = await engine.chat(messages, max_tokens=5, temperature=0.0)
                outs.append(out)
                messages = [*messages, {"role": "assistant", "content": out.text}]
        return outs, made[0]

    cached, recorder = await chats(prefill_block=BLOCK)
    plain, _ = await chats(prefill_block=1, cache_memory_bytes=0)
    assert [o.tokens for o in cached] == [o.tokens for o in plain]
    assert all(o.cached_tokens > 0 for o in cached[1:])
    assert all(o.cached_tokens % BLOCK == 0 for o in cached)
    assert_blocked(recorder.calls, [o.prompt_tokens for o in cached])
