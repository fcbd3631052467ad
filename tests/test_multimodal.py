"""Images and video through the engine API on the tiny random Qwen2-VL (tests/tiny_vlm.py).

Loopback addresses only; every media fetch is bounded by the policy's own time limit.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from media_samples import data_url, image, image_message, media_server, png, write_video
from tiny_vlm import build_tiny_vlm
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.multimodal.media import MediaPolicy, address_allowed
from trio_mlx.multimodal.prepare import MultimodalRequest

GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture
async def vlm(tiny_vlm_dir: Path) -> AsyncIterator[trio_mlx.Engine]:
    async with trio_mlx.open_engine(tiny_vlm_dir) as engine:
        yield engine


async def test_a_vision_model_is_detected_from_its_config(vlm: trio_mlx.Engine) -> None:
    assert vlm.info.multimodal is not None
    assert vlm.get_stats()["multimodal"] is True


async def test_different_images_give_different_outputs_and_the_same_image_the_same(
    vlm: trio_mlx.Engine,
) -> None:
    first = await vlm.chat(image_message(data_url(png(0))), **GREEDY)
    other = await vlm.chat(image_message(data_url(png(1))), **GREEDY)
    again = await vlm.chat(image_message(data_url(png(0))), **GREEDY)
    assert first.tokens != other.tokens
    assert first.tokens == again.tokens


async def test_output_equals_mlx_vlm_generate(vlm: trio_mlx.Engine, tiny_vlm_dir: Path) -> None:
    from mlx_vlm import generate
    from mlx_vlm.utils import load

    messages = image_message(data_url(png(3)))
    ours = await vlm.chat(messages, max_tokens=12, temperature=0.0)
    model, processor = load(str(tiny_vlm_dir))
    templated = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}],
        }
    ]
    prompt = processor.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    theirs = generate(model, processor, prompt, [image(3)], max_tokens=12, temperature=0.0)
    assert ours.prompt_tokens == theirs.prompt_tokens
    assert ours.text == theirs.text


async def test_image_tokens_match_the_processor(vlm: trio_mlx.Engine) -> None:
    assert vlm.info.multimodal is not None
    pad = vlm.info.multimodal.image_token_id
    for size, expected in (((56, 56), 4), ((112, 56), 8), ((112, 112), 16)):
        request = await vlm.prepare_chat_async(image_message(data_url(png(0, size))))
        # one feature per 2x2 merge of 14-pixel patches
        assert request.prompt_tokens.count(pad) == expected == (size[0] // 28) * (size[1] // 28)


async def test_a_text_only_request_equals_the_mlx_lm_text_path(
    vlm: trio_mlx.Engine, tiny_vlm_dir: Path
) -> None:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    messages = [{"role": "user", "content": "Name a colour."}]
    ours = await vlm.chat(messages, max_tokens=10, temperature=0.0)
    prepared = vlm.prepare_chat(messages)
    model, _tokenizer = mlx_lm.load(str(tiny_vlm_dir))
    theirs = []
    for token, _ in generate_step(mx.array(prepared.prompt_tokens), model, max_tokens=10):
        if int(token) in vlm.info.eos_token_ids:
            break
        theirs.append(int(token))
    assert list(ours.tokens) == theirs


async def test_a_second_turn_about_the_same_image_hits_both_caches(
    vlm: trio_mlx.Engine, tiny_vlm_dir: Path
) -> None:
    url = data_url(png(5))
    first = await vlm.chat(image_message(url), **GREEDY)
    vision = vlm.get_stats()["vision_cache"]
    turn = [
        *image_message(url),
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And the colours?"},
    ]
    second = await vlm.chat(turn, **GREEDY)
    after = vlm.get_stats()["vision_cache"]
    assert after["hits"] == vision["hits"] + 1
    assert after["encoded"] == vision["encoded"]  # not encoded again
    assert second.cached_tokens > 30  # the first turn (image included) came from the cache
    async with trio_mlx.open_engine(tiny_vlm_dir, cache_memory_bytes=0) as fresh:
        uncached = await fresh.chat(turn, **GREEDY)
    assert second.tokens == uncached.tokens


async def test_another_image_after_the_same_text_does_not_reuse_the_cache(
    vlm: trio_mlx.Engine, tiny_vlm_dir: Path
) -> None:
    await vlm.chat(image_message(data_url(png(6))), **GREEDY)
    other = await vlm.chat(image_message(data_url(png(7))), **GREEDY)
    pad = vlm.info.multimodal.image_token_id
    request = await vlm.prepare_chat_async(image_message(data_url(png(7))))
    assert other.cached_tokens <= request.prompt_tokens.index(pad)
    async with trio_mlx.open_engine(tiny_vlm_dir, cache_memory_bytes=0) as fresh:
        uncached = await fresh.chat(image_message(data_url(png(7))), **GREEDY)
    assert other.tokens == uncached.tokens


async def test_the_engine_api_takes_images_as_simple_engine(
    vlm: trio_mlx.Engine, tmp_path: Path
) -> None:
    path = tmp_path / "picture.png"
    path.write_bytes(png(0))
    by_part = await vlm.chat(image_message(data_url(png(0))), **GREEDY)
    messages = [{"role": "user", "content": "What is in this image?"}]
    by_path = await vlm.chat(messages, images=[str(path)], **GREEDY)
    by_pil = await vlm.chat(messages, images=[image(0)], **GREEDY)
    assert by_path.tokens == by_part.tokens == by_pil.tokens


async def test_a_video_is_sampled_into_frames(vlm: trio_mlx.Engine, tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.avi", frames=8)
    messages = [{"role": "user", "content": "What happens?"}]
    out = await vlm.chat(messages, videos=[str(video)], **GREEDY)
    request = await vlm.prepare_chat_async(messages, videos=[str(video)])
    assert vlm.info.multimodal is not None
    assert request.prompt_tokens.count(vlm.info.multimodal.video_token_id) > 0
    assert out.completion_tokens > 0


async def test_a_video_gives_mlx_vlm_s_own_output(
    vlm: trio_mlx.Engine, tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    from mlx_vlm import generate
    from mlx_vlm.utils import load

    video = write_video(tmp_path / "clip.avi", frames=8)  # 2 s: 4 frames at 2 a second
    messages = [{"role": "user", "content": "What happens?"}]
    ours = await vlm.chat(messages, videos=[str(video)], max_tokens=12, temperature=0.0)
    model, processor = load(str(tiny_vlm_dir))
    templated = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}
    ]
    prompt = processor.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    theirs = generate(model, processor, prompt, video=[str(video)], max_tokens=12, temperature=0.0)
    assert ours.prompt_tokens == theirs.prompt_tokens
    assert ours.text == theirs.text


async def test_a_video_request_decodes_processes_and_hashes_its_media_once(
    vlm: trio_mlx.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trio_mlx.multimodal.prepare as prepare

    calls: dict[str, int] = {}

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    assert vlm.info.multimodal is not None
    processor = type(vlm.info.multimodal.processor)
    monkeypatch.setattr(processor, "__call__", counted("processor", processor.__call__))
    monkeypatch.setattr(prepare, "decode_video", counted("decode", prepare.decode_video))
    monkeypatch.setattr(prepare, "media_hashes", counted("hash", prepare.media_hashes))
    video = write_video(tmp_path / "clip.avi", frames=8)
    messages = [{"role": "user", "content": "What happens?"}]
    out = await vlm.chat(messages, videos=[str(video)], **GREEDY)
    assert out.completion_tokens > 0
    assert calls == {"decode": 1, "processor": 1, "hash": 1}


@pytest.fixture(scope="module")
def tiny_qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-VL (tests/tiny_vlm.py: windowed vision attention)."""
    path = tmp_path_factory.mktemp("models") / "tiny-qwen2.5-vl"
    return build_tiny_vlm(path, model_type="qwen2_5_vl")


