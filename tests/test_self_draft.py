"""Self-speculative decoding (`engine/self_draft.py`, `draft_layers`): the target's own first
layers draft for it.

The cut shares the target's weights and exits early; greedy output with it is the target's own,
token for token, on both routes; where the layers past the cut change nothing (their residual
contributions zeroed) every drafted token is accepted; bad settings are refused with a clear
error. (An abort mid-stream: `test_speculative`, beside a draft model's.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import trio_mlx
from tiny_model import build_tiny_model
from trio_mlx.cli import build_parser
from trio_mlx.engine.loading import load_model
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.engine.self_draft import cut_model, describe_layers, parse_layers
from trio_mlx.errors import ModelLoadError
from trio_mlx.http.server import settings_from_args

PROMPTS = ["Hello there, how", "The quick brown fox jumps over the lazy dog because"]
ROUTES = pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])
GREEDY = {"max_tokens": 24, "temperature": 0.0}


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 4-layer tiny llama: a cut after 2 or 3 layers agrees with it on some tokens."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "deep", num_hidden_layers=4)


@pytest.fixture(scope="module")
def idle_tail_dir(deep_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-layer model with layers 1-3 adding nothing to the residual stream (their output
    projections zeroed): a cut after the first layer computes exactly the whole model."""
    out = tmp_path_factory.mktemp("models") / "idle-tail"
    out.mkdir(parents=True, exist_ok=True)
    for item in deep_model_dir.iterdir():
        if item.name != "model.safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    weights = mx.load(str(deep_model_dir / "model.safetensors"))
    assert isinstance(weights, dict)
    for name in list(weights):
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer not in (None, "0") and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


async def plain(model: Path, prompts: list[str], **sampling: Any) -> list[Any]:
    async with trio_mlx.open_engine(model, max_num_seqs=1) as engine:
        return [await engine.generate(p, **sampling) for p in prompts]


def test_the_cut_shares_the_targets_weights_and_exits_early(deep_model_dir: Path) -> None:
    loaded = load_model(deep_model_dir)
    target = loaded.model
    cut = cut_model(target, 2)
    assert len(target.model.layers) == 4  # the target is untouched
    assert [id(x) for x in cut.model.layers] == [id(x) for x in target.model.layers[:2]]
    weights = {id(v) for _, v in tree_flatten(target.parameters())}
    assert all(id(v) in weights for _, v in tree_flatten(cut.parameters()))  # no copy
    assert len(make_cache(cut)) == 2
    tokens = mx.array([[5, 17, 300, 9]], dtype=mx.uint32)
    h = target.model.embed_tokens(tokens)
    mask = "causal"
    for layer in target.model.layers[:2]:
        h = layer(h, mask, cache=None)
    expected = target.model.embed_tokens.as_linear(target.model.norm(h))
    assert mx.allclose(cut(tokens), expected, atol=1e-5).item()
    assert not mx.allclose(cut(tokens), target(tokens), atol=1e-3).item()


def test_a_draft_of_chosen_layers_runs_them_in_order(deep_model_dir: Path) -> None:
    target = load_model(deep_model_dir).model
    draft = cut_model(target, (0, 3))
    assert [id(x) for x in draft.model.layers] == [id(target.model.layers[i]) for i in (0, 3)]
    assert len(make_cache(draft)) == 2
    tokens = mx.array([[5, 17, 300, 9]], dtype=mx.uint32)
    h = target.model.embed_tokens(tokens)
    for i in (0, 3):
        h = target.model.layers[i](h, "causal", cache=None)
    expected = target.model.embed_tokens.as_linear(target.model.norm(h))
    assert mx.allclose(draft(tokens), expected, atol=1e-5).item()


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (0, "from 1 to 3"),
        (4, "from 1 to 3"),
        (9, "from 1 to 3"),
        ((0, 1, 2, 3), "not all"),
        ((1, 4), "layers 0-3"),
    ],
)
def test_a_draft_outside_the_models_layers_is_refused(
    deep_model_dir: Path, layers: int | tuple[int, ...], message: str
) -> None:
    target = load_model(deep_model_dir).model
    with pytest.raises(ModelLoadError, match=message):
        cut_model(target, layers)


