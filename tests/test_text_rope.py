"""Text positions through the fused rope on mlx-vlm's MRoPE language models
(`multimodal/text_rope.py`), on the tiny random Qwen2-VL and Qwen2.5-VL (tests/tiny_vlm.py, fp32):
the fused rope gives the tokens mlx-vlm's MRoPE gives, for a request with an image, one with a
video, a text request, text requests batched together, a second turn from the prefix cache and
after an abort; it is really taken for every decode step; a model it cannot reproduce keeps
mlx-vlm's rotation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx.utils import tree_flatten

import trio_mlx
from media_samples import data_url, image_message, png, write_video
from tiny_vlm import build_tiny_vlm
from trio_mlx.engine.loading import load_model
from trio_mlx.multimodal import text_rope
from trio_mlx.multimodal.text_rope import TextPositionRoPE, TextRoPE

GREEDY: dict[str, Any] = {"max_tokens": 16, "temperature": 0.0}
TEXT = [{"role": "user", "content": "Tell me about the sea, slowly and carefully."}]


@pytest.fixture(scope="module")
def qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "q25", model_type="qwen2_5_vl")


@pytest.fixture
def rotations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many q/k rotations the fused rope did (instrumentation of the real method)."""
    count = [0]
    rotate = TextPositionRoPE.rotate

    def counted(self: TextPositionRoPE, x: Any, position_ids: Any) -> Any:
        count[0] += 1
        return rotate(self, x, position_ids)

    monkeypatch.setattr(TextPositionRoPE, "rotate", counted)
    yield count


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_install_wraps_every_layer_and_leaves_the_parameters(
    model_type: str, tiny_vlm_dir: Path, qwen2_5_vl_dir: Path
) -> None:
    from mlx_vlm.utils import load

    model, _ = load(str(tiny_vlm_dir if model_type == "qwen2_vl" else qwen2_5_vl_dir))
    lm = model.language_model
    before = dict(tree_flatten(lm.parameters()))
    switch = text_rope.install(lm)
    assert switch is not None
    assert all(isinstance(layer.self_attn.rotary_emb, TextPositionRoPE) for layer in lm.layers)
    after = dict(tree_flatten(lm.parameters()))
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)


def test_a_rotation_the_fused_rope_cannot_give_keeps_mlx_vlms(tiny_vlm_dir: Path) -> None:
    from mlx_vlm.utils import load

    model, _ = load(str(tiny_vlm_dir))
    lm = model.language_model
    for layer in lm.layers:  # cos and sin scaled: no plain rope rotates so
        layer.self_attn.rotary_emb.attention_scaling = 2.0
    assert text_rope.install(lm) is None
    assert not any(isinstance(layer.self_attn.rotary_emb, TextPositionRoPE) for layer in lm.layers)