@pytest.fixture
async def qwen2_5_vl(tiny_qwen2_5_vl_dir: Path) -> AsyncIterator[trio_mlx.Engine]:
    async with trio_mlx.open_engine(tiny_qwen2_5_vl_dir) as engine:
        yield engine


async def test_a_video_on_qwen2_5_vl_fills_its_grid_and_changes_the_reply(
    qwen2_5_vl: trio_mlx.Engine, tmp_path: Path
) -> None:
    info = qwen2_5_vl.info.multimodal
    assert info is not None and info.model_type == "qwen2_5_vl"
    # 112x112 frames: 4x4 merged patches, more than one 56-pixel attention window (2x2)
    clip = write_video(tmp_path / "a.avi", frames=8, size=(112, 112))
    other = write_video(tmp_path / "b.avi", frames=8, size=(112, 112), seed=200)
    messages = [{"role": "user", "content": "What happens?"}]
    request = await qwen2_5_vl.prepare_chat_async(messages, videos=[str(clip)])
    assert isinstance(request, MultimodalRequest) and request.vision is not None
    assert request.vision.videos == 1 and request.vision.images == 0
    t, h, w = (int(n) for n in request.vision.arrays["video_grid_thw"][0])
    assert (h, w) == (8, 8) and t >= 2  # 14-pixel patches; 4 frames at 2 a second, 2 a step
    assert request.prompt_tokens.count(info.video_token_id) == t * h * w // 4
    first = await qwen2_5_vl.chat(messages, videos=[str(clip)], **GREEDY)
    changed = await qwen2_5_vl.chat(messages, videos=[str(other)], **GREEDY)
    again = await qwen2_5_vl.chat(messages, videos=[str(clip)], **GREEDY)
    assert first.completion_tokens > 0
    assert first.tokens != changed.tokens
    assert first.tokens == again.tokens


