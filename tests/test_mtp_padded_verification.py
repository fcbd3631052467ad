"""Speculative verification (MTP, and a draft model) through the padded pass
(`engine/padded_attention.py`, on by default on MLX's CUDA backend), forced here on the CPU: for
every MTP family it computes what the plain pass computes: DeepSeek-V3 and GLM-4.7-Flash (MLA
attention, which takes its mask as a boolean condition: the additive mask it once got hid exactly
the positions it should show), GLM-4.5 MoE and MiMo (ordinary attention, additive mask); and greedy
decoding through it, with the MTP layer or a draft model, is the plain greedy output."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from tiny_mtp_model import FAMILIES, build_tiny_mtp_model
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.engine.padded_attention import padded_forward, takes_boolean_mask
from trio_mlx.engine.prompt_cache import make_cache

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    family = str(request.param)
    path = build_tiny_mtp_model(tmp_path_factory.mktemp(family) / "m", family=family)
    return family, load_model(path, mtp=True)


def prefilled(model: Any, length: int) -> list[Any]:
    cache = make_cache(model)
    model(mx.arange(3, 3 + length)[None].astype(mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_the_mask_kind_follows_the_attention(loaded: Any) -> None:
    family, model = loaded[0], loaded[1].model
    mla = family in ("deepseek_v3", "glm4_moe_lite")
    assert takes_boolean_mask(model) is mla
    assert takes_boolean_mask(model.model) is mla


@pytest.mark.parametrize("length", [7, 300])  # within the first buffer, and past it
def test_a_padded_pass_equals_the_plain_one(loaded: Any, length: int) -> None:
    model = loaded[1].model
    tokens = mx.array([[11, 12, 13, 14, 15]], dtype=mx.uint32)
    plain = model(tokens, cache=prefilled(model, length))
    padded = padded_forward(model, tokens, prefilled(model, length))
    assert mx.allclose(plain, padded, atol=1e-4).item()
    assert mx.array_equal(mx.argmax(plain, -1), mx.argmax(padded, -1)).item()


def greedy_tokens(loaded: LoadedModel, *, pad_attention: bool) -> tuple[list[int], Any]:
    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.engine.mtp import MtpDrafter
    from trio_mlx.engine.speculative import Speculator
    from trio_mlx.engine.speculative_sequence import SpeculativeSequence
    from trio_mlx.types import SamplingParams

    model = loaded.model
    drafter = MtpDrafter(model)
    speculator = Speculator(model, drafter, num_draft_tokens=3, pad_attention=pad_attention)
    prompt = list(loaded.tokenizer.encode(PROMPT))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    sequence = SpeculativeSequence(
        speculator,
        GenerationJob(request_id=1, prompt_tokens=tuple(prompt), params=params),
        model,
        frozenset(),  # no EOS: every run goes the whole 24 tokens
        PrefillPlan(8),
        vocab_size=49152,
    )
    tokens: list[int] = []
    for _ in range(100):
        if sequence.finished:
            break
        tokens.extend(sequence.step().tokens)
    return tokens, speculator.counters


def plain_greedy(loaded: LoadedModel, n: int) -> list[int]:
    model = loaded.model
    cache = make_cache(model)
    tokens = list(loaded.tokenizer.encode(PROMPT))
    logits = model(mx.array([tokens], dtype=mx.uint32), cache=cache)
    out: list[int] = []
    for _ in range(n):
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        logits = model(mx.array([[token]], dtype=mx.uint32), cache=cache)
    return out


def test_greedy_mtp_decoding_through_the_padded_pass_is_the_plain_output(loaded: Any) -> None:
    model = loaded[1]
    padded, counters = greedy_tokens(model, pad_attention=True)
    unpadded, _ = greedy_tokens(model, pad_attention=False)
    assert counters.steps > 0 and counters.drafted_tokens > 0
    assert padded == unpadded == plain_greedy(model, 24)


def test_a_padded_pass_over_a_batch_cache_equals_the_plain_one(loaded: Any) -> None:
    """The boolean mask (MLA) and the additive one both hide each row's left padding."""
    model = loaded[1].model
    rows = [prefilled(model, 9), prefilled(model, 40)]
    merged = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    again = [rows[0][i].merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    tokens = mx.array([[5, 6, 7], [8, 9, 10]], dtype=mx.uint32)
    plain = model(tokens, cache=merged)
    padded = padded_forward(model, tokens, again)
    assert mx.allclose(plain, padded, atol=1e-4).item()


def test_a_draft_model_speculating_through_the_padded_pass_keeps_the_greedy_output(
    loaded: Any,
) -> None:
    """The same fix serves draft-model speculation (`speculative.ModelDrafter`, whose
    verification and multi-token draft passes are padded too): the model drafting for itself."""
    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.engine.speculative import Speculator
    from trio_mlx.engine.speculative_sequence import SpeculativeSequence
    from trio_mlx.types import SamplingParams

    target = loaded[1]
    speculator = Speculator(target.model, target.model, num_draft_tokens=3, pad_attention=True)
    prompt = tuple(target.tokenizer.encode(PROMPT))
    sequence = SpeculativeSequence(
        speculator,
        GenerationJob(
            request_id=1,
            prompt_tokens=prompt,
            params=SamplingParams(max_tokens=24, temperature=0.0),
        ),
        target.model,
        frozenset(),
        PrefillPlan(8),
        vocab_size=49152,
    )
    tokens: list[int] = []
    for _ in range(100):
        if sequence.finished:
            break
        tokens.extend(sequence.step().tokens)
    counters = speculator.counters
    assert counters.drafted_tokens > 0
    assert counters.accepted_tokens == counters.drafted_tokens  # a self-draft is always right
    assert tokens == plain_greedy(target, 24)
