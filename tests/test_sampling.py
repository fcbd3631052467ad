"""Sampling controls, logprobs, logits processors that retire, thinking budget, reasoning split.

Each sampler's effect is checked against a direct computation on logits; end-to-end behaviour runs
through the real engine on the tiny model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache

import trio_mlx
from model_wrappers import ScriptedModel, wrapping_loader
from trio_mlx.engine import row_sampling, sampling
from trio_mlx.engine.sampling import TokenSelector, fresh_seed
from trio_mlx.types import SamplingParams

PROMPT = "The meaning of life is"


# ---- the selector against direct computations ----------------------------------------------


def row_params(*rows: SamplingParams) -> row_sampling.RowParams:
    """The rows' filters as the selectors give them."""
    filters = [TokenSelector(p, 8, []).filters for p in rows]
    return row_sampling.RowParams(*(list(column) for column in zip(*filters, strict=True)))


def kept(params: SamplingParams, logits: np.ndarray) -> set[int]:
    """Indices the selector's filters leave finite."""
    filtered = np.array(row_sampling.filtered(mx.array(logits[None]), row_params(params)))[0]
    return {int(i) for i in np.nonzero(np.isfinite(filtered))[0]}


LOGITS = np.array([2.0, 1.0, 0.5, 3.0, -1.0, 2.5, 0.0, 1.5], dtype=np.float32)


def test_top_k_keeps_the_k_largest() -> None:
    assert kept(SamplingParams(temperature=1.0, top_k=3), LOGITS) == {3, 5, 0}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = np.exp(LOGITS) / np.exp(LOGITS).sum()
    order = np.argsort(-probs)
    mass = np.cumsum(probs[order])
    expected = {
        int(i) for i, before in zip(order, mass - probs[order], strict=True) if before < 0.8
    }
    assert kept(SamplingParams(temperature=1.0, top_p=0.8), LOGITS) == expected


def test_min_p_masks_tokens_below_a_fraction_of_the_best() -> None:
    probs = np.exp(LOGITS) / np.exp(LOGITS).sum()
    expected = {int(i) for i in np.nonzero(probs >= 0.3 * probs.max())[0]}
    assert kept(SamplingParams(temperature=1.0, min_p=0.3), LOGITS) == expected


ROW_PARAMS = (
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=2.0, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=100),  # past the width: every token
)