# ---- refusals -----------------------------------------------------------------------------------


async def test_a_text_model_refuses_images_naming_the_part(engine: trio_mlx.Engine) -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, image_message("x")[0]["content"][0]],
        }  # type: ignore[index]
    ]
    with pytest.raises(trio_mlx.InvalidRequest) as info:
        await engine.prepare_chat_async(messages)
    assert info.value.param == "messages[0].content[1].image_url"
    with pytest.raises(trio_mlx.InvalidRequest) as info:
        await engine.prepare_chat_async([{"role": "user", "content": "hi"}], images=[png(0)])
    assert info.value.param == "images"


@pytest.mark.parametrize(
    ("url", "code"),
    [
        (data_url(b"not an image at all"), "invalid_media"),
        ("data:image/png;base64,!!!notbase64", "invalid_media"),
        (data_url(b"GIF87a" + b"\x00" * 20, "image/gif"), "invalid_media"),
        ("ftp://example.com/a.png", "invalid_media"),
        ("/etc/passwd", "media_not_allowed"),
        ("file:///etc/hostname", "media_not_allowed"),
        ("http://127.0.0.1:9/a.png", "media_not_allowed"),
        ("http://[::1]:9/a.png", "media_not_allowed"),
        ("http://169.254.169.254/latest/meta-data", "media_not_allowed"),
    ],
)
async def test_bad_media_is_refused_naming_the_part(
    vlm: trio_mlx.Engine, url: str, code: str
) -> None:
    messages = [{"role": "user", "content": "look"}, *image_message(url)]
    with pytest.raises(trio_mlx.InvalidRequest) as info:
        await vlm.prepare_chat_async(messages)
    assert info.value.param == "messages[1].content[0].image_url"
    assert info.value.code == code


async def test_too_large_and_too_many_images_are_refused(tiny_vlm_dir: Path) -> None:
    policy = MediaPolicy(max_bytes=4000, max_images=2)
    async with trio_mlx.open_engine(tiny_vlm_dir, media=policy) as engine:
        with pytest.raises(trio_mlx.InvalidRequest) as info:
            await engine.prepare_chat_async(image_message(data_url(png(0, (112, 112)))))
        assert info.value.param == "messages[0].content[0].image_url"
        assert "larger" in str(info.value)
        parts = [{"type": "image_url", "image_url": {"url": data_url(png(k))}} for k in range(3)]
        with pytest.raises(trio_mlx.InvalidRequest) as info:
            await engine.prepare_chat_async([{"role": "user", "content": parts}])
        assert info.value.param == "messages[0].content[2].image_url"


async def test_local_files_only_under_the_allowed_directory(
    tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png(0))
    (tmp_path / "b.png").write_bytes(png(0))
    policy = MediaPolicy(allowed_local_dir=allowed)
    async with trio_mlx.open_engine(tiny_vlm_dir, media=policy) as engine:
        out = await engine.chat(image_message(str(allowed / "a.png")), **GREEDY)
        by_data = await engine.chat(image_message(data_url(png(0))), **GREEDY)
        assert out.tokens == by_data.tokens
        for outside in (str(tmp_path / "b.png"), str(allowed / ".." / "b.png")):
            with pytest.raises(trio_mlx.InvalidRequest) as info:
                await engine.prepare_chat_async(image_message(outside))
            assert info.value.code == "media_not_allowed"


async def test_an_image_by_url_needs_the_private_address_flag_on_loopback(
    tiny_vlm_dir: Path,
) -> None:
    async with media_server({"a.png": png(0)}) as (base, _arrived):
        async with trio_mlx.open_engine(tiny_vlm_dir) as guarded:
            with pytest.raises(trio_mlx.InvalidRequest) as info:
                await guarded.prepare_chat_async(image_message(f"{base}/a.png"))
            assert info.value.code == "media_not_allowed"
        policy = MediaPolicy(allow_private_urls=True)
        async with trio_mlx.open_engine(tiny_vlm_dir, media=policy) as engine:
            by_url = await engine.chat(image_message(f"{base}/a.png"), **GREEDY)
            by_data = await engine.chat(image_message(data_url(png(0))), **GREEDY)
            assert by_url.tokens == by_data.tokens
            with pytest.raises(trio_mlx.InvalidRequest) as info:
                await engine.prepare_chat_async(image_message(f"{base}/missing.png"))
            assert "404" in str(info.value)


