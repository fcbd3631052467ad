"""mlx-vlm drafters for a vision-language model's requests with media (`multimodal.drafted`),
on a tiny random Qwen3.5 and a tiny random DFlash drafter (tests/tiny_vlm_drafter.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from media_samples import data_url, image, image_message, png
from tiny_vlm_drafter import build_tiny_dflash_drafter, build_tiny_qwen3_5
from trio_mlx.cli import build_parser
from trio_mlx.errors import ModelLoadError
from trio_mlx.http.server import settings_from_args

GREEDY: dict[str, Any] = {"max_tokens": 16, "temperature": 0.0}
IMAGE_SIZE = (64, 64)  # 4 image tokens on the tiny Qwen3.5


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("drafter")
    return build_tiny_qwen3_5(root / "tiny-qwen3_5"), build_tiny_dflash_drafter(root / "dflash")


def _image_chat(seed: int = 0) -> list[dict[str, object]]:
    return image_message(data_url(png(seed, IMAGE_SIZE)))


async def _chat(model: Path, messages: Any, **config: Any) -> tuple[Any, dict[str, Any]]:
    async with trio_mlx.open_engine(model, **config) as engine:
        out = await engine.chat(messages, **GREEDY)
        return out, engine.get_stats()["runner"]


@pytest.mark.parametrize(
    "drafting",
    [{}, {"mllm_draft_kind": "dflash", "mllm_draft_block_size": 3}],
    ids=["mlx-vlm's kind and block", "dflash, block 3"],
)
async def test_greedy_output_with_the_drafter_equals_without_it(
    pair: tuple[Path, Path], drafting: dict[str, Any]
) -> None:
    target, drafter = pair
    plain, plain_stats = await _chat(target, _image_chat())
    drafted, stats = await _chat(target, _image_chat(), mllm_draft_model=drafter, **drafting)
    assert plain_stats["media_drafted"] == 0
    assert stats["media_drafted"] == 1  # it went through mlx-vlm's speculative loop
    assert drafted.completion_tokens == plain.completion_tokens == GREEDY["max_tokens"]
    assert drafted.tokens == plain.tokens
    assert drafted.prompt_tokens == plain.prompt_tokens


async def test_the_batched_route_steps_a_drafted_request_beside_the_batch(
    pair: tuple[Path, Path],
) -> None:
    target, drafter = pair
    plain, _ = await _chat(target, _image_chat(1))
    drafted, stats = await _chat(target, _image_chat(1), mllm_draft_model=drafter, max_num_seqs=2)
    assert stats["batching"] is True
    assert stats["media_drafted"] == 1 and stats["media_steps"] >= GREEDY["max_tokens"]
    assert drafted.tokens == plain.tokens


async def test_the_drafted_output_equals_mlx_vlm_generate_without_a_drafter(
    pair: tuple[Path, Path],
) -> None:
    from mlx_vlm import generate
    from mlx_vlm.utils import load

    target, drafter = pair
    drafted, _ = await _chat(target, _image_chat(3), mllm_draft_model=drafter)
    model, processor = load(str(target))
    templated = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in this image?"}],
        }
    ]
    prompt = processor.apply_chat_template(templated, tokenize=False, add_generation_prompt=True)
    theirs = generate(
        model, processor, prompt, [image(3, IMAGE_SIZE)], max_tokens=16, temperature=0.0
    )
    assert drafted.prompt_tokens == theirs.prompt_tokens
    assert drafted.text == theirs.text


async def test_an_abort_mid_generation_leaves_the_engine_idle(pair: tuple[Path, Path]) -> None:
    target, drafter = pair
    async with trio_mlx.open_engine(target, mllm_draft_model=drafter) as engine:
        request = await engine.prepare_chat_async(_image_chat(), max_tokens=500, temperature=0.0)
        seen = 0
        async with engine.open_stream(request) as stream:
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
        assert engine.get_stats()["running"] == 0  # the slot is free at once
        for _ in range(6000):  # the runner drops it at the next step boundary
            if engine.get_stats()["runner"]["aborted"] == 1:
                break
            await trio.sleep(0.005)
        runner = engine.get_stats()["runner"]
        assert runner["aborted"] == 1
        assert runner["live_sequences"] == 0 and runner["requests_in_flight"] == 0
        assert runner["generated_tokens"] < 500
        again = await engine.chat(_image_chat(), **GREEDY)
        assert again.completion_tokens == GREEDY["max_tokens"]
        assert engine.get_stats()["runner"]["media_drafted"] == 2


async def test_a_text_only_request_is_unaffected(pair: tuple[Path, Path]) -> None:
    target, drafter = pair
    messages = [{"role": "user", "content": "Tell me about trees."}]
    plain, _ = await _chat(target, messages)
    drafted, stats = await _chat(target, messages, mllm_draft_model=drafter)
    assert drafted.tokens == plain.tokens
    assert stats["media_drafted"] == 0


async def test_a_request_asking_for_logprobs_takes_the_plain_media_route(
    pair: tuple[Path, Path],
) -> None:
    target, drafter = pair
    async with trio_mlx.open_engine(target, mllm_draft_model=drafter) as engine:
        out = await engine.chat(_image_chat(), logprobs=True, **GREEDY)
        assert out.logprobs is not None and len(out.logprobs) == out.completion_tokens
        assert engine.get_stats()["runner"]["media_drafted"] == 0


async def test_a_drafter_mlx_vlm_rejects_fails_at_load(
    pair: tuple[Path, Path], tmp_path: Path, tiny_vlm_dir: Path, tiny_model_dir: Path
) -> None:
    target, drafter = pair
    wrong_size = build_tiny_dflash_drafter(tmp_path / "dflash-32", hidden_size=32)
    with pytest.raises(ModelLoadError, match="mlx-vlm cannot draft for this qwen3_5 model"):
        async with trio_mlx.open_engine(target, mllm_draft_model=wrong_size):
            pass
    # Qwen2-VL's language model does not hand a DFlash drafter the hidden states it reads.
    with pytest.raises(ModelLoadError, match="mlx-vlm cannot draft for this qwen2_vl model"):
        async with trio_mlx.open_engine(tiny_vlm_dir, mllm_draft_model=drafter):
            pass
    with pytest.raises(ModelLoadError, match="needs a vision-language model"):
        async with trio_mlx.open_engine(tiny_model_dir, mllm_draft_model=drafter):
            pass


def test_the_engine_config_checks_the_drafter_options() -> None:
    with pytest.raises(ValueError, match="mllm_draft_kind must be one of"):
        trio_mlx.EngineConfig(mllm_draft_model="d", mllm_draft_kind="medusa")
    with pytest.raises(ValueError, match="mllm_draft_block_size must be >= 1"):
        trio_mlx.EngineConfig(mllm_draft_model="d", mllm_draft_block_size=0)
    with pytest.raises(ValueError, match="need mllm_draft_model"):
        trio_mlx.EngineConfig(mllm_draft_kind="dflash")


def test_the_cli_options_parse(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--mllm-draft-model",
            str(tmp_path),
            "--mllm-draft-kind",
            "mtp",
            "--mllm-draft-block-size",
            "3",
        ]
    )
    options = settings_from_args(args).engine_options
    assert options["mllm_draft_model"] == tmp_path
    assert options["mllm_draft_kind"] == "mtp"
    assert options["mllm_draft_block_size"] == 3
    drafting = {k: v for k, v in options.items() if k.startswith("mllm_draft")}
    trio_mlx.EngineConfig(**drafting)  # the engine takes them
    plain = settings_from_args(build_parser().parse_args(["serve"])).engine_options
    assert "mllm_draft_model" not in plain
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mllm-draft-kind", "medusa"])