@pytest.mark.parametrize(
    ("text", "layers", "spelled"),
    [
        ("6", 6, "6"),
        ("0-11,16-29", (*range(12), *range(16, 30)), "0-11,16-29"),
        ("2,5", (2, 5), "2,5"),
    ],
)
def test_draft_layers_are_read_and_spelled_as_the_flag_takes_them(
    text: str, layers: int | tuple[int, ...], spelled: str
) -> None:
    assert parse_layers(text) == layers
    assert describe_layers(layers) == spelled


@pytest.mark.parametrize("text", ["", "a", "3-", "5,2", "1,1", "2-1", "-1"])
def test_draft_layers_not_ascending_or_not_numbers_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="draft layers"):
        parse_layers(text)


def test_a_model_of_another_layout_is_refused() -> None:
    class Flat:  # layers, but not under `model.layers`
        def __init__(self) -> None:
            self.layers: list[Any] = []

    with pytest.raises(ModelLoadError, match="use a draft model"):
        cut_model(Flat(), 1)


@ROUTES
@pytest.mark.parametrize("layers", [1, 3, (0, 3)], ids=["first-1", "first-3", "0-and-3"])
async def test_a_self_draft_gives_the_targets_greedy_output(
    deep_model_dir: Path, max_num_seqs: int, layers: int | tuple[int, ...]
) -> None:
    expected = await plain(deep_model_dir, PROMPTS, **GREEDY)
    async with trio_mlx.open_engine(
        deep_model_dir, max_num_seqs=max_num_seqs, draft_layers=layers, num_draft_tokens=3
    ) as engine:
        outputs = [await engine.generate(p, **GREEDY) for p in PROMPTS]
        stats = engine.get_stats()["speculative"]
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert [o.text for o in outputs] == [o.text for o in expected]
    assert stats["draft_model"] == f"self:{describe_layers(layers)}"
    assert stats["drafted_tokens"] > 0


@ROUTES
async def test_layers_past_the_cut_that_change_nothing_accept_every_draft(
    idle_tail_dir: Path, max_num_seqs: int
) -> None:
    expected = await plain(idle_tail_dir, PROMPTS, **GREEDY)
    async with trio_mlx.open_engine(
        idle_tail_dir, max_num_seqs=max_num_seqs, draft_layers=1
    ) as engine:
        outputs = [await engine.generate(p, **GREEDY) for p in PROMPTS]
        stats = engine.get_stats()["speculative"]
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert stats["drafted_tokens"] > 0
    assert stats["acceptance_rate"] == 1.0
    # 23 tokens after the first, up to 5 a step: far fewer steps than tokens
    assert stats["speculative_steps"] + stats["plain_steps"] <= len(PROMPTS) * 8


async def test_a_cut_at_the_models_depth_fails_the_start_with_a_clear_error(
    tiny_model_dir: Path,
) -> None:
    with pytest.raises(ModelLoadError, match="draft layers must be from 1 to 1"):
        async with trio_mlx.open_engine(tiny_model_dir, draft_layers=2):
            pass


@pytest.mark.parametrize(
    "options",
    [
        {"draft_layers": 0},
        {"draft_layers": ()},
        {"draft_layers": 1, "draft_model": "other"},
        {"draft_layers": 1, "mtp": True},
        {"draft_layers": 1, "max_kv_size": 256},
    ],
    ids=["zero", "none-kept", "with-draft-model", "with-mtp", "with-rotating-cache"],
)
def test_settings_a_self_draft_cannot_take_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="draft_layers"):
        trio_mlx.EngineConfig(model=None, **options)


def test_the_serve_flag_reaches_the_engine() -> None:
    args = build_parser().parse_args(["serve", "--draft-layers", "6", "--num-draft-tokens", "3"])
    options = settings_from_args(args).engine_options
    assert options["draft_layers"] == 6 and options["num_draft_tokens"] == 3
    plain_options = settings_from_args(build_parser().parse_args(["serve"])).engine_options
    assert "draft_layers" not in plain_options
    listed = build_parser().parse_args(["serve", "--draft-layers", "0-2,5"])
    assert settings_from_args(listed).engine_options["draft_layers"] == (0, 1, 2, 5)


