"""A burst of requests on its way in: preparations run back to back on the preparation worker and
the requests enter admission in arrival order; a caller gone while its request is prepared or
queued for preparation leaves nothing behind; and on an idle batch the first arrivals wait,
prefilled, for the requests still on their way (`Engine.arriving`) before they decode, for at
most `batch_loop.BURST_HOLD_SECONDS`."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

import trio_mlx
from idle import wait_until_idle
from model_wrappers import GatedTokenizer, tokenizer_loader
from servers import eventually
from trio_mlx.actors import batch_loop

PROMPT = "In a hole in the ground there lived a hobbit."
GATE_ABOVE = 2_000
LONG = "many words " * (GATE_ABOVE // 5)  # held at the tokenizer's gate


async def test_requests_prepared_together_enter_admission_in_arrival_order(
    tiny_model_dir: Path,
) -> None:
    """Six requests queue for preparation behind a seventh held at the tokenizer; let go, the
    worker prepares them back to back and their results reach Trio together, yet they enter
    admission (one slot, held: they queue for it) in the order they arrived, and are served
    in that order."""
    loader, made = tokenizer_loader(lambda tok: GatedTokenizer(tok, gate_above=GATE_ABOVE))
    async with trio_mlx.open_engine(
        tiny_model_dir, loader=loader, max_num_seqs=1, admission="wait", max_waiting=16
    ) as engine:
        gated: GatedTokenizer = made[0]
        holder = await engine.start_request(engine.prepare_generate(PROMPT, max_tokens=2))
        served: list[str] = []

        async def arrive(name: str, prompt: str) -> None:
            active = await engine.start_generate(prompt, max_tokens=1, temperature=0.0)
            served.append(name)
            try:
                async for _ in active.stream:
                    pass
            finally:
                active.close()

        names = list("abcdefg")
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(arrive, names[0], LONG)
                await trio.to_thread.run_sync(gated.entered.wait, abandon_on_cancel=True)
                for name in names[1:]:
                    nursery.start_soon(arrive, name, f"{name} is short")
                    await trio.testing.wait_all_tasks_blocked()
                stats = engine.get_stats()
                assert stats["preparing"] == len(names) - 1
                assert stats["runner"]["arriving"] == len(names)
                gated.release.set()
                await eventually(lambda: engine.get_stats()["waiting"] == len(names))
                holder.close()
        assert served == names
        assert gated.released_by_test is True
        await wait_until_idle(engine)


async def test_a_request_gone_while_it_is_prepared_or_queued_leaves_nothing(
    tiny_model_dir: Path,
) -> None:
    """One caller goes while its prompt is being tokenized, another while it waits for the
    worker: the first's tokenization finishes and is dropped, the second's never runs; nothing
    is admitted, nothing is left noted as on its way, and the engine serves on."""
    loader, made = tokenizer_loader(lambda tok: GatedTokenizer(tok, gate_above=GATE_ABOVE))
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader, max_num_seqs=4) as engine:
        gated: GatedTokenizer = made[0]
        scopes = {"tokenizing": trio.CancelScope(), "queued": trio.CancelScope()}

        async def arrive(name: str, prompt: str) -> None:
            with scopes[name]:
                active = await engine.start_generate(prompt, max_tokens=2)
                active.close()
                raise AssertionError(f"{name} was admitted")

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(arrive, "tokenizing", LONG)
                await trio.to_thread.run_sync(gated.entered.wait, abandon_on_cancel=True)
                nursery.start_soon(arrive, "queued", PROMPT)
                await trio.testing.wait_all_tasks_blocked()
                assert engine.get_stats()["preparing"] == 1
                scopes["queued"].cancel()
                scopes["tokenizing"].cancel()
                await trio.testing.wait_all_tasks_blocked()
                stats = engine.get_stats()
                assert (stats["preparing"], stats["runner"]["arriving"]) == (0, 0)
                gated.release.set()
            await eventually(lambda: engine._preparing.completed == 1)
        stats = await wait_until_idle(engine)
        assert stats["admitted"] == 0
        assert stats["runner"]["started"] == 0
        assert engine._preparing.completed == 1  # the queued one was never prepared
        assert (await engine.generate(PROMPT, max_tokens=2)).completion_tokens == 2


async def test_the_first_arrival_of_a_burst_waits_prefilled_for_the_rest(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another request is on its way, a lone arrival on an idle batch is prefilled but
    does not decode; once the other has arrived (here: given up), it decodes at once."""
    monkeypatch.setattr(batch_loop, "BURST_HOLD_SECONDS", 60.0)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        on_its_way = engine.arriving()
        received: list[int] = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def consume() -> None:
                    async for out in engine.stream_generate(PROMPT, max_tokens=3, temperature=0):
                        received.extend(out.new_tokens)

                nursery.start_soon(consume)
                # Held: prefilled (all of its prompt but the last token), not decoding.
                prefilled = len(engine.prepare_generate(PROMPT).prompt_tokens) - 1
                await eventually(lambda: engine.get_stats()["runner"]["prompt_tokens"] == prefilled)
                await trio.sleep(0.3)
                stats = engine.get_stats()["runner"]
                assert (stats["burst_holds"], stats["decoding"], stats["prefilling"]) == (1, 0, 1)
                assert (stats["decode_steps"], stats["arriving"]) == (0, 1)
                assert received == []
                on_its_way.done()
        assert len(received) == 3
        stats = await wait_until_idle(engine)
        assert stats["runner"]["burst_holds"] == 1
        assert stats["runner"]["burst_hold_s"] > 0.2


async def test_a_hold_is_bounded_and_a_lone_request_is_not_held(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_loop, "BURST_HOLD_SECONDS", 0.2)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        # Nothing else on its way: its own arrival ends at admission, before the runner has it.
        out = await engine.generate(PROMPT, max_tokens=2, temperature=0)
        assert out.completion_tokens == 2
        assert engine.get_stats()["runner"]["burst_holds"] == 0
        # A request that never comes holds the next arrival for BURST_HOLD_SECONDS at most.
        never = engine.arriving()
        with trio.fail_after(20):
            out = await engine.generate(PROMPT, max_tokens=2, temperature=0)
        assert out.completion_tokens == 2
        stats = engine.get_stats()["runner"]
        assert stats["burst_holds"] == 1
        assert 0 < stats["burst_hold_s"] < 10
        never.done()
        never.done()  # idempotent
        assert engine.get_stats()["runner"]["arriving"] == 0
