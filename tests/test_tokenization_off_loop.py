"""Preparing a request never holds the event loop: a text too long for the context is refused
before it is tokenized, and tokenizing (or rendering a chat template) runs on a worker thread, so
another stream keeps receiving its tokens meanwhile."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import trio_mlx
from idle import wait_until_idle
from model_wrappers import GatedTokenizer, tokenizer_loader

FOUR_MIB = 4 * 1024 * 1024


async def test_a_4_mib_prompt_is_refused_without_being_tokenized(tiny_model_dir: Path) -> None:
    loader, made = tokenizer_loader(lambda tok: GatedTokenizer(tok, gate_above=10_000))
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader) as engine:
        huge = "word " * (FOUR_MIB // 5)
        with pytest.raises(trio_mlx.PromptTooLong) as info:
            await engine.prepare_generate_async(huge)
        assert info.value.param == "prompt"
        with pytest.raises(trio_mlx.PromptTooLong) as info:
            await engine.prepare_chat_async([{"role": "user", "content": huge}])
        assert info.value.param == "messages"
        with pytest.raises(trio_mlx.PromptTooLong):
            engine.prepare_generate(huge)  # the synchronous form checks first too
        assert made[0].held_calls == 0  # the tokenizer never saw it


@pytest.mark.parametrize("surface", ["generate", "chat"])
async def test_another_stream_gets_its_tokens_while_a_long_prompt_is_tokenized(
    tiny_model_dir: Path, surface: str
) -> None:
    """The long prompt's tokenization is held at a gate; the other stream must receive tokens
    while it is held (on the event loop, it would stall every stream until the gate timed
    out)."""
    gate_above = 2_000
    loader, made = tokenizer_loader(lambda tok: GatedTokenizer(tok, gate_above=gate_above))
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader) as engine:
        gated: GatedTokenizer = made[0]
        long_text = "many words " * (gate_above // 5)
        tokens_while_held = 0
        started = trio.Event()
        prepared = trio.Event()

        async def tokenize_the_long_prompt() -> None:
            if surface == "generate":
                await engine.prepare_generate_async(long_text, max_tokens=1)
            else:
                await engine.prepare_chat_async([{"role": "user", "content": long_text}])
            prepared.set()

        async def release_after_tokens() -> None:
            nonlocal tokens_while_held
            await trio.to_thread.run_sync(gated.entered.wait, abandon_on_cancel=True)
            seen_at_entry = received
            # Five more tokens of the other stream while the tokenization is held.
            with trio.fail_after(10):
                while received < seen_at_entry + 5:
                    await more.wait()
            tokens_while_held = received - seen_at_entry
            gated.release.set()

        received = 0
        more = trio.Event()
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                stream = engine.stream_generate("Once upon a time", max_tokens=400, temperature=0)
                async for out in stream:
                    received += len(out.new_tokens)
                    more.set()
                    more = trio.Event()
                    if not started.is_set():
                        started.set()
                        nursery.start_soon(tokenize_the_long_prompt)
                        nursery.start_soon(release_after_tokens)
                    if prepared.is_set():
                        await stream.aclose()
                        break
        assert gated.released_by_test is True
        assert tokens_while_held >= 5
        await wait_until_idle(engine)