def test_rows_sampled_together_draw_what_each_draws_alone() -> None:
    """A batch's sampled rows in one pass, each with its own filters and uniform number, give
    each row the token it gets alone (the serialized route's one-row pass): a row's draw never
    depends on its companions or on the filters they use."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        logits = mx.array(rng.normal(size=(len(ROW_PARAMS), 8)).astype(np.float32) * 2.0)
        uniforms = [row_sampling.draw(trial, i) for i in range(len(ROW_PARAMS))]
        together = row_sampling.sample(logits, row_params(*ROW_PARAMS), uniforms).tolist()
        alone = [
            row_sampling.sample(logits[i : i + 1], row_params(p), [uniforms[i]]).item()
            for i, p in enumerate(ROW_PARAMS)
        ]
        assert together == alone


def test_the_draws_follow_the_filtered_softmax() -> None:
    """Inverse-transform draws at `draw`'s uniform numbers: each token's frequency over 40,000
    draws is its probability (within 5 standard errors), and a filtered-out token never comes."""
    n = 40_000
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.8)):
        filtered = np.array(row_sampling.filtered(mx.array(LOGITS[None]), row_params(params)))[0]
        probs = np.exp(filtered - filtered.max())
        probs /= probs.sum()
        logits = mx.broadcast_to(mx.array(LOGITS[None]), (n, len(LOGITS)))
        uniforms = [row_sampling.draw(12345, i) for i in range(n)]
        tokens = np.array(row_sampling.sample(logits, row_params(params), uniforms))
        counts = np.bincount(tokens, minlength=len(LOGITS))
        for token, p in enumerate(probs):
            if p == 0:
                assert counts[token] == 0
            else:
                assert abs(counts[token] / n - p) < 5 * np.sqrt(p * (1 - p) / n)


def test_a_draw_is_strictly_inside_zero_and_one_and_follows_its_seed() -> None:
    draws = [row_sampling.draw(seed, n) for seed in (0, 1, -5, 2**70 + 3) for n in range(500)]
    assert all(0.0 < u < 1.0 for u in draws)
    assert row_sampling.draw(7, 3) == row_sampling.draw(7, 3) != row_sampling.draw(8, 3)
    assert row_sampling.draw(-1, 0) == row_sampling.draw(2**64 - 1, 0)  # modulo 2**64
    assert len(set(draws)) > 1900  # 2,000 draws, a grid of 2**23 values


def test_penalties_follow_their_definitions() -> None:
    params = SamplingParams(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((6, 3.0),)
    )
    selector = TokenSelector(params, len(LOGITS), prompt=[0, 4])
    for token in (3, 3, 5):
        selector.observe(mx.array([token]))
    got = np.array(selector.adjust(mx.array(LOGITS[None])))[0]
    expected = LOGITS.copy()
    expected[6] += 3.0
    for t in (0, 4, 3, 5):  # prompt and output tokens: repetition penalty
        expected[t] = expected[t] / 2.0 if expected[t] > 0 else expected[t] * 2.0
    counts = {3: 2, 5: 1}  # output tokens only: presence and frequency
    for t, n in counts.items():
        expected[t] -= 0.5 + 0.25 * n
    np.testing.assert_allclose(got, expected, rtol=1e-6)


# ---- through the engine ----------------------------------------------------------------------


async def test_top_k_1_is_greedy(engine: trio_mlx.Engine) -> None:
    greedy = await engine.generate(PROMPT, max_tokens=12, temperature=0.0)
    sampled = await engine.generate(PROMPT, max_tokens=12, temperature=1.0, top_p=1.0, top_k=1)
    assert sampled.tokens == greedy.tokens


async def test_a_request_without_a_seed_draws_from_fresh_seed(
    engine: trio_mlx.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unseeded request's draws come from `sampling.fresh_seed()` (random in a server; the
    suite pins it, `conftest.unseeded_draws_repeat`): the seed it gives draws what a request
    naming that seed draws."""
    monkeypatch.setattr(sampling, "fresh_seed", lambda: 4242)
    hot = {"max_tokens": 24, "temperature": 2.0, "top_p": 1.0}
    unseeded = await engine.generate(PROMPT, **hot)
    seeded = await engine.generate(PROMPT, **hot, seed=4242)
    other = await engine.generate(PROMPT, **hot, seed=4243)
    assert unseeded.tokens == seeded.tokens != other.tokens


def test_outside_the_suite_each_unseeded_request_gets_a_seed_of_its_own() -> None:
    # `fresh_seed` as imported at collection, before the conftest fixture pins the module's
    assert len({fresh_seed() for _ in range(8)}) == 8
    assert sampling.fresh_seed is not fresh_seed  # pinned in this test


async def test_a_large_logit_bias_forces_a_token(engine: trio_mlx.Engine) -> None:
    out = await engine.generate(
        PROMPT, max_tokens=5, temperature=1.0, top_p=1.0, logit_bias={"1234": 100}, seed=1
    )
    assert out.tokens == [1234] * 5
    banned = await engine.generate(PROMPT, max_tokens=1, temperature=0.0)
    avoided = await engine.generate(
        PROMPT, max_tokens=1, temperature=0.0, logit_bias={banned.tokens[0]: -100}
    )
    assert avoided.tokens != banned.tokens


async def test_a_repetition_penalty_changes_a_repetitive_greedy_output(
    engine: trio_mlx.Engine,
) -> None:
    plain = await engine.generate(PROMPT, max_tokens=40, temperature=0.0)
    penalised = await engine.generate(
        PROMPT, max_tokens=40, temperature=0.0, repetition_penalty=10.0
    )
    assert len(set(penalised.tokens)) >= len(set(plain.tokens))
    assert len(set(penalised.tokens)) == len(penalised.tokens)  # nothing repeats at 10x


