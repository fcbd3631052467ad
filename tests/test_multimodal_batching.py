"""A vision-language model on the batched route (`max_num_seqs > 1`), on the tiny random Qwen2-VL,
Qwen2.5-VL and LLaVA (tests/tiny_vlm.py): text-only requests decode together in the batch, each
as it decodes alone; a request with an image or a video takes its vision step beside the batch,
then prefills and decodes in it (`multimodal/joining.py`), every request's tokens what it gives
alone (several images at once, a video, a second turn from the prefix cache; LLaVA, a family
without MRoPE, as well as the MRoPE ones); where a request cannot join (`media_lane`'s reasons)
it decodes beside the batch, with the same tokens; an image request's abort leaves the batch's
requests as they were."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from media_samples import data_url, image_message, png, write_video
from runner_intake import hold_the_runner_intake
from servers import eventually
from tiny_vlm import build_tiny_vlm
from trio_mlx.multimodal.media import MediaPolicy

GREEDY: dict[str, Any] = {"max_tokens": 12, "temperature": 0.0}
TEXTS = [
    [{"role": "user", "content": "Tell me about the sea."}],
    [{"role": "user", "content": "Count from one to ten, please, slowly and carefully."}],
]
IMAGE = image_message(data_url(png(0)))


@pytest.fixture(scope="module")
def qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "q25", model_type="qwen2_5_vl")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "llava", model_type="llava")


async def alone(model_dir: Path, conversations: list[Any]) -> list[list[int]]:
    """Each conversation by itself on the serialized route."""
    async with trio_mlx.open_engine(model_dir, max_num_seqs=1) as engine:
        assert engine.get_stats()["runner"]["batching"] is False
        return [(await engine.chat(messages, **GREEDY)).tokens for messages in conversations]


async def together(engine: trio_mlx.Engine, conversations: list[Any], hold: Any) -> list[list[int]]:
    """The conversations started at one step boundary of the runner; their tokens."""
    outputs: list[list[int]] = [[] for _ in conversations]

    async def one(i: int) -> None:
        outputs[i] = (await engine.chat(conversations[i], **GREEDY)).tokens

    hold.close()
    async with trio.open_nursery() as nursery:
        for i in range(len(conversations)):
            nursery.start_soon(one, i)
        count = len(conversations)
        await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == count)
        hold.open()
    return outputs


async def assert_idle(engine: trio_mlx.Engine) -> None:
    await eventually(lambda: not engine.get_stats()["runner"]["live_sequences"])
    stats = engine.get_stats()
    assert stats["running"] == 0 and stats["runner"]["requests_in_flight"] == 0
    assert stats["runner"]["media_sequences"] == 0


async def test_text_requests_on_a_vlm_decode_in_one_batch_as_alone(
    tiny_vlm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = await alone(tiny_vlm_dir, TEXTS)
    hold = hold_the_runner_intake(monkeypatch)
    # Chunks cut by the plan alone (not a pace measured on a busy machine): both prefill in one
    # step and join the batch together.
    async with trio_mlx.open_engine(
        tiny_vlm_dir, max_num_seqs=4, prefill_chunk_seconds=60.0
    ) as engine:
        assert engine.info.multimodal is not None
        outputs = await together(engine, TEXTS, hold)
        stats = engine.get_stats()["runner"]
        assert outputs == expected
        assert stats["batching"] is True
        assert max(int(size) for size in stats["batch_sizes"]) == 2  # they decoded together
        assert stats["media_steps"] == 0
        await assert_idle(engine)


async def image_with_texts(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The image request and the two texts started together: each gives its tokens alone, the
    engine ends idle. The runner's statistics."""
    conversations = [IMAGE, *TEXTS]
    expected = await alone(model_dir, conversations)
    hold = hold_the_runner_intake(monkeypatch)
    async with trio_mlx.open_engine(
        model_dir, max_num_seqs=4, prefill_chunk_seconds=60.0
    ) as engine:
        outputs = await together(engine, conversations, hold)
        stats: dict[str, Any] = engine.get_stats()["runner"]
        assert outputs == expected
        assert engine.get_stats()["vision_cache"]["misses"] >= 1
        await assert_idle(engine)
    return stats