def test_only_public_addresses_are_allowed() -> None:
    for private in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "::1", "fe80::1", "::ffff:127.0.0.1"):
        assert not address_allowed(private)
    assert address_allowed("8.8.8.8")
    assert address_allowed("2001:4860:4860::8888")


# ---- cancellation -------------------------------------------------------------------------------


async def test_a_client_gone_during_the_fetch_stops_it(tiny_vlm_dir: Path) -> None:
    stall = trio.Event()
    policy = MediaPolicy(allow_private_urls=True, fetch_timeout=30)
    async with media_server({}, stall=stall) as (base, _arrived):
        async with trio_mlx.open_engine(tiny_vlm_dir, media=policy) as engine:
            with trio.CancelScope() as scope:

                async def cancel_once_stalled() -> None:
                    await stall.wait()
                    scope.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_once_stalled)
                    await engine.chat(image_message(f"{base}/a.png"), **GREEDY)
            assert scope.cancelled_caught
            stats = engine.get_stats()
            assert stats["running"] == 0 and stats["admitted"] == 0


def _blocking_vision_loader(entered: threading.Event, release: threading.Event) -> Any:
    """A loader whose vision encoding waits for `release` (after setting `entered`)."""

    def loader(spec: Any) -> LoadedModel:
        loaded = load_model(spec)
        model = loaded.multimodal.model
        original = model.get_input_embeddings

        def blocked(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            release.wait(30)
            return original(*args, **kwargs)

        model.get_input_embeddings = blocked
        return loaded

    return loader


@pytest.mark.parametrize("max_num_seqs", [1, 8])
async def test_an_abort_during_vision_encoding_frees_the_slot_and_stops_there(
    tiny_vlm_dir: Path, max_num_seqs: int
) -> None:
    """On both routes: the slot is free at once, and the runner drops the request at the step
    boundary right after its encoding, before any of its prompt is prefilled (on the batched
    route it would have joined the batch's waiting sequences by then)."""
    entered, release = threading.Event(), threading.Event()
    async with trio_mlx.open_engine(
        tiny_vlm_dir, loader=_blocking_vision_loader(entered, release), max_num_seqs=max_num_seqs
    ) as engine:
        request = await engine.prepare_chat_async(image_message(data_url(png(0))), max_tokens=50)
        async with engine.open_stream(request):
            await trio.to_thread.run_sync(entered.wait, 30)
        assert engine.get_stats()["running"] == 0  # the slot is free at once
        release.set()
        for _ in range(2000):  # the runner drops it at the step boundary after encoding
            if engine.get_stats()["runner"]["aborted"] == 1:
                break
            await trio.sleep(0.005)
        runner = engine.get_stats()["runner"]
        assert runner["aborted"] == 1
        assert runner["generated_tokens"] == 0 and runner["prompt_tokens"] == 0
        again = await engine.chat(image_message(data_url(png(0))), **GREEDY)
        assert again.completion_tokens > 0


def test_the_gpu_start_up_options_take_a_vision_model(
    tiny_vlm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the runner's defaults fuse projections and route quantized rows, both walking
    the model's modules: the VLM's text view hands its language model's over (without them no
    vision model could start on CUDA: `'TextView' object has no attribute 'modules'`)."""
    import mlx.core as mx
    import mlx.nn as nn

    from trio_mlx.engine.fast_decode import default_fused_projections, prepare_fast_decode
    from trio_mlx.engine.loading import load_model
    from trio_mlx.engine.quantized_rows import RowRoutedLinear

    view = load_model(tiny_vlm_dir).model
    assert type(view).__name__ == "TextView"
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert default_fused_projections(view) is True  # float weights
    nn.quantize(view.language_model, group_size=32, bits=4)
    assert default_fused_projections(view) is True  # CUDA: the lean step's 4-bit kernel's
    with monkeypatch.context() as metal:
        metal.setattr(mx.cuda, "is_available", lambda: False)
        assert default_fused_projections(view) is False  # MLX's own quantized kernels
    assert prepare_fast_decode(view, None, None, dequantize_from_rows=None) is None
    routed = [m for m in view.modules() if isinstance(m, RowRoutedLinear)]
    assert routed and all(m.dequantize_from_rows == 128 for m in routed)
