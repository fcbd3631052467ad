"""SpecPrefill (`engine/specprefill.py`) on the tiny random models, serialized route.

The kept set holds the last tokens and the backbone and has the configured size; the target's
cache holds the kept tokens at their true positions (layer 0's keys depend only on the token and
its RoPE position, so they must equal a full prefill's keys at those positions); keep 1.0 gives
full prefill's output token for token; a prompt under the threshold is untouched; an abort while
the prompt is being scored frees the slot; nothing of a SpecPrefill sequence enters the prefix
cache.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio

import trio_mlx
from servers import eventually
from tiny_model import build_tiny_model
from trio_mlx.engine.decode import GenerationJob
from trio_mlx.engine.loading import load_model
from trio_mlx.engine.prompt_cache import make_cache
from trio_mlx.engine.specprefill import (
    SCORING_QUERIES,
    SpecPrefillCounters,
    SpecPrefillSequence,
    SpecPrefillSettings,
    select_positions,
)
from trio_mlx.errors import InvalidRequest
from trio_mlx.types import SamplingParams

THRESHOLD = 128
GREEDY = {"max_tokens": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random model with the same tokenizer."""
    out = tmp_path_factory.mktemp("scorers") / "small"
    return build_tiny_model(
        out, seed=7, hidden_size=32, intermediate_size=64, num_attention_heads=2
    )


def long_prompt(n: int, seed: int = 0) -> list[int]:
    """`n` token ids from the ordinary part of the vocabulary."""
    key = mx.random.key(seed)
    return [int(t) for t in mx.random.randint(200, 20000, (n,), key=key).tolist()]


def specprefill_stats(engine: trio_mlx.Engine) -> dict[str, Any]:
    stats = engine.get_stats()["specprefill"]
    assert stats is not None
    return stats


def open_specprefill(model: Path, scorer: Path, **config: Any) -> Any:
    return trio_mlx.open_engine(
        model,
        max_num_seqs=1,
        specprefill_enabled=True,
        specprefill_threshold=THRESHOLD,
        specprefill_draft_model=scorer,
        **config,
    )


# ---- selection -------------------------------------------------------------------------------


@pytest.mark.parametrize(("keep", "backbone"), [(0.3, 0.05), (0.5, 0.0), (0.1, 0.2)])
def test_the_kept_set_holds_the_tail_the_backbone_and_the_configured_fraction(
    keep: float, backbone: float
) -> None:
    n = 1000
    scores = [0.0] * n
    for p in range(320, 352):  # one chunk far above the rest
        scores[p] = 5.0
    kept = select_positions(scores, keep, backbone)
    forced = set(range(math.ceil(backbone * n))) | set(range(n - SCORING_QUERIES, n))
    assert kept == sorted(set(kept))
    assert forced <= set(kept)
    assert len(kept) == max(math.ceil(keep * n), len(forced))
    if len(forced) + 32 <= math.ceil(keep * n):
        assert set(range(320, 352)) <= set(kept)


def test_the_best_chunks_win_the_budget() -> None:
    n = 640
    scores = [0.0] * n
    high = list(range(64, 96)) + list(range(256, 288))
    for p in high:
        scores[p] = 1.0
    kept = select_positions(scores, (SCORING_QUERIES + 64) / n, 0.0)
    assert kept == sorted(high + list(range(n - SCORING_QUERIES, n)))


# ---- the sequence on its own -----------------------------------------------------------------