async def test_an_image_request_joins_the_batch_and_decodes_as_alone(
    tiny_vlm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stats = await image_with_texts(tiny_vlm_dir, monkeypatch)
    assert stats["media_joined"] == 1
    assert max(int(size) for size in stats["batch_sizes"]) == 3  # the image with the texts
    # in the lane only its vision step: it prefilled and decoded in the batch
    assert stats["media_steps"] == 1


async def test_an_image_request_on_a_model_without_mrope_joins_the_batch_as_alone(
    llava_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLaVA: its language model places every token at its cache offset (no rope delta, no
    fused rope), so the batch's plain forward pass places the image request's row right."""
    stats = await image_with_texts(llava_dir, monkeypatch)
    assert stats["media_joined"] == 1
    assert max(int(size) for size in stats["batch_sizes"]) == 3  # the image with the texts
    assert stats["media_steps"] == 1  # only its vision step in the lane


def test_which_models_let_a_media_request_join(
    tiny_vlm_dir: Path, llava_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`can_join`: a model without MRoPE, or an MRoPE model with the fused rope; never an MRoPE
    model without it, nor a prompt that ends with a media token."""
    from types import SimpleNamespace

    from trio_mlx.engine.loading import load_model
    from trio_mlx.multimodal.joining import can_join
    from trio_mlx.multimodal.loading import TextView

    def joins(loaded: Any, prompt: tuple[int, ...]) -> bool:
        job: Any = SimpleNamespace(prompt_tokens=prompt)
        return can_join(job, loaded.multimodal, loaded.model)

    llava = load_model(llava_dir)
    image_token = llava.multimodal.processing.image_token_id
    assert not llava.model.places_rows  # no fused rope: it needs none
    assert joins(llava, (1, image_token, 5))
    assert not joins(llava, (1, 5, image_token))
    qwen = load_model(tiny_vlm_dir)
    assert joins(qwen, (1, 5))
    monkeypatch.setattr(TextView, "places_rows", property(lambda self: False))
    assert not joins(qwen, (1, 5))  # MRoPE without the fused rope stays in the lane
    assert joins(llava, (1, image_token, 5))


async def test_an_image_request_that_cannot_join_decodes_beside_the_batch(
    tiny_vlm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose rows cannot take positions of their own (no fused rope: not an MRoPE
    model): the request decodes in the lane, step for step beside the batch."""
    from trio_mlx.actors import media_lane

    monkeypatch.setattr(media_lane, "can_join", lambda *args: False)
    stats = await image_with_texts(tiny_vlm_dir, monkeypatch)
    assert stats["media_joined"] == 0
    assert max(int(size) for size in stats["batch_sizes"]) == 2  # the two text requests
    # the image request's vision step, prefill and decode tokens, beside the batch
    assert stats["media_steps"] >= 2 + GREEDY["max_tokens"] - 1


async def test_several_images_and_texts_decode_together_as_alone(
    tiny_vlm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conversations = [
        IMAGE,
        *TEXTS,
        image_message(data_url(png(1)), "Describe the colours."),
        image_message(data_url(png(2, (84, 56)))),
    ]
    expected = await alone(tiny_vlm_dir, conversations)
    hold = hold_the_runner_intake(monkeypatch)
    async with trio_mlx.open_engine(
        tiny_vlm_dir, max_num_seqs=8, prefill_chunk_seconds=60.0
    ) as engine:
        outputs = await together(engine, conversations, hold)
        stats = engine.get_stats()["runner"]
        assert outputs == expected
        assert stats["media_joined"] == 3
        assert max(int(size) for size in stats["batch_sizes"]) == 5
        await assert_idle(engine)


async def test_a_video_joins_the_batch_and_decodes_as_alone(
    qwen2_5_vl_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    video = write_video(tmp_path / "clip.avi", frames=4)
    clip: list[Any] = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": str(video)}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    conversations = [clip, TEXTS[0]]
    policy = MediaPolicy(allowed_local_dir=tmp_path)
    async with trio_mlx.open_engine(qwen2_5_vl_dir, max_num_seqs=1, media=policy) as engine:
        expected = [(await engine.chat(c, **GREEDY)).tokens for c in conversations]
    hold = hold_the_runner_intake(monkeypatch)
    async with trio_mlx.open_engine(
        qwen2_5_vl_dir, max_num_seqs=4, prefill_chunk_seconds=60.0, media=policy
    ) as engine:
        outputs = await together(engine, conversations, hold)
        assert outputs == expected
        assert engine.get_stats()["runner"]["media_joined"] == 1
        await assert_idle(engine)


async def test_a_second_turn_about_the_image_starts_from_the_cached_first(
    tiny_vlm_dir: Path,
) -> None:
    async def two_turns(engine: trio_mlx.Engine) -> tuple[list[int], list[int], int]:
        first = await engine.chat(IMAGE, **GREEDY)
        turn: list[Any] = [
            *IMAGE,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And what else?"},
        ]
        second = await engine.chat(turn, **GREEDY)
        return first.tokens, second.tokens, second.cached_tokens

    async with trio_mlx.open_engine(tiny_vlm_dir, max_num_seqs=1) as engine:
        expected = await two_turns(engine)
    async with trio_mlx.open_engine(tiny_vlm_dir, max_num_seqs=4) as engine:
        first, second, cached = await two_turns(engine)
        assert engine.get_stats()["runner"]["media_joined"] == 2
    assert (first, second) == expected[:2]
    # the batch's snapshot also holds the first turn's last token (fed before it was read)
    assert cached >= expected[2] > 0


async def test_an_image_request_aborted_mid_way_leaves_the_batch_as_it_was(
    tiny_vlm_dir: Path,
) -> None:
    await aborted_mid_decode(tiny_vlm_dir)


async def test_an_image_request_aborted_in_the_batch_of_a_model_without_mrope(
    llava_dir: Path,
) -> None:
    assert await aborted_mid_decode(llava_dir) == 1


async def aborted_mid_decode(model_dir: Path) -> int:
    """An image request beside two text requests, aborted after two tokens: the texts give
    their tokens alone, the engine ends idle. How many media requests joined the batch."""
    expected = await alone(model_dir, TEXTS)
    async with trio_mlx.open_engine(model_dir, max_num_seqs=4) as engine:
        outputs: list[list[int]] = [[], []]
        image_tokens: list[int] = []

        async def text(i: int) -> None:
            outputs[i] = (await engine.chat(TEXTS[i], **GREEDY)).tokens

        async def image_until_aborted(cancel: trio.CancelScope) -> None:
            with cancel:
                async for out in engine.stream_chat(IMAGE, **{**GREEDY, "max_tokens": 64}):
                    image_tokens.extend(out.new_tokens)
                    if len(image_tokens) >= 2:
                        cancel.cancel()  # the client goes away mid-decode

        async with trio.open_nursery() as nursery:
            cancel = trio.CancelScope()
            nursery.start_soon(image_until_aborted, cancel)
            for i in range(len(TEXTS)):
                nursery.start_soon(text, i)
        assert outputs == expected
        assert 2 <= len(image_tokens) < 64
        await eventually(lambda: engine.get_stats()["runner"]["aborted"] == 1)
        await assert_idle(engine)
        joined = int(engine.get_stats()["runner"]["media_joined"])
        # the engine is free: the same image again, whole
        again = await engine.chat(IMAGE, **{**GREEDY, "max_tokens": 4})
        assert again.tokens[:2] == image_tokens[:2]
    return joined


async def test_a_vision_model_loaded_by_the_caller_serves_a_batch(tiny_vlm_dir: Path) -> None:
    """A model loaded on the caller's thread (`loader=`, as a Trio app or a benchmark does) and
    used by two engines in turn: its arrays evaluate on each runner's thread."""
    from trio_mlx.engine.loading import load_model

    loaded = load_model(tiny_vlm_dir)
    for _ in range(2):
        async with trio_mlx.open_engine(
            "vlm", loader=lambda _spec: loaded, max_num_seqs=4
        ) as engine:
            outputs = await both_texts(engine)
            assert all(len(tokens) > 0 for tokens in outputs)
            await assert_idle(engine)


async def both_texts(engine: trio_mlx.Engine) -> list[list[int]]:
    outputs: list[list[int]] = [[], []]

    async def one(i: int) -> None:
        outputs[i] = (await engine.chat(TEXTS[i], **GREEDY)).tokens

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(one, i)
    return outputs


async def test_an_image_request_keeps_its_output_format_on_both_routes(
    tiny_vlm_dir: Path,
) -> None:
    """The output format of a request with media is enforced as a text request's is (it was
    dropped while the request was prepared): alone on the serialized route, and in the batch
    beside a text request."""
    texts = [await formatted_image_beside_text(tiny_vlm_dir, n) for n in (1, 4)]
    assert re.fullmatch("(yes|no), [a-z]{2,6}", texts[0])
    assert texts[0] == texts[1]


async def formatted_image_beside_text(model_dir: Path, max_num_seqs: int) -> str:
    from trio_mlx.structured.formats import OutputFormat

    answer = OutputFormat.regex("(yes|no), [a-z]{2,6}")
    replies: list[Any] = [None, None]
    async with trio_mlx.open_engine(
        model_dir, max_num_seqs=max_num_seqs, admission="wait", max_waiting=4
    ) as engine:

        async def one(i: int, messages: Any) -> None:
            options = {"output_format": answer} if i == 0 else {}
            replies[i] = await engine.chat(messages, **GREEDY, **options)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, IMAGE)
            nursery.start_soon(one, 1, TEXTS[0])
    assert replies[0].finish_reason == "stop"
    return str(replies[0].text)


async def test_an_image_request_aborted_while_it_prefills_in_the_batch(tiny_vlm_dir: Path) -> None:
    """Aborted as soon as its vision step has handed it to the batch, where its prompt prefills
    8 tokens a step: it leaves the batch, the text request beside it completes as alone,
    nothing is left behind."""
    expected = await alone(tiny_vlm_dir, [TEXTS[1]])
    async with trio_mlx.open_engine(
        tiny_vlm_dir, max_num_seqs=4, prefill_step_size=8, cache_memory_bytes=0
    ) as engine:
        text: list[list[int]] = []

        async def image_until_aborted(cancel: trio.CancelScope) -> None:
            with cancel:
                await engine.chat(IMAGE, **GREEDY)

        async def ask_text() -> None:
            text.append((await engine.chat(TEXTS[1], **GREEDY)).tokens)

        async with trio.open_nursery() as nursery:
            cancel = trio.CancelScope()
            nursery.start_soon(image_until_aborted, cancel)
            nursery.start_soon(ask_text)
            await eventually(lambda: engine.get_stats()["runner"]["media_joined"] == 1)
            cancel.cancel()
        assert text == expected
        await eventually(lambda: engine.get_stats()["runner"]["aborted"] == 1)
        await assert_idle(engine)


async def test_a_lone_image_row_decodes_without_the_draft_model(llava_dir: Path) -> None:
    """With a draft model, a lone row speculates; a row continuing a prompt with media does
    not (the text draft never saw the image, and the row's fed prompt is cache keys, not
    token ids: it failed the request), and gives its tokens alone; a text request after it
    still speculates."""
    async with trio_mlx.open_engine(llava_dir, max_num_seqs=1) as engine:
        expected = (await engine.chat(IMAGE, **GREEDY)).tokens
    async with trio_mlx.open_engine(
        llava_dir, max_num_seqs=4, draft_model=str(llava_dir), num_draft_tokens=3
    ) as engine:
        image = await engine.chat(IMAGE, **GREEDY)
        stats = engine.get_stats()
        assert stats["runner"]["media_joined"] == 1
        assert stats["speculative"]["speculative_steps"] == 0
        assert image.tokens == expected
        await engine.chat(TEXTS[0], **GREEDY)
        assert engine.get_stats()["speculative"]["speculative_steps"] > 0
        await assert_idle(engine)


async def test_a_second_turn_on_llava_reuses_the_image_features(llava_dir: Path) -> None:
    """mlx-vlm's LLaVA has no call that computes its image features alone: they are caught on
    their way into the first turn's embeddings, so the second turn about the same image does not
    encode it again, and answers as a fresh engine does."""
    turn: list[Any] = [
        *IMAGE,
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "And what else?"},
    ]
    async with trio_mlx.open_engine(llava_dir, cache_memory_bytes=0) as engine:
        await engine.chat(IMAGE, **GREEDY)
        second = await engine.chat(turn, **GREEDY)
        vision = engine.get_stats()["vision_cache"]
    assert (vision["encoded"], vision["hits"], vision["entries"]) == (1, 1, 1)
    async with trio_mlx.open_engine(llava_dir, cache_memory_bytes=0) as engine:
        fresh = await engine.chat(turn, **GREEDY)
    assert second.tokens == fresh.tokens


async def test_caught_features_a_model_would_not_take_back_are_not_cached(
    llava_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose `cached_image_features` is something else than what it merges (simulated:
    LLaVA taking them back doubled) gets no cache entry: each turn encodes again."""
    from mlx_vlm.models.llava.llava import Model

    original = Model.get_input_embeddings

    def doubling(self: Any, input_ids: Any = None, pixel_values: Any = None, **kw: Any) -> Any:
        if kw.get("cached_image_features") is not None:
            kw["cached_image_features"] = kw["cached_image_features"] * 2
        return original(self, input_ids, pixel_values, **kw)

    monkeypatch.setattr(Model, "get_input_embeddings", doubling)
    async with trio_mlx.open_engine(llava_dir, cache_memory_bytes=0) as engine:
        await engine.chat(IMAGE, **GREEDY)
        await engine.chat(IMAGE, **GREEDY)
        vision = engine.get_stats()["vision_cache"]
    assert (vision["encoded"], vision["hits"], vision["entries"]) == (2, 0, 0)