def test_text_positions_rotate_as_mlx_vlm_at_long_offsets(tiny_vlm_dir: Path) -> None:
    """Past the prompt every row of a batch sits at its own offset plus its rope delta."""
    from mlx_vlm.utils import load

    model, _ = load(str(tiny_vlm_dir))
    lm = model.language_model
    plain = lm.layers[0].self_attn.rotary_emb
    switch = text_rope.install(lm)
    assert switch is not None
    fused = lm.layers[0].self_attn.rotary_emb
    head_dim = lm.layers[0].self_attn.head_dim
    q = mx.random.normal((2, 4, 3, head_dim), key=mx.random.key(1))
    k = mx.random.normal((2, 2, 3, head_dim), key=mx.random.key(2))
    rows = mx.array([[1000, 1001, 1002], [17, 18, 19]])
    positions = mx.broadcast_to(rows[None], (3, 2, 3))
    want = plain.apply_rotary(q, k, positions, unsqueeze_dim=1)
    switch.enabled = True
    with switch.text_positions():
        got = fused.apply_rotary(q, k, positions, unsqueeze_dim=1)
    for a, b in zip(want, got, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-4


async def run_both(
    model_dir: Path, run: Any, rotations: list[int], *, media_rows: bool = False, **options: Any
) -> tuple[Any, Any]:
    """`run(engine)` with the fused rope, then with mlx-vlm's MRoPE (no fused rotation then,
    but for a batch with `media_rows`: rows continuing prompts with media beside other rows take
    it always, `multimodal.joining`; alone in the batch such a row decodes through its own model,
    as its lane, `engine.batch_lone_media`): one engine each, each loading the model."""
    results = []
    for enabled in (True, False):
        TextRoPE.default = enabled
        try:
            async with trio_mlx.open_engine(model_dir, **options) as engine:
                before = rotations[0]  # after the load's own check of the fused rope
                results.append(await run(engine))
        finally:
            TextRoPE.default = None
        assert (rotations[0] > before) is (enabled or media_rows)
    return results[0], results[1]


async def test_an_image_request_decodes_the_tokens_of_mlx_vlms_mrope(
    tiny_vlm_dir: Path, rotations: list[int]
) -> None:
    async def image_turn(engine: trio_mlx.Engine) -> list[int]:
        return (await engine.chat(image_message(data_url(png(2))), **GREEDY)).tokens

    fused, plain = await run_both(tiny_vlm_dir, image_turn, rotations, max_num_seqs=1)
    assert fused == plain and len(fused) == 16
    layers = len(load_model(tiny_vlm_dir).multimodal.language_model.layers)
    # q and k of every layer at each of the 15 decode steps after the first token
    assert rotations[0] >= 2 * layers * 15


async def test_a_video_request_decodes_the_tokens_of_mlx_vlms_mrope(
    qwen2_5_vl_dir: Path, tmp_path: Path, rotations: list[int]
) -> None:
    video = write_video(tmp_path / "clip.avi", frames=4)

    async def video_turn(engine: trio_mlx.Engine) -> list[int]:
        return (await engine.chat(TEXT, videos=[str(video)], **GREEDY)).tokens

    fused, plain = await run_both(qwen2_5_vl_dir, video_turn, rotations, max_num_seqs=1)
    assert fused == plain


async def test_text_requests_batched_and_a_cached_second_turn_match(
    tiny_vlm_dir: Path, rotations: list[int]
) -> None:
    conversations = [
        TEXT,
        [{"role": "user", "content": "Count to ten."}],
        [{"role": "user", "content": "Name three colours of the evening sky, please."}],
    ]

    async def batch_and_turns(engine: trio_mlx.Engine) -> list[list[int]]:
        outputs: list[list[int]] = [[] for _ in conversations]

        async def one(i: int) -> None:
            outputs[i] = (await engine.chat(conversations[i], **GREEDY)).tokens

        async with trio.open_nursery() as nursery:
            for i in range(len(conversations)):
                nursery.start_soon(one, i)
        # a second turn about an image: its first turn's prompt comes from the prefix cache
        first = await engine.chat(image_message(data_url(png(4))), **GREEDY)
        turn: list[Any] = [
            *image_message(data_url(png(4))),
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And what else?"},
        ]
        second = await engine.chat(turn, **GREEDY)
        assert second.cached_tokens > 0
        return [*outputs, first.tokens, second.tokens]

    # the image turns come after the texts, each alone in the batch: through its own model,
    # mlx-vlm's MRoPE where the fused rope is off
    fused, plain = await run_both(tiny_vlm_dir, batch_and_turns, rotations, max_num_seqs=4)
    assert fused == plain


async def test_an_abort_mid_decode_leaves_the_next_request_as_alone(
    tiny_vlm_dir: Path, rotations: list[int]
) -> None:
    async def abort_then_ask(engine: trio_mlx.Engine) -> list[int]:
        with trio.move_on_after(30):
            async for out in engine.stream_chat(
                image_message(data_url(png(6))), max_tokens=200, temperature=0.0
            ):
                if out.completion_tokens >= 3:
                    break  # the client goes away mid-decode
        return (await engine.chat(image_message(data_url(png(7))), **GREEDY)).tokens

    async def ask(engine: trio_mlx.Engine) -> list[int]:
        return (await engine.chat(image_message(data_url(png(7))), **GREEDY)).tokens

    after_abort, plain_after_abort = await run_both(
        tiny_vlm_dir, abort_then_ask, rotations, max_num_seqs=1
    )
    async with trio_mlx.open_engine(tiny_vlm_dir, max_num_seqs=1) as engine:  # MRoPE on the CPU
        alone = await ask(engine)
    assert after_abort == plain_after_abort == alone
