"""Native MTP speculative decoding for the families beside DeepSeek-V3, on tiny random models:
GLM-4.5 MoE (`engine/mtp_glm4_moe.py`: mlx-lm's `glm4_moe`, its MTP layer under
`model.layers.{num_hidden_layers}`), GLM-4.7-Flash (`engine/mtp_glm4_moe_lite.py`: the same layout
around an MLA layer) and MiMo (`engine/mtp_mimo.py`: mlx-lm's `mimo`, under
`model.mtp_layers.0`).

The same contract as DeepSeek-V3's (`test_mtp.py`): greedy output with `mtp=True` is the output of
the same weights without MTP, token for token, on both routes; an always-right MTP layer (the
"copy" target and the "echo" MTP of `tiny_mtp_model`) has every draft accepted; an abort mid-stream
frees the slot; a checkpoint without MTP weights is refused at start-up; the MTP layer's weights
are loaded as saved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from servers import eventually
from tiny_mtp_model import build_tiny_mtp_model
from trio_mlx.errors import ModelLoadError

FAMILIES = ["glm4_moe", "glm4_moe_lite", "mimo"]
#: where each family's checkpoints keep the (first) MTP layer
MTP_PREFIX = {
    "glm4_moe": "model.layers.2.",
    "glm4_moe_lite": "model.layers.2.",
    "mimo": "model.mtp_layers.0.",
}
PROMPTS = [
    "Hello there, how",
    "The quick brown fox jumps over the lazy dog because",
    "1 2 3 4 5 6 7 8 9 10",
]
ROUTES = pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])
GREEDY = {"max_tokens": 24, "temperature": 0.0}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def mtp_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random model of `family` with a random MTP layer: its drafts are rarely right."""
    return build_tiny_mtp_model(tmp_path_factory.mktemp(family) / "with-mtp", family=family)


@pytest.fixture(scope="module")
def plain_dir(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same main weights as `mtp_dir`, without the MTP layer (what mlx-lm loads as is)."""
    return build_tiny_mtp_model(
        tmp_path_factory.mktemp(family) / "without-mtp", with_mtp=False, family=family
    )


@pytest.fixture(scope="module")
def plain_outputs(plain_dir: Path) -> list[Any]:
    async def run() -> list[Any]:
        async with trio_mlx.open_engine(plain_dir, max_num_seqs=1) as engine:
            return [await engine.generate(p, **GREEDY) for p in PROMPTS]

    return trio.run(run)


def speculation(engine: trio_mlx.Engine) -> dict[str, Any]:
    stats = engine.get_stats()["speculative"]
    assert stats is not None
    return stats


@ROUTES
async def test_greedy_output_with_mtp_is_the_models_own(
    mtp_dir: Path, plain_outputs: list[Any], max_num_seqs: int
) -> None:
    async with trio_mlx.open_engine(
        mtp_dir, max_num_seqs=max_num_seqs, mtp=True, mtp_num_draft_tokens=3
    ) as engine:
        outputs = [await engine.generate(p, **GREEDY) for p in PROMPTS]
        stats = speculation(engine)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs]
    assert [o.text for o in outputs] == [o.text for o in plain_outputs]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain_outputs]
    assert stats["draft_model"] == "mtp"
    assert stats["speculative_steps"] > 0
    assert 0 < stats["drafted_tokens"] <= 3 * stats["speculative_steps"]
    assert 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"]


async def test_an_mtp_layer_that_is_always_right_has_every_draft_accepted(
    family: str, tmp_path: Path
) -> None:
    echo = build_tiny_mtp_model(tmp_path / "echo", echo=True, copy_target=True, family=family)
    plain = build_tiny_mtp_model(
        tmp_path / "plain", with_mtp=False, copy_target=True, family=family
    )
    async with trio_mlx.open_engine(plain, max_num_seqs=1) as engine:
        expected = [await engine.generate(p, **GREEDY) for p in PROMPTS[:2]]
    async with trio_mlx.open_engine(echo, max_num_seqs=1, mtp=True, mtp_num_draft_tokens=4) as e:
        outputs = [await e.generate(p, **GREEDY) for p in PROMPTS[:2]]
        stats = speculation(e)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert all(len(set(o.tokens)) == 1 for o in outputs)  # the copy target repeats a token
    assert stats["drafted_tokens"] > 0
    assert stats["accepted_tokens"] == stats["drafted_tokens"]
    assert stats["plain_steps"] == 0  # the prompt's hidden states came with its prefill
    assert stats["speculative_steps"] <= 2 * 5  # 23 tokens after the first, up to 5 a step


@ROUTES
async def test_aborting_mid_stream_frees_the_slot(
    mtp_dir: Path, plain_outputs: list[Any], max_num_seqs: int
) -> None:
    async with trio_mlx.open_engine(mtp_dir, max_num_seqs=max_num_seqs, mtp=True) as engine:
        seen = 0
        async for out in engine.stream_generate(PROMPTS[0], **GREEDY):
            seen += len(out.new_tokens)
            if seen >= 3:
                break
        await eventually(lambda: engine.get_stats()["runner"]["live_sequences"] == 0)
        assert engine.get_stats()["runner"]["aborted"] == 1
        again = await engine.generate(PROMPTS[0], **GREEDY)
    assert again.tokens == plain_outputs[0].tokens


async def test_mtp_on_a_checkpoint_without_mtp_weights_is_refused(
    family: str, plain_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match="declares no MTP layer"):
        async with trio_mlx.open_engine(plain_dir, mtp=True):
            pass  # pragma: no cover
    # A config that declares an MTP layer over weights that lack it (an mlx-lm conversion).
    lying = tmp_path / "declared-only"
    shutil.copytree(plain_dir, lying)
    config = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ModelLoadError, match=rf"carries no MTP layer \(no {MTP_PREFIX[family]}"):
        async with trio_mlx.open_engine(lying, mtp=True):
            pass  # pragma: no cover


def test_the_mtp_layer_is_loaded_as_saved(family: str, mtp_dir: Path) -> None:
    """Every tensor of the checkpoint's MTP layer but the embedding and head copies is loaded
    into `model.mtp` under its name there, equal to the file's (strict loading already fails on
    a missing one; this checks that none is swapped or left random)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from trio_mlx.engine.loading import load_model

    model = load_model(mtp_dir, mtp=True).model
    saved = mx.load(str(mtp_dir / "model.safetensors"))
    assert isinstance(saved, dict)
    loaded = dict(tree_flatten(model.mtp.parameters()))
    prefix = MTP_PREFIX[family]
    nextn = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head": ""}
    own = {
        "glm4_moe": nextn,
        "glm4_moe_lite": nextn,
        "mimo": {
            n: n for n in ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
        },
    }[family]
    checked = 0
    for key, value in saved.items():
        if not key.startswith(prefix) or key.endswith(("embed_tokens.weight", "head.weight")):
            continue
        rest = key[len(prefix) :]
        first = rest.split(".")[0]
        name = (own[first] + rest[len(first) :]).lstrip(".") if first in own else "block." + rest
        if first == "shared_head":
            name = "norm." + rest[len("shared_head.norm.") :]
        assert name in loaded, name
        assert mx.array_equal(loaded[name], value).item(), name
        checked += 1
    assert checked >= 10
    assert checked == len(loaded)
