"""A Messages client that goes away — mid-stream, mid-generation of a whole answer — aborts its
generation at the next step boundary and frees its slot; in a batch, the requests beside it
answer exactly as they would alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import trio

from idle import wait_until_idle
from servers import eventually, running_server
from trio_mlx.http.server import RunningServer

LONG: Any = {
    "model": "tiny",
    "max_tokens": 900,
    "messages": [{"role": "user", "content": "Count forever."}],
    "extra_body": {"temperature": 0},
}


def claude_for(server: RunningServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=30
    )


async def test_leaving_a_stream_aborts_the_generation_and_frees_the_slot(
    server: RunningServer,
) -> None:
    engine = server.state.engine
    assert engine is not None
    before = engine.get_stats()["runner"]
    async with claude_for(server) as claude:
        async with claude.messages.stream(**LONG) as stream:
            seen = 0
            async for _text in stream.text_stream:
                seen += 1
                if seen == 3:
                    break  # leaving the block closes the response: the client is gone
        stats = await wait_until_idle(engine)
        assert stats["runner"]["aborted"] == before["aborted"] + 1
        assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < 900
        # The slot is free: the next request is admitted and served at once.
        with trio.fail_after(10):
            after = await claude.messages.create(**{**LONG, "max_tokens": 3})
        assert after.usage.output_tokens == 3 and after.stop_reason == "max_tokens"


async def test_leaving_before_a_whole_answer_aborts_it(server: RunningServer) -> None:
    engine = server.state.engine
    assert engine is not None
    before = engine.get_stats()["runner"]

    def decoding() -> bool:
        return bool(engine.get_stats()["runner"]["generated_tokens"] > before["generated_tokens"])

    async with claude_for(server) as claude:

        async def go_away(scope: trio.CancelScope) -> None:
            await eventually(decoding)
            scope.cancel()

        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:
                nursery.start_soon(go_away, scope)
                await claude.messages.create(**LONG)
        assert scope.cancelled_caught
        stats = await wait_until_idle(engine)
        assert stats["runner"]["aborted"] == before["aborted"] + 1
        assert stats["runner"]["generated_tokens"] - before["generated_tokens"] < 900


async def test_an_abort_in_a_batch_leaves_its_companions_answers_unchanged(
    tiny_model_dir: Path,
) -> None:
    companions = [
        {**LONG, "max_tokens": 160, "messages": [{"role": "user", "content": text}]}
        for text in ("Tell me about the sea.", "Name three colours.")
    ]
    async with (
        running_server(
            tiny_model_dir,
            served_model_names=("tiny",),
            max_num_seqs=4,
            admission="wait",
            max_waiting=8,
        ) as server,
        claude_for(server) as claude,
    ):
        engine = server.state.engine
        assert engine is not None
        alone = [(await claude.messages.create(**ask)).content[0] for ask in companions]
        answers: dict[int, Any] = {}

        async def companion(i: int) -> None:
            answers[i] = (await claude.messages.create(**companions[i])).content[0]

        async with trio.open_nursery() as nursery:
            async with claude.messages.stream(**LONG) as victim:
                async for _text in victim.text_stream:
                    break  # the victim is decoding
                for i in range(len(companions)):
                    nursery.start_soon(companion, i)
                # All three decode in one batch (the runner's view, not admission's); then the
                # victim's client goes away.
                await eventually(lambda: engine.get_stats()["runner"]["decoding"] == 3, 30)
        assert answers == dict(enumerate(alone))
        stats = await wait_until_idle(engine)
        assert stats["runner"]["aborted"] >= 1
        assert max(int(size) for size in stats["runner"]["batch_sizes"]) >= 2