def test_the_target_cache_holds_the_kept_tokens_at_their_true_positions(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    target = load_model(tiny_model_dir)
    scorer = load_model(scorer_dir)
    prompt = long_prompt(300)
    job = GenerationJob(1, tuple(prompt), SamplingParams(max_tokens=3, temperature=0.0))
    counters = SpecPrefillCounters()
    seq = SpecPrefillSequence(
        job,
        target.model,
        scorer.model,
        SpecPrefillSettings(enabled=True, threshold=THRESHOLD, keep_pct=0.4, backbone_pct=0.1),
        counters,
        target.eos_token_ids,
        vocab_size=len(target.tokenizer),
        chunk_tokens=50,
    )
    steps = 0
    while seq.in_prefill and steps < 100:
        seq.step(50)
        steps += 1
    kept = seq.kept_positions
    assert kept is not None and not seq.in_prefill
    assert counters.scoring_chunks >= (300 - SCORING_QUERIES) // 50 + 1
    assert counters.kept_tokens == len(kept) == math.ceil(0.4 * 300)
    assert kept[: math.ceil(0.1 * 300)] == list(range(30))
    assert kept[-SCORING_QUERIES:] == list(range(300 - SCORING_QUERIES, 300))
    assert len(set(kept) - set(range(30)) - set(range(268, 300))) > 0

    full = make_cache(target.model)
    target.model(mx.array(prompt)[None], cache=full)
    full_keys = full[0].keys[..., :300, :]
    sparse = seq.cache[0]
    sparse_keys = sparse.keys_and_values()[0][:, :, : len(kept)]
    assert mx.allclose(sparse_keys, full_keys[:, :, mx.array(kept)], atol=1e-4).item()
    # Wrong positions would give other keys: the check can fail.
    assert not mx.allclose(sparse_keys, full_keys[:, :, : len(kept)], atol=1e-4).item()
    # Decoding continues from the full prompt's length: generated token i sits at 300 + i.
    assert sparse.offset - sparse.stored == 300 - len(kept)
    while not seq.finished and steps < 200:
        seq.step()
        steps += 1
    assert sparse.stored > len(kept)
    assert sparse.offset - sparse.stored == 300 - len(kept)


def _sparse_prefill(target: Any, scorer: Any, prompt: list[int], *, positioned: bool) -> Any:
    job = GenerationJob(1, tuple(prompt), SamplingParams(max_tokens=4, temperature=0.0))
    seq = SpecPrefillSequence(
        job,
        target.model,
        scorer.model,
        SpecPrefillSettings(enabled=True, threshold=THRESHOLD, keep_pct=0.3, backbone_pct=0.05),
        SpecPrefillCounters(),
        target.eos_token_ids,
        vocab_size=len(target.tokenizer),
        chunk_tokens=64,
    )
    seq._sparse.positioned = positioned
    passes = 0
    while seq.kept_positions is None or seq.in_prefill:
        result = seq.step(64)
        passes += result.prefilled > 0
        assert passes < 100
    return seq, passes


def test_chunks_spanning_gaps_equal_the_run_by_run_prefill(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    """Kept tokens fed in full chunks, each rotated by its own position (`PositionedRoPE`), give
    every layer's cache of the one-pass-per-run route, in fewer passes."""
    target = load_model(tiny_model_dir)
    scorer = load_model(scorer_dir)
    prompt = long_prompt(400, seed=3)
    chunked, chunk_passes = _sparse_prefill(target, scorer, prompt, positioned=True)
    runs, run_passes = _sparse_prefill(target, scorer, prompt, positioned=False)
    kept = chunked.kept_positions
    assert kept == runs.kept_positions
    # (the last pass is the decoder's, over the prompt's last token)
    assert chunk_passes == math.ceil((len(kept) - 1) / 64) + 1 < run_passes
    n = len(kept)
    for a, b in zip(chunked.cache, runs.cache, strict=True):
        keys_a, values_a = a.keys_and_values()
        keys_b, values_b = b.keys_and_values()
        assert mx.allclose(keys_a[:, :, :n], keys_b[:, :, :n], atol=1e-4).item()
        assert mx.allclose(values_a[:, :, :n], values_b[:, :, :n], atol=1e-4).item()


# ---- through the engine ----------------------------------------------------------------------


async def test_keep_one_gives_full_prefills_output_token_for_token(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    prompts = [long_prompt(400, seed=s) for s in range(2)]
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        expected = [await engine.generate(p, **GREEDY) for p in prompts]
    async with open_specprefill(tiny_model_dir, scorer_dir, specprefill_keep_pct=1.0) as engine:
        outputs = [await engine.generate(p, **GREEDY) for p in prompts]
        stats = specprefill_stats(engine)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert stats["requests"] == 2
    assert stats["kept_fraction"] == 1.0
    assert stats["skipped_tokens"] == 0


async def test_a_prompt_under_the_threshold_is_prefilled_in_full(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    prompt = long_prompt(THRESHOLD - 1)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=1) as engine:
        expected = await engine.generate(prompt, **GREEDY)
    async with open_specprefill(tiny_model_dir, scorer_dir) as engine:
        output = await engine.generate(prompt, **GREEDY)
        stats = specprefill_stats(engine)
    assert output.tokens == expected.tokens
    assert stats["requests"] == 0 and stats["scoring_chunks"] == 0


async def test_the_configured_and_requested_fractions_are_kept(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    prompt = long_prompt(500)
    async with open_specprefill(tiny_model_dir, scorer_dir) as engine:
        first = await engine.generate(prompt, **GREEDY)
        stats = specprefill_stats(engine)
        assert stats["kept_tokens"] == math.ceil(0.3 * 500)
        assert stats["skipped_tokens"] == 500 - math.ceil(0.3 * 500)
        assert len(first.tokens) > 0
        await engine.generate(prompt, specprefill_keep_pct=0.6, **GREEDY)
        assert specprefill_stats(engine)["kept_tokens"] == stats["kept_tokens"] + 300
        await engine.generate(prompt, specprefill=False, **GREEDY)
        after = specprefill_stats(engine)
        assert after["requests"] == 2
        # Nothing of the two SpecPrefill requests was snapshotted; the full one was.
        assert engine.get_cache_stats()["entries"] >= 1
        with pytest.raises(InvalidRequest) as info:
            engine.prepare_generate(prompt, specprefill_keep_pct=1.5)
        assert info.value.param == "specprefill_keep_pct"


async def test_specprefill_sequences_store_nothing_in_the_prefix_cache(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    prompt = long_prompt(300)
    async with open_specprefill(tiny_model_dir, scorer_dir) as engine:
        await engine.generate(prompt, **GREEDY)
        await engine.generate(prompt, **GREEDY)
        cache = engine.get_cache_stats()
        assert specprefill_stats(engine)["requests"] == 2
    assert cache["entries"] == 0
    assert cache["snapshots_taken"] == 0


async def test_an_abort_while_scoring_frees_the_slot(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    prompt = long_prompt(1000)
    async with open_specprefill(tiny_model_dir, scorer_dir, prefill_step_size=16) as engine:
        with trio.CancelScope() as scope:

            async def consume() -> None:
                async for _ in engine.stream_generate(prompt, **GREEDY):
                    pass

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                await eventually(lambda: specprefill_stats(engine)["scoring_chunks"] >= 2)
                scope.cancel()
        await eventually(lambda: engine.get_stats()["runner"]["live_sequences"] == 0)
        stats = engine.get_stats()
        assert stats["runner"]["aborted"] == 1
        assert stats["specprefill"]["requests"] == 0  # never got past scoring
        output = await engine.generate(long_prompt(200), **GREEDY)
    assert len(output.tokens) > 0


def test_specprefill_needs_a_scoring_model(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="scoring model"):
        trio_mlx.EngineConfig(model=tiny_model_dir, specprefill_enabled=True)