async def test_logprobs_are_the_models_log_softmax_for_the_chosen_tokens(
    engine: trio_mlx.Engine, tiny_model_dir: Path
) -> None:
    out = await engine.generate(
        PROMPT, max_tokens=6, temperature=1.0, top_p=1.0, seed=5, logprobs=True, top_logprobs=4
    )
    assert out.logprobs is not None and len(out.logprobs) == 6
    prompt = list(engine.prepare_generate(PROMPT).prompt_tokens)
    model, _ = mlx_lm.load(str(tiny_model_dir))
    logits = model(mx.array([prompt + out.tokens]))[0].astype(mx.float32)
    reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for i, entry in enumerate(out.logprobs):
        row = reference[len(prompt) - 1 + i]
        assert entry.token == out.tokens[i]
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=1e-4)
        best = np.argsort(-row)[:4]
        assert [t for t, _ in entry.top] == [int(t) for t in best]
        assert [v for _, v in entry.top] == pytest.approx([float(row[t]) for t in best], abs=1e-4)


async def test_streamed_logprobs_line_up_with_streamed_tokens(engine: trio_mlx.Engine) -> None:
    seen = []
    async for out in engine.stream_generate(PROMPT, max_tokens=8, temperature=0.0, logprobs=True):
        assert out.new_logprobs is not None
        assert [lp.token for lp in out.new_logprobs] == out.new_tokens
        seen.extend(out.new_logprobs)
    assert len(seen) == 8 and all(lp.top == () for lp in seen)


class CountingProcessor:
    """Identity processor that retires after `lifetime` calls."""

    def __init__(self, lifetime: int, force: int | None = None) -> None:
        self.lifetime = lifetime
        self.force = force
        self.calls = 0
        self.lengths: list[int] = []

    @property
    def is_retired(self) -> bool:
        return self.calls >= self.lifetime

    def __call__(self, tokens: Any, logits: Any) -> Any:
        self.calls += 1
        self.lengths.append(int(tokens.shape[0]))
        if self.force is None:
            return logits
        return mx.where(mx.arange(logits.shape[-1]) == self.force, 100.0, logits)


async def test_a_retiring_processor_stops_being_called_and_changes_nothing(
    engine: trio_mlx.Engine,
) -> None:
    plain = await engine.generate(PROMPT, max_tokens=20, temperature=0.0)
    processor = CountingProcessor(lifetime=4)
    out = await engine.generate(
        PROMPT, max_tokens=20, temperature=0.0, logits_processors=[processor]
    )
    assert out.tokens == plain.tokens
    assert processor.calls == 4
    prompt_length = len(engine.prepare_generate(PROMPT).prompt_tokens)
    # It saw the whole prompt plus every token generated before each call.
    assert processor.lengths == [prompt_length + i for i in range(4)]


async def test_a_processor_shapes_tokens_until_it_retires(engine: trio_mlx.Engine) -> None:
    plain = await engine.generate(PROMPT, max_tokens=10, temperature=0.0)
    out = await engine.generate(
        PROMPT,
        max_tokens=10,
        temperature=0.0,
        logits_processors=[CountingProcessor(lifetime=3, force=777)],
    )
    assert out.tokens[:3] == [777, 777, 777]
    assert out.tokens != plain.tokens


async def test_the_thinking_budget_forces_the_end_of_thinking_then_retires(
    engine: trio_mlx.Engine,
) -> None:
    prompt = "Question: why?<think>"
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    request = engine.prepare_generate(
        prompt, max_tokens=20, temperature=0.0, thinking_token_budget=5, reasoning=True
    )
    budget = request.logits_processors[-1]
    async with engine.open_stream(request) as stream:
        outputs = [o async for o in stream]
    final = outputs[-1]
    assert final.tokens[5 : 5 + len(end)] == end
    assert budget.is_retired  # type: ignore[attr-defined]
    assert budget.calls == 5 + len(end) + 1  # type: ignore[attr-defined]
    reasoning_part = engine.tokenizer.decode(final.tokens[:5])
    assert final.reasoning == reasoning_part
    assert "</think>" not in final.text and "</think>" not in final.reasoning
    assert final.text == engine.tokenizer.decode(final.tokens[5 + len(end) :])


