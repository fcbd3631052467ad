"""Draft-model speculative decoding (`engine/speculative.py`) on the tiny random models.

Greedy output with any draft is the target's own greedy output, token for token, on both routes
(serialized, and the batched route where a lone row speculates); a draft identical to the target
has every drafted token accepted; the acceptance step keeps the target's distribution (a
chi-square test on a small vocabulary, seeded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import pytest
import trio

import trio_mlx
from runner_intake import hold_the_runner_intake
from servers import eventually
from tiny_model import build_other_tokenizer_copy, build_perturbed_copy, build_tiny_model
from trio_mlx.engine.speculative import accept_drafts
from trio_mlx.errors import ModelLoadError
from trio_mlx.structured import OutputFormat

PROMPTS = [
    "Hello there, how",
    "The quick brown fox jumps over the lazy dog because",
    "1 2 3 4 5 6 7 8 9 10",
]
ROUTES = pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random model, smaller, with the same tokenizer: it rarely agrees."""
    out = tmp_path_factory.mktemp("drafts") / "small"
    return build_tiny_model(
        out, seed=7, hidden_size=32, intermediate_size=64, num_attention_heads=2
    )


@pytest.fixture(scope="module")
def near_draft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with noise on its weights: agrees on some drafted tokens, not all."""
    return build_perturbed_copy(
        tiny_model_dir, tmp_path_factory.mktemp("drafts") / "near", noise=0.35
    )


#: Plain (draft-less) outputs already computed, by model, prompts and sampling: greedy decoding
#: is deterministic, so tests share them instead of opening an engine each.
_PLAIN: dict[str, list[Any]] = {}


async def plain_outputs(model: Path, prompts: list[str], **sampling: Any) -> list[Any]:
    key = repr((str(model), prompts, sorted(sampling.items())))
    if key not in _PLAIN or sampling.get("temperature", 1.0) != 0.0:
        async with trio_mlx.open_engine(model, max_num_seqs=1) as engine:
            _PLAIN[key] = [await engine.generate(p, **sampling) for p in prompts]
    return _PLAIN[key]


def speculation(engine: trio_mlx.Engine) -> dict[str, Any]:
    stats = engine.get_stats()["speculative"]
    assert stats is not None
    return stats


# ---- the acceptance step ------------------------------------------------------------------------

#: chi-square, 4 degrees of freedom, 0.1% upper tail: a correct sampler exceeds it once in 1,000
#: seeds; this test's seed is fixed.
CHI2_DF4_P001 = 18.47


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


def draw_first_two(p: mx.array, q: mx.array, trials: int, seed: int) -> tuple[list[int], list[int]]:
    """Run `accept_drafts` `trials` times with two drafted tokens drawn from `q`; the first
    emitted token of each trial, and the second one of the trials whose first draft was kept."""
    key = mx.random.key(seed)
    firsts: list[int] = []
    seconds: list[int] = []
    for _ in range(trials):
        key, k1, k2, k3, k4 = mx.random.split(key, 5)
        drafted = mx.stack(
            [
                mx.random.categorical(mx.log(q[0]), key=k1),
                mx.random.categorical(mx.log(q[1]), key=k2),
            ]
        ).astype(mx.uint32)
        accepted, token = accept_drafts(p, q, drafted, k3, k4)
        n = int(accepted.item())
        emitted = [*drafted.tolist()[:n], int(token.item())]
        firsts.append(emitted[0])
        if n >= 1:
            seconds.append(emitted[1])
    return firsts, seconds


def test_the_acceptance_step_keeps_the_target_distribution() -> None:
    p = mx.array([[0.40, 0.30, 0.15, 0.10, 0.05], [0.05, 0.05, 0.20, 0.30, 0.40], [0.2] * 5])
    q = mx.array([[0.10, 0.20, 0.30, 0.20, 0.20], [0.30, 0.30, 0.20, 0.10, 0.10]])
    firsts, seconds = draw_first_two(p, q, trials=4000, seed=1234)
    first_counts = [firsts.count(t) for t in range(5)]
    second_counts = [seconds.count(t) for t in range(5)]
    assert chi_square(first_counts, p[0].tolist()) < CHI2_DF4_P001
    assert len(seconds) > 1000
    assert chi_square(second_counts, p[1].tolist()) < CHI2_DF4_P001
    # The same statistic tells the draft's own distribution apart from the target's.
    assert chi_square(first_counts, q[0].tolist()) > 10 * CHI2_DF4_P001


def test_the_acceptance_step_keeps_every_draft_when_the_distributions_agree() -> None:
    p = mx.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    key = mx.random.key(5)
    for _ in range(50):
        key, k1, k2 = mx.random.split(key, 3)
        drafted = mx.array([0, 1], dtype=mx.uint32)
        accepted, _ = accept_drafts(p, p[:2], drafted, k1, k2)
        assert int(accepted.item()) == 2


def test_a_draft_the_target_gives_no_chance_is_always_refused() -> None:
    p = mx.array([[0.0, 0.5, 0.5], [1 / 3] * 3])
    q = mx.array([[1.0, 0.0, 0.0]])
    key = mx.random.key(9)
    for _ in range(50):
        key, k1, k2 = mx.random.split(key, 3)
        accepted, token = accept_drafts(p, q, mx.array([0], dtype=mx.uint32), k1, k2)
        assert int(accepted.item()) == 0 and int(token.item()) in (1, 2)


# ---- greedy output is the target's ---------------------------------------------------------------


@ROUTES
async def test_a_draft_identical_to_the_target_accepts_every_drafted_token(
    tiny_model_dir: Path, max_num_seqs: int
) -> None:
    sampling = {"max_tokens": 24, "temperature": 0.0}
    expected = await plain_outputs(tiny_model_dir, PROMPTS, **sampling)
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=max_num_seqs, draft_model=tiny_model_dir
    ) as engine:
        outputs = [await engine.generate(p, **sampling) for p in PROMPTS]
        stats = speculation(engine)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert [o.text for o in outputs] == [o.text for o in expected]
    assert stats["drafted_tokens"] > 0
    assert stats["accepted_tokens"] == stats["drafted_tokens"]
    assert stats["acceptance_rate"] == 1.0
    # 23 tokens after the first in steps of up to 5: far fewer steps than tokens.
    assert stats["speculative_steps"] + stats["plain_steps"] <= 3 * 5


@ROUTES
@pytest.mark.parametrize("draft", ["small", "near"])
async def test_a_different_draft_gives_the_targets_greedy_output(
    tiny_model_dir: Path,
    small_draft_dir: Path,
    near_draft_dir: Path,
    max_num_seqs: int,
    draft: str,
) -> None:
    draft_dir = small_draft_dir if draft == "small" else near_draft_dir
    sampling = {"max_tokens": 32, "temperature": 0.0}
    expected = await plain_outputs(tiny_model_dir, PROMPTS, **sampling)
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=max_num_seqs, draft_model=draft_dir, num_draft_tokens=3
    ) as engine:
        outputs = [await engine.generate(p, **sampling) for p in PROMPTS]
        stats = speculation(engine)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in expected]
    assert stats["drafted_tokens"] > 0
    if draft == "near":  # some kept, some refused: the caches are cut back mid-draft
        assert 0.0 < stats["acceptance_rate"] < 1.0


@ROUTES
async def test_penalties_bias_stop_strings_and_logprobs_match_plain_decoding(
    tiny_model_dir: Path, near_draft_dir: Path, max_num_seqs: int
) -> None:
    plain_text = (await plain_outputs(tiny_model_dir, PROMPTS[:1], max_tokens=30, temperature=0.0))[
        0
    ].text
    stop = plain_text[len(plain_text) // 2 : len(plain_text) // 2 + 3]
    sampling: dict[str, Any] = {
        "max_tokens": 30,
        "temperature": 0.0,
        "repetition_penalty": 1.3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "logit_bias": {5: 3.0, 17: -100.0},
        "logprobs": True,
        "top_logprobs": 3,
    }
    cases = [sampling, {"max_tokens": 30, "temperature": 0.0, "stop": [stop]}]
    for case in cases:
        expected = await plain_outputs(tiny_model_dir, PROMPTS[:2], **case)
        async with trio_mlx.open_engine(
            tiny_model_dir, max_num_seqs=max_num_seqs, draft_model=near_draft_dir
        ) as engine:
            outputs = [await engine.generate(p, **case) for p in PROMPTS[:2]]
            assert speculation(engine)["accepted_tokens"] > 0
        for got, want in zip(outputs, expected, strict=True):
            assert got.tokens == want.tokens and got.text == want.text
            assert got.finish_reason == want.finish_reason
            assert len(got.logprobs or ()) == len(want.logprobs or ())
            for a, b in zip(got.logprobs or (), want.logprobs or (), strict=True):
                assert a.token == b.token
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert any(o.finish_reason == "stop" for o in outputs)


async def test_a_prefix_cache_hit_still_gives_the_targets_output(
    tiny_model_dir: Path, near_draft_dir: Path
) -> None:
    system = {"role": "system", "content": "You are a terse assistant. " * 6}
    chats = [[system, {"role": "user", "content": u}] for u in ("Hi", "Name a colour", "Hi")]
    sampling = {"max_tokens": 20, "temperature": 0.0}
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        expected = [await engine.chat(c, **sampling) for c in chats]
    for route in (1, 4):
        async with trio_mlx.open_engine(
            tiny_model_dir, max_num_seqs=route, draft_model=near_draft_dir
        ) as engine:
            outputs = [await engine.chat(c, **sampling) for c in chats]
            stats = speculation(engine)
        assert [o.tokens for o in outputs] == [o.tokens for o in expected]
        assert outputs[0].cached_tokens == 0
        assert all(o.cached_tokens > 0 for o in outputs[1:])
        # The draft, whose cache is not snapshotted, was fed each restored prompt in full.
        assert stats["catch_up_tokens"] >= sum(o.prompt_tokens for o in outputs)


async def test_batched_rows_speculate_once_alone_and_match_plain_decoding(
    tiny_model_dir: Path, near_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests decode together (no draft), the short one ends, the long one carries on
    alone (with the draft, after catching it up): both equal their plain outputs."""
    short = {"max_tokens": 4, "temperature": 0.0}
    long = {"max_tokens": 40, "temperature": 0.0}
    want_short = (await plain_outputs(tiny_model_dir, [PROMPTS[0]], **short))[0]
    want_long = (await plain_outputs(tiny_model_dir, [PROMPTS[1]], **long))[0]
    hold = hold_the_runner_intake(monkeypatch)
    # The runner takes both at one step boundary and (chunks cut by the plan alone, not by a
    # pace measured on a busy machine) prefills them in one step: they join the batch together.
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=4, draft_model=near_draft_dir, prefill_chunk_seconds=60.0
    ) as engine:
        results: dict[str, Any] = {}

        async def run(name: str, prompt: str, sampling: dict[str, Any]) -> None:
            results[name] = await engine.generate(prompt, **sampling)

        async with trio.open_nursery() as nursery:
            hold.close()
            nursery.start_soon(run, "long", PROMPTS[1], long)
            nursery.start_soon(run, "short", PROMPTS[0], short)
            await eventually(lambda: engine.get_stats()["runner"]["requests_in_flight"] == 2)
            hold.open()
        stats = engine.get_stats()
    assert results["short"].tokens == want_short.tokens
    assert results["long"].tokens == want_long.tokens
    assert "2" in stats["runner"]["batch_sizes"]  # they did decode together
    assert stats["speculative"]["speculative_steps"] > 0


