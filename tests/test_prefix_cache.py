"""The prefix KV cache through the real engine on the tiny random model.

Every scenario runs twice, on an engine with the cache and on one without (`cache_memory_bytes=0`),
and the outputs must be equal token for token (greedy, or seeded sampling); the cached run must
also show that it really reused what it should (`GenerationOutput.cached_tokens`, the stats).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from mlx_lm.models.cache import KVCache

import trio_mlx
from idle import wait_until_idle
from model_wrappers import PausingModel, _Wrapped, wrapping_loader
from trio_mlx.actors import snapshot_keeper
from trio_mlx.actors.kv_cache_manager import MIN_DEFAULT_BUDGET, KVCacheManager
from trio_mlx.actors.stream import TokenSink
from trio_mlx.engine import kv_snapshots
from trio_mlx.types import GenerationOutput

SYSTEM = {
    "role": "system",
    "content": "You are a meticulous assistant. Answer briefly, cite nothing, and stay polite. "
    * 6,
}
USERS = ["What is the capital of France?", "Name three prime numbers.", "Hello!"]

Script = Callable[[trio_mlx.Engine], Awaitable[list[GenerationOutput]]]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


async def on_both(
    model_dir: Path, script: Script, **config: Any
) -> tuple[list[GenerationOutput], list[GenerationOutput], dict[str, Any]]:
    """Run `script` on a cached engine, then on an uncached one with the same `config`.
    Returns both runs' outputs and the cached engine's cache stats."""
    async with trio_mlx.open_engine(model_dir, **config) as engine:
        cached = await script(engine)
        stats = engine.get_cache_stats()
    async with trio_mlx.open_engine(model_dir, **{**config, "cache_memory_bytes": 0}) as engine:
        plain = await script(engine)
        assert engine.get_cache_stats()["enabled"] is False
    assert all(out.cached_tokens == 0 for out in plain)
    return cached, plain, stats


def assert_same_outputs(cached: list[GenerationOutput], plain: list[GenerationOutput]) -> None:
    assert [o.tokens for o in cached] == [o.tokens for o in plain]
    assert [o.text for o in cached] == [o.text for o in plain]
    assert [o.finish_reason for o in cached] == [o.finish_reason for o in plain]


# ---- equality: cached == uncached --------------------------------------------------------------


async def test_a_shared_system_prompt_with_different_users(tiny_model_dir: Path) -> None:
    boundaries: list[int] = []

    async def script(engine: trio_mlx.Engine) -> list[GenerationOutput]:
        outs = []
        for text in USERS:
            request = engine.prepare_chat([SYSTEM, user(text)], max_tokens=16, temperature=0.0)
            if request.system_prefix is not None:  # computed when the cache is on
                boundaries.append(request.system_prefix)
            outs.append(await engine.chat([SYSTEM, user(text)], max_tokens=16, temperature=0.0))
        return outs

    cached, plain, stats = await on_both(tiny_model_dir, script)
    assert_same_outputs(cached, plain)
    boundary = boundaries[0]
    assert boundary > 50 and boundaries == [boundary] * 3
    assert cached[0].cached_tokens == 0
    assert all(o.cached_tokens >= boundary for o in cached[1:])
    # The system-prompt entry served as long as no longer entry (which it prefixes) replaced it.
    assert stats["hits"] == 2 and stats["misses"] == 1


async def test_a_multi_turn_conversation_reuses_the_previous_turn(tiny_model_dir: Path) -> None:
    async def script(engine: trio_mlx.Engine) -> list[GenerationOutput]:
        messages = [SYSTEM, user("Tell me a story about a fox.")]
        outs = []
        for turn in range(3):
            out = await engine.chat(messages, max_tokens=12, temperature=0.0)
            outs.append(out)
            messages = [*messages, assistant(out.text), user(f"And then, part {turn + 2}?")]
        return outs

    cached, plain, stats = await on_both(tiny_model_dir, script)
    assert_same_outputs(cached, plain)
    # Each later turn starts from the previous turn's final snapshot (its prompt and more).
    assert cached[1].cached_tokens > cached[0].prompt_tokens
    assert cached[2].cached_tokens > cached[1].prompt_tokens
    assert stats["entries_by_kind"].get("conversation", 0) >= 1


async def test_a_retried_request_prefills_only_its_last_token(tiny_model_dir: Path) -> None:
    prompt = "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole"

    async def script(engine: trio_mlx.Engine) -> list[GenerationOutput]:
        messages = [SYSTEM, user(USERS[0])]
        return [
            await engine.chat(messages, max_tokens=10, temperature=0.0),
            await engine.chat(messages, max_tokens=10, temperature=0.0),
            await engine.generate(prompt, max_tokens=10, temperature=0.0),
            await engine.generate(prompt, max_tokens=10, temperature=0.0),
        ]

    cached, plain, stats = await on_both(tiny_model_dir, script)
    assert_same_outputs(cached, plain)
    assert cached[1].cached_tokens == cached[1].prompt_tokens - 1
    assert cached[3].cached_tokens == cached[3].prompt_tokens - 1
    assert stats["refreshes"] >= 1  # the retry's final snapshot was already cached


async def test_after_evictions_under_a_tiny_budget(tiny_model_dir: Path) -> None:
    # The tiny model's snapshots take 512 bytes per token: this budget holds about one
    # conversation, so every store evicts and hits find their entries gone or trimmed.
    async def script(engine: trio_mlx.Engine) -> list[GenerationOutput]:
        outs = []
        for text in [*USERS, USERS[0], USERS[1]]:
            outs.append(await engine.chat([SYSTEM, user(text)], max_tokens=14, temperature=0.0))
        outs.append(await engine.generate("Once upon a time", max_tokens=14, temperature=0.0))
        outs.append(await engine.chat([SYSTEM, user(USERS[2])], max_tokens=14, temperature=0.0))
        return outs

    cached, plain, stats = await on_both(tiny_model_dir, script, cache_memory_bytes=80_000)
    assert_same_outputs(cached, plain)
    assert stats["evictions"] > 0
    assert stats["bytes"] <= 80_000
    assert stats["entries"] == stats["snapshots_held"]
    assert stats["hits"] > 0


async def test_stop_strings_and_seeded_sampling_options(tiny_model_dir: Path) -> None:
    options: dict[str, Any] = {
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.01,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.2,
        "logit_bias": {"260": 3.0},
        "logprobs": True,
        "top_logprobs": 3,
    }

    async def script(engine: trio_mlx.Engine) -> list[GenerationOutput]:
        messages = [SYSTEM, user("Spell some words.")]
        outs = []
        for turn in range(3):
            out = await engine.chat(
                messages, max_tokens=40, stop=["e", "a"], seed=11 + turn, **options
            )
            outs.append(out)
            messages = [*messages, assistant(out.text), user("More.")]
        # A retry of the last request, and the seeded request without stop strings.
        outs.append(await engine.chat(messages[:-2], max_tokens=40, stop=["e", "a"], seed=13))
        outs.append(await engine.chat(messages[:2], max_tokens=20, seed=5, **options))
        return outs

    cached, plain, stats = await on_both(tiny_model_dir, script)
    assert_same_outputs(cached, plain)
    assert any(o.finish_reason == "stop" and o.completion_tokens < 40 for o in cached[:3])
    assert all(o.cached_tokens > 0 for o in cached[1:])
    for a, b in zip(cached, plain, strict=True):
        if a.logprobs is not None:
            assert b.logprobs is not None
            np.testing.assert_allclose(
                [lp.logprob for lp in a.logprobs], [lp.logprob for lp in b.logprobs], atol=1e-4
            )
            assert [[t for t, _ in lp.top] for lp in a.logprobs] == [
                [t for t, _ in lp.top] for lp in b.logprobs
            ]
    # A request ended by a stop string (an abort on the runner) still left its conversation.
    assert stats["entries_by_kind"].get("conversation", 0) >= 1


# ---- cancellation, stats, clearing --------------------------------------------------------------


async def test_cancelling_mid_prefill_leaves_no_entry_for_the_unfinished_prompt(
    tiny_model_dir: Path,
) -> None:
    loader, made = wrapping_loader(PausingModel)
    messages = [SYSTEM, user("Please summarise: " + "the cat sat on the mat. " * 60)]
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader, prefill_step_size=8) as engine:
        model = made[0]
        request = engine.prepare_chat(messages, max_tokens=8, temperature=0.0)
        boundary = request.system_prefix
        assert boundary is not None
        assert len(request.prompt_tokens) > boundary + 100
        model.pause_at = boundary + 40
        with trio.fail_after(10):
            async with engine.open_stream(request):
                while not model.paused.is_set():  # noqa: ASYNC110
                    await trio.sleep(0.001)
            # Cancelled with a prefill chunk in flight: it completes, then the runner drops it.
            model.resume.set()
        await wait_until_idle(engine)
        stats = engine.get_cache_stats()
        assert engine.get_stats()["runner"]["aborted"] == 1
        # Only the complete system prompt was stored; nothing for the half-prefilled prompt.
        assert stats["entries_by_kind"] == {"system": 1}
        assert stats["stores"] == 1 and stats["entries"] == 1 == stats["snapshots_held"]
        assert stats["bytes"] == boundary * 512
        model.pause_at = None
        again = await engine.chat(messages, max_tokens=8, temperature=0.0)
        assert again.cached_tokens == boundary
    async with trio_mlx.open_engine(tiny_model_dir, cache_memory_bytes=0) as plain_engine:
        plain = await plain_engine.chat(messages, max_tokens=8, temperature=0.0)
    assert again.tokens == plain.tokens


async def test_the_system_prompt_is_stored_without_splitting_the_prefill(
    tiny_model_dir: Path,
) -> None:
    # KVCache can be cut afterwards: the prefill runs past the system-prompt boundary in one
    # chunk (no extra forward pass), and the boundary's snapshot is cut from it. The short tail
    # of the next request rides with its first token, as on a GPU (`fused_tail_tokens`).
    # Chunks cut by the plan alone, not by a pace measured on a busy machine.
    async with trio_mlx.open_engine(
        tiny_model_dir, fused_tail_tokens=64, prefill_chunk_seconds=60.0, max_num_seqs=1
    ) as engine:
        request = engine.prepare_chat([SYSTEM, user(USERS[0])], max_tokens=4, temperature=0.0)
        assert request.system_prefix is not None
        await engine.chat([SYSTEM, user(USERS[0])], max_tokens=4, temperature=0.0)
        assert engine.get_stats()["runner"]["prefill_chunks"] == 1
        stats = engine.get_cache_stats()
        assert stats["stores"] == 2  # the system prompt, then the conversation
        other = await engine.chat([SYSTEM, user(USERS[1])], max_tokens=4, temperature=0.0)
        assert other.cached_tokens >= request.system_prefix
        # Its short new tail went through the model with the first token: no prefill chunk.
        assert len(other.tokens) == 4 and other.prompt_tokens - other.cached_tokens > 1
        assert engine.get_stats()["runner"]["prefill_chunks"] == 1


async def test_a_short_chat_stores_its_system_prompt_from_the_first_token_step(
    tiny_model_dir: Path,
) -> None:
    system = {"role": "system", "content": "Be brief."}
    # Chunks cut by the plan alone, not by a pace measured on a busy machine.
    async with trio_mlx.open_engine(
        tiny_model_dir, fused_tail_tokens=64, prefill_chunk_seconds=60.0, max_num_seqs=1
    ) as engine:
        request = engine.prepare_chat([system, user("Hi")], max_tokens=3, temperature=0.0)
        assert request.system_prefix is not None and len(request.prompt_tokens) <= 64
        await engine.chat([system, user("Hi")], max_tokens=3, temperature=0.0)
        assert engine.get_stats()["runner"]["prefill_chunks"] == 0
        assert engine.get_cache_stats()["stores"] == 2  # the system prompt, the conversation
        other = await engine.chat([system, user("Hello there")], max_tokens=3, temperature=0.0)
    assert other.cached_tokens >= request.system_prefix
    async with trio_mlx.open_engine(tiny_model_dir, cache_memory_bytes=0) as plain_engine:
        plain = await plain_engine.chat(
            [system, user("Hello there")], max_tokens=3, temperature=0.0
        )
    assert other.tokens == plain.tokens


async def test_the_first_token_is_handed_over_before_the_system_prompt_is_snapshotted(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The system prompt's snapshot is taken in the first token's step (a short chat, as on a
    # GPU): the token must be handed to Trio first (on a GPU, waiting for the snapshot would
    # cost a decode step). The conversation's entry is in the book before the request ends.
    # The runner never waits for Trio, so when Trio runs what it was handed is up to the OS:
    # before logging a store, the runner thread waits until Trio has run everything handed
    # over before it (`run_sync_soon` runs callbacks in the order they came), so the log's
    # order is the order in which the runner handed tokens over and took snapshots.
    log: list[str] = []
    push, stored = TokenSink.push, KVCacheManager.stored
    trio_token = trio.lowlevel.current_trio_token()

    def logged_push(self: TokenSink, tokens: Any = (), finish: Any = None, *a: Any) -> bool:
        log.extend(["token"] * len(tokens) + ([f"finish:{finish}"] if finish else []))
        return push(self, tokens, finish, *a)

    def logged_stored(self: KVCacheManager, tokens: Any, nbytes: int, kind: Any, *a: Any) -> Any:
        caught_up = threading.Event()
        trio_token.run_sync_soon(caught_up.set)
        assert caught_up.wait(timeout=30), "Trio did not run what the runner handed over"
        log.append(f"stored:{kind}")
        return stored(self, tokens, nbytes, kind, *a)

    monkeypatch.setattr(TokenSink, "push", logged_push)
    monkeypatch.setattr(KVCacheManager, "stored", logged_stored)
    system = {"role": "system", "content": "Be brief."}
    # Chunks cut by the plan alone, not by a pace measured on a busy machine.
    async with trio_mlx.open_engine(
        tiny_model_dir, fused_tail_tokens=64, prefill_chunk_seconds=60.0, max_num_seqs=1
    ) as engine:
        out = await engine.chat([system, user("Hi")], max_tokens=3, temperature=0.0)
    assert out.finish_reason == "length" and len(out.tokens) == 3
    assert log == [
        "token",
        "stored:system",
        "token",
        "stored:conversation",
        "token",  # the last token comes with the finish
        "finish:length",
    ]


async def test_stats_counters_and_clear_runtime_caches(engine: trio_mlx.Engine) -> None:
    stats = engine.get_cache_stats()
    assert stats["enabled"] and stats["supported"]
    assert stats["cache_types"] == {"KVCache": 2}
    assert stats["budget_bytes"] == MIN_DEFAULT_BUDGET and stats["budget_source"] == "default"
    assert (stats["entries"], stats["hits"], stats["misses"], stats["stores"]) == (0, 0, 0, 0)

    messages = [SYSTEM, user(USERS[0])]
    first = await engine.chat(messages, max_tokens=6, temperature=0.0)
    stats = engine.get_cache_stats()
    # Two stores (system prompt, then the whole conversation, which supersedes the first).
    assert (stats["hits"], stats["misses"], stats["stores"], stats["superseded"]) == (0, 1, 2, 1)
    assert stats["entries_by_kind"] == {"conversation": 1}
    assert stats["hit_ratio"] == 0.0
    # 512 bytes per token of the prompt + completion (the last token of a max_tokens finish
    # never went through the model; an EOS did).
    extra = -1 if first.finish_reason == "length" else 1
    fed = first.prompt_tokens + first.completion_tokens + extra
    assert stats["bytes"] == 512 * fed
    assert engine.get_stats()["runner"]["prompt_tokens"] == first.prompt_tokens

    second = await engine.chat(messages, max_tokens=6, temperature=0.0)
    stats = engine.get_cache_stats()
    assert second.cached_tokens == second.prompt_tokens - 1
    assert (stats["hits"], stats["misses"], stats["refreshes"]) == (1, 1, 1)
    assert stats["tokens_saved"] == second.cached_tokens and stats["hit_ratio"] == 0.5
    assert stats["restores"] == 1
    assert engine.get_stats()["cache"]["hits"] == 1
    json.dumps(engine.get_stats())

    held = stats["bytes"]
    freed = await engine.clear_runtime_caches()
    assert freed == {"entries": 1, "bytes": held, "snapshots": 1, "snapshot_bytes": held}
    stats = engine.get_cache_stats()
    assert (stats["entries"], stats["bytes"], stats["snapshots_held"]) == (0, 0, 0)
    assert stats["hits"] == 1  # counters are kept
    third = await engine.chat(messages, max_tokens=6, temperature=0.0)
    assert third.cached_tokens == 0 and third.tokens == first.tokens
    assert engine.get_cache_stats()["misses"] == 2


async def test_a_zero_budget_disables_the_cache(tiny_model_dir: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, cache_memory_bytes=0) as engine:
        for _ in range(2):
            out = await engine.chat([SYSTEM, user(USERS[0])], max_tokens=4, temperature=0.0)
            assert out.cached_tokens == 0
        stats = engine.get_cache_stats()
        assert not stats["enabled"] and stats["supported"]
        assert (stats["entries"], stats["hits"], stats["misses"], stats["stores"]) == (0, 0, 0, 0)
        assert stats["snapshots_taken"] == 0
        assert await engine.clear_runtime_caches() == {
            "entries": 0,
            "bytes": 0,
            "snapshots": 0,
            "snapshot_bytes": 0,
        }


class _OwnKVCache(KVCache):
    """Behaves like `KVCache`, but is a class the snapshot code does not know."""


class _UnknownCacheModel(_Wrapped):
    def make_cache(self) -> list[Any]:
        return [_OwnKVCache() for _ in self._inner.layers]

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        return self._inner(tokens, cache=cache)


async def test_a_cache_type_that_cannot_be_snapshotted_runs_uncached(tiny_model_dir: Path) -> None:
    loader, _ = wrapping_loader(_UnknownCacheModel)

    async def script(engine: trio_mlx.Engine) -> list[GenerationOutput]:
        return [
            await engine.chat([SYSTEM, user(text)], max_tokens=8, temperature=0.0)
            for text in (USERS[0], USERS[0])
        ]

    async with trio_mlx.open_engine(tiny_model_dir, loader=loader) as engine:
        outs = await script(engine)
        stats = engine.get_cache_stats()
    assert not stats["enabled"] and not stats["supported"]
    assert stats["cache_types"] == {"_OwnKVCache": 2}
    assert "_OwnKVCache" in stats["support_reason"]
    assert stats["snapshots_taken"] == 0 and all(o.cached_tokens == 0 for o in outs)
    async with trio_mlx.open_engine(tiny_model_dir, cache_memory_bytes=0) as engine:
        assert [o.tokens for o in await script(engine)] == [o.tokens for o in outs]


async def test_a_hit_that_cannot_be_restored_falls_back_to_a_full_prefill(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_restore = kv_snapshots.restore
    failures = [1]

    def failing_once(snap: Any, length: int | None = None) -> list[Any]:
        if failures:
            failures.pop()
            raise RuntimeError("injected restore failure")
        return real_restore(snap, length)

    monkeypatch.setattr(snapshot_keeper, "restore", failing_once)

    async def script(engine: trio_mlx.Engine) -> list[GenerationOutput]:
        return [
            await engine.chat([SYSTEM, user(text)], max_tokens=8, temperature=0.0)
            for text in (USERS[0], USERS[1], USERS[2])
        ]

    cached, plain, stats = await on_both(tiny_model_dir, script)
    assert_same_outputs(cached, plain)
    assert [o.cached_tokens > 0 for o in cached] == [False, False, True]
    assert stats["restore_failures"] == 1 and stats["entries"] == stats["snapshots_held"]


def test_cache_memory_bytes_is_validated() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="cache_memory_bytes"):
            trio_mlx.EngineConfig(cache_memory_bytes=bad)  # type: ignore[arg-type]
    assert (
        dataclasses.replace(trio_mlx.EngineConfig(), cache_memory_bytes=0).cache_memory_bytes == 0
    )
