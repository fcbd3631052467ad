"""One request with an image on the batched route, alone, on the GPU's prefill plan (a prompt
fused with its first token's pass, `fused_tail_tokens` 1,024) and both ways the batch steps
(pipelined or read at once): it takes its lane's path (`BatchDecoder.lone_media`): its first
token from its prompt's pass, its tokens its lane's (`max_num_seqs` 1); a text or image request
joining it mid-decode and an abort mid-decode leave every request as it is alone and the engine
idle; a second turn starts from the first's cache. On the tiny random Qwen2-VL and LLaVA
(tests/tiny_vlm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from media_samples import data_url, image_message, png
from servers import eventually
from tiny_vlm import build_tiny_vlm

pytestmark = pytest.mark.usefixtures("batch_pipeline")

GREEDY: dict[str, Any] = {"max_tokens": 12, "temperature": 0.0}
IMAGE = image_message(data_url(png(0)))
TEXT = [{"role": "user", "content": "Count from one to ten, please, slowly and carefully."}]
GPU_PLAN: dict[str, Any] = {"fused_tail_tokens": 1024}
#: the GPU's plan (the prompt in its first token's pass) and the CPU's (its last token alone)
PLANS: dict[str, dict[str, Any]] = {"gpu-plan": GPU_PLAN, "cpu-plan": {}}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "llava", model_type="llava")


async def alone(
    model_dir: Path, messages: Any, plan: dict[str, Any] = GPU_PLAN, **options: Any
) -> Any:
    """`messages` by itself in its media lane (the serialized route), on `plan`."""
    async with trio_mlx.open_engine(model_dir, max_num_seqs=1, **plan) as engine:
        out = await engine.chat(messages, **{**GREEDY, **options})
        return out, engine.get_stats()["runner"]


async def assert_idle(engine: trio_mlx.Engine) -> None:
    await eventually(lambda: not engine.get_stats()["runner"]["live_sequences"])
    stats = engine.get_stats()
    assert stats["running"] == 0 and stats["runner"]["requests_in_flight"] == 0
    assert stats["runner"]["media_sequences"] == 0


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("family", ["qwen2-vl", "llava"])
async def test_a_lone_image_request_takes_its_first_token_from_its_prompt(
    family: str, plan: str, tiny_vlm_dir: Path, llava_dir: Path, batch_pipeline: bool
) -> None:
    """On an MRoPE model (its row at a rope delta of its own) and on one without MRoPE; its
    whole prompt in its first token's pass (the GPU's plan) or its last token alone (the
    CPU's)."""
    model_dir = tiny_vlm_dir if family == "qwen2-vl" else llava_dir
    expected, lane = await alone(model_dir, IMAGE, PLANS[plan])
    async with trio_mlx.open_engine(model_dir, max_num_seqs=4, **PLANS[plan]) as engine:
        out = await engine.chat(IMAGE, **GREEDY)
        stats = engine.get_stats()["runner"]
        assert out.tokens == expected.tokens and out.text == expected.text
        assert stats["media_joined"] == 1
        # every token but the first from a decode step (pipelined, the first step only queued);
        # the prompt counted once
        assert stats["decode_steps"] == GREEDY["max_tokens"] - 1 + batch_pipeline
        assert stats["prompt_tokens"] == lane["prompt_tokens"] == out.prompt_tokens
        await assert_idle(engine)


@pytest.mark.parametrize("companion", ["text", "image"])
async def test_a_request_joining_a_lone_image_row_leaves_both_as_alone(
    tiny_vlm_dir: Path, companion: str
) -> None:
    """A text request, or another image request (its own rope delta), joins the lone image row
    mid-decode: the batch's one forward pass from there, each request's tokens its own alone."""
    other = TEXT if companion == "text" else image_message(data_url(png(1)), "Describe it.")
    image_alone, _ = await alone(tiny_vlm_dir, IMAGE, max_tokens=64)
    other_alone, _ = await alone(tiny_vlm_dir, other)
    async with trio_mlx.open_engine(tiny_vlm_dir, max_num_seqs=4, **GPU_PLAN) as engine:
        image_tokens: list[int] = []
        replies: list[Any] = []
        decoding = trio.Event()

        async def ask_image() -> None:
            async for out in engine.stream_chat(IMAGE, **{**GREEDY, "max_tokens": 64}):
                image_tokens.extend(out.new_tokens)
                if len(image_tokens) >= 3:
                    decoding.set()

        async def ask_other() -> None:
            await decoding.wait()  # the image row decodes alone: the other joins it
            replies.append(await engine.chat(other, **GREEDY))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask_image)
            nursery.start_soon(ask_other)
        stats = engine.get_stats()["runner"]
        assert image_tokens == image_alone.tokens
        assert replies[0].tokens == other_alone.tokens
        assert stats["media_joined"] == (1 if companion == "text" else 2)
        assert "2" in stats["batch_sizes"]  # they decoded together
        await assert_idle(engine)


async def test_a_lone_image_request_aborted_mid_decode_frees_the_engine(
    tiny_vlm_dir: Path,
) -> None:
    async with trio_mlx.open_engine(tiny_vlm_dir, max_num_seqs=4, **GPU_PLAN) as engine:
        image_tokens: list[int] = []
        with trio.CancelScope() as cancel:
            async for out in engine.stream_chat(IMAGE, **{**GREEDY, "max_tokens": 64}):
                image_tokens.extend(out.new_tokens)
                if len(image_tokens) >= 2:
                    cancel.cancel()  # the client goes away mid-decode
        assert 2 <= len(image_tokens) < 64
        await eventually(lambda: engine.get_stats()["runner"]["aborted"] == 1)
        await assert_idle(engine)
        # the engine is free: the same image again, whole
        again = await engine.chat(IMAGE, **{**GREEDY, "max_tokens": 4})
        assert again.tokens[:2] == image_tokens[:2]
        await assert_idle(engine)


async def test_a_second_turn_about_the_image_starts_from_the_first_turn_s_cache(
    tiny_vlm_dir: Path,
) -> None:
    """The first turn's snapshot (its prompt, its tokens fed) is the second turn's prefix: the
    second prefills only its rest, in its first token's pass, as in its lane."""

    async def two_turns(engine: trio_mlx.Engine) -> tuple[list[int], list[int], int]:
        first = await engine.chat(IMAGE, **GREEDY)
        turn: list[Any] = [
            *IMAGE,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And what else?"},
        ]
        second = await engine.chat(turn, **GREEDY)
        return first.tokens, second.tokens, second.cached_tokens

    async with trio_mlx.open_engine(tiny_vlm_dir, max_num_seqs=1, **GPU_PLAN) as engine:
        expected = await two_turns(engine)
    async with trio_mlx.open_engine(tiny_vlm_dir, max_num_seqs=4, **GPU_PLAN) as engine:
        first, second, cached = await two_turns(engine)
        assert engine.get_stats()["runner"]["media_joined"] == 2
        await assert_idle(engine)
    assert (first, second) == expected[:2]
    # the batch's snapshot also holds the first turn's last token (fed before it was read)
    assert cached >= expected[2] > 0