@ROUTES
@pytest.mark.parametrize("drafter", ["near", "self"], ids=["draft-model", "own-first-layer"])
async def test_aborting_mid_stream_leaves_the_engine_serving_the_same_output(
    tiny_model_dir: Path, near_draft_dir: Path, max_num_seqs: int, drafter: str
) -> None:
    """With a draft model, or the target's own first layer drafting (`draft_layers`)."""
    sampling = {"max_tokens": 40, "temperature": 0.0}
    expected = (await plain_outputs(tiny_model_dir, PROMPTS[:1], **sampling))[0]
    drafting: dict[str, Any] = (
        {"draft_model": near_draft_dir} if drafter == "near" else {"draft_layers": 1}
    )
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=max_num_seqs, **drafting
    ) as engine:
        seen = 0
        async for out in engine.stream_generate(PROMPTS[0], **sampling):
            seen += len(out.new_tokens)
            if seen >= 5:
                break
        await eventually(lambda: engine.get_stats()["runner"]["live_sequences"] == 0)
        assert engine.get_stats()["runner"]["aborted"] == 1
        again = await engine.generate(PROMPTS[0], **sampling)
    assert again.tokens == expected.tokens


# ---- sampling ---------------------------------------------------------------------------------


@ROUTES
async def test_seeded_sampling_with_a_draft_is_reproducible(
    tiny_model_dir: Path, near_draft_dir: Path, max_num_seqs: int
) -> None:
    sampling = {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "min_p": 0.01, "seed": 11}
    runs = []
    for _ in range(2):
        async with trio_mlx.open_engine(
            tiny_model_dir, max_num_seqs=max_num_seqs, draft_model=near_draft_dir
        ) as engine:
            runs.append([(await engine.generate(p, **sampling)).tokens for p in PROMPTS[:2]])
            assert speculation(engine)["drafted_tokens"] > 0
    assert runs[0] == runs[1]
    assert all(len(tokens) > 0 for tokens in runs[0])