async def test_reasoning_is_split_from_the_answer_while_streaming(tiny_model_dir: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_dir) as probe:
        script = probe.tokenizer.encode(
            "<think>Paris is in France.</think>It is Paris.", add_special_tokens=False
        )
        prompt = list(probe.prepare_generate("Capital of France?").prompt_tokens)
    loader, _ = wrapping_loader(lambda m: ScriptedModel(m, len(prompt), script))
    async with trio_mlx.open_engine(tiny_model_dir, loader=loader) as engine:
        outputs = [
            o
            async for o in engine.stream_generate(
                prompt, max_tokens=len(script), temperature=0.0, reasoning=True
            )
        ]
    assert "".join(o.new_reasoning for o in outputs) == "Paris is in France."
    assert "".join(o.new_text for o in outputs) == "It is Paris."
    assert outputs[-1].reasoning == "Paris is in France." and outputs[-1].text == "It is Paris."
    assert all("<" not in o.new_text + o.new_reasoning for o in outputs)


async def test_a_rotating_kv_cache_matches_mlx_lm_past_its_size(tiny_model_dir: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, max_kv_size=32, max_num_seqs=1) as engine:
        prompt = list(engine.prepare_generate(PROMPT).prompt_tokens)
        out = await engine.generate(prompt, max_tokens=60, temperature=0.0)
    model, _ = mlx_lm.load(str(tiny_model_dir))
    # Rotating caches built explicitly: mlx-lm's `max_kv_size=` is ignored for llama (its own
    # `make_cache` wins), which would compare against an unbounded cache.
    rotating = [RotatingKVCache(max_size=32, keep=4) for _ in model.layers]
    reference = [
        t for t, _ in generate_step(mx.array(prompt), model, max_tokens=60, prompt_cache=rotating)
    ]
    assert out.tokens == reference[: len(out.tokens)]
    assert out.completion_tokens == 60
    assert all(c.keys.shape[2] == 32 for c in rotating)


async def test_a_server_wide_max_tokens_limit_refuses_larger_requests(tiny_model_dir: Path) -> None:
    async with trio_mlx.open_engine(tiny_model_dir, max_tokens_limit=8) as engine:
        with pytest.raises(trio_mlx.InvalidRequest) as info:
            engine.prepare_generate(PROMPT, max_tokens=9)
        assert info.value.param == "max_tokens"
        assert engine.prepare_generate(PROMPT).params.max_tokens == 8


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ],
)
async def test_each_rejected_value_names_its_parameter(
    engine: trio_mlx.Engine, options: dict[str, Any], param: str
) -> None:
    with pytest.raises(trio_mlx.InvalidRequest) as info:
        engine.prepare_generate(PROMPT, **options)
    assert info.value.param == param


def test_logits_wider_than_the_vocabulary_still_get_the_bias_and_penalties() -> None:
    params = SamplingParams(
        max_tokens=4,
        temperature=0.0,
        logit_bias=((3, 50.0),),
        frequency_penalty=2.0,
    )
    selector = TokenSelector(params, vocab_size=8, prompt=[1, 2])
    logits = mx.zeros((1, 12))  # an output layer padded to 12
    adjusted = selector.adjust(logits)
    assert adjusted.shape == (1, 12)
    assert adjusted[0, 3].item() == 50.0 and adjusted[0, 11].item() == 0.0
    token = selector.choose(adjusted)
    assert token.item() == 3
    again = selector.adjust(logits)
    assert again[0, 3].item() == 48.0  # the frequency penalty applied to the chosen token


def test_logits_narrower_than_the_vocabulary_refuse_the_bias_clearly() -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, logit_bias=((3, 5.0),))
    selector = TokenSelector(params, vocab_size=8, prompt=[1])
    with pytest.raises(ValueError, match="fewer than its vocabulary"):
        selector.adjust(mx.zeros((1, 6)))