def test_the_serve_flag_refuses_a_bad_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--draft-layers", "3,1"])
    assert "--draft-layers: draft layers '3,1'" in capsys.readouterr().err


async def test_a_prefix_cache_hit_with_a_self_draft_gives_the_targets_output(
    deep_model_dir: Path,
) -> None:
    """Only the target's cache is snapshotted: on a hit the draft's own layers catch up on the
    restored prompt, and the output is still the target's."""
    system = {"role": "system", "content": "You are a terse assistant. " * 6}
    chats = [[system, {"role": "user", "content": u}] for u in ("Hi", "Name a colour", "Hi")]
    sampling = {"max_tokens": 16, "temperature": 0.0}
    async with trio_mlx.open_engine(deep_model_dir, max_num_seqs=1) as engine:
        expected = [await engine.chat(c, **sampling) for c in chats]
    async with trio_mlx.open_engine(deep_model_dir, max_num_seqs=4, draft_layers=(0, 3)) as e:
        outputs = [await e.chat(c, **sampling) for c in chats]
        stats = e.get_stats()["speculative"]
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert all(o.cached_tokens > 0 for o in outputs[1:])
    assert stats["catch_up_tokens"] >= sum(o.prompt_tokens for o in outputs)


@pytest.mark.parametrize(
    "scoring",
    [{"draft_layers": 2}, {"specprefill_draft_layers": (0, 1)}],
    ids=["the-self-draft", "its-own-setting"],
)
async def test_specprefill_scores_with_the_models_own_layers(
    deep_model_dir: Path, scoring: dict[str, Any]
) -> None:
    """Where no scoring model is named, SpecPrefill scores long prompts with the model's own
    layers (`specprefill_draft_layers`, else the self-draft's): keep 1.0 gives full prefill's
    tokens, keep 0.3 keeps that fraction; `specprefill_draft_layers` alone drafts nothing."""
    rng = mx.random.key(5)
    prompt = [int(t) for t in mx.random.randint(200, 20000, (300,), key=rng).tolist()]
    (expected,) = await plain(deep_model_dir, [prompt], **GREEDY)
    options: dict[str, Any] = {
        "max_num_seqs": 1,
        "specprefill_enabled": True,
        "specprefill_threshold": 128,
        **scoring,
    }
    async with trio_mlx.open_engine(deep_model_dir, specprefill_keep_pct=1.0, **options) as e:
        whole = await e.generate(prompt, **GREEDY)
        stats = e.get_stats()
    assert whole.tokens == expected.tokens
    assert stats["specprefill"]["requests"] == 1 and stats["specprefill"]["scoring_chunks"] > 0
    assert (stats["speculative"] is None) == ("draft_layers" not in scoring)
    async with trio_mlx.open_engine(deep_model_dir, **options) as e:
        sparse = await e.generate(prompt, **GREEDY)
        stats = e.get_stats()
    assert stats["specprefill"]["kept_tokens"] == math.ceil(0.3 * 300)
    assert len(sparse.tokens) == GREEDY["max_tokens"]


def test_specprefill_takes_the_models_own_layers_as_its_scoring_model() -> None:
    trio_mlx.EngineConfig(model=None, specprefill_enabled=True, draft_layers=4)
    config = trio_mlx.EngineConfig(
        model=None, specprefill_enabled=True, specprefill_draft_layers=6, draft_model="d"
    )
    assert config.specprefill_scorer is None and config.specprefill_scorer_layers == 6
    with pytest.raises(ValueError, match="specprefill_draft_layers"):
        trio_mlx.EngineConfig(model=None, specprefill_enabled=True)
    with pytest.raises(ValueError, match="one scoring model"):
        trio_mlx.EngineConfig(
            model=None, specprefill_draft_layers=2, specprefill_draft_model="scorer"
        )
    with pytest.raises(ValueError, match="at least one layer"):
        trio_mlx.EngineConfig(model=None, specprefill_draft_layers=0)


def test_the_specprefill_layers_flag_reaches_the_engine() -> None:
    flags = ["serve", "--specprefill", "--specprefill-draft-layers", "0-12"]
    options = settings_from_args(build_parser().parse_args(flags)).engine_options
    assert options["specprefill_draft_layers"] == tuple(range(13))