# ---- refusals ---------------------------------------------------------------------------------


async def test_a_draft_with_another_tokenizer_is_refused_at_startup(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = build_other_tokenizer_copy(tiny_model_dir, tmp_path / "other-tokenizer")
    with pytest.raises(ModelLoadError, match="must share the target's tokenizer"):
        async with trio_mlx.open_engine(tiny_model_dir, draft_model=other):
            pass  # pragma: no cover


def test_a_draft_cannot_be_combined_with_a_rotating_cache(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_kv_size"):
        trio_mlx.EngineConfig(model=tiny_model_dir, draft_model=tiny_model_dir, max_kv_size=64)


def test_num_draft_tokens_must_be_positive(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="num_draft_tokens"):
        trio_mlx.EngineConfig(model=tiny_model_dir, num_draft_tokens=0)


async def test_without_a_draft_the_stats_say_so(engine: trio_mlx.Engine) -> None:
    stats = engine.get_stats()
    assert stats["speculative"] is None and stats["acceptance_rate"] is None


@ROUTES
async def test_padded_attention_verification_gives_the_targets_greedy_output(
    tiny_model_dir: Path, near_draft_dir: Path, max_num_seqs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA default (`padded_attention`), forced on here: same output, drafts kept and not."""
    monkeypatch.setattr("trio_mlx.engine.speculative.padded_attention_default", lambda: True)
    sampling = {"max_tokens": 32, "temperature": 0.0}
    expected = await plain_outputs(tiny_model_dir, PROMPTS, **sampling)
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=max_num_seqs, draft_model=near_draft_dir
    ) as engine:
        outputs = [await engine.generate(p, **sampling) for p in PROMPTS]
        stats = speculation(engine)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert 0.0 < stats["acceptance_rate"] < 1.0


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "population", "capital"],
    "additionalProperties": False,
}


@ROUTES
async def test_a_constrained_request_decodes_without_the_draft_and_as_without_one(
    tiny_model_dir: Path, near_draft_dir: Path, max_num_seqs: int
) -> None:
    """A grammar's state cannot be rewound, so a request under an output format never
    speculates (`serial_loop._take_commands`, `Batch.can_speculate`): its output is schema-valid and
    the same as on an engine without a draft, and no token is drafted for it."""
    fmt = OutputFormat.json_schema(CITY_SCHEMA)
    sampling: dict[str, Any] = {"max_tokens": 120, "temperature": 0.0, "output_format": fmt}
    expected = await plain_outputs(tiny_model_dir, PROMPTS, **sampling)
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=max_num_seqs, draft_model=near_draft_dir, num_draft_tokens=3
    ) as engine:
        outputs = [await engine.generate(p, **sampling) for p in PROMPTS]
        constrained = dict(speculation(engine))
        plain = await engine.generate(PROMPTS[0], max_tokens=24, temperature=0.0)
        after = speculation(engine)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), CITY_SCHEMA)
    assert constrained["drafted_tokens"] == 0
    # The draft is live for a plain request on the same engine.
    assert plain.completion_tokens == 24 and after["drafted_tokens"] > 0
