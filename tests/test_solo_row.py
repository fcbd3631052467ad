"""A lone row of the decode batch on its own cache (`BatchDecoder.solo`, engine/batch.py), driven
step by step on the tiny fp32 model: alone it decodes on the serialized route's cache; a second
row joining merges it into a batch cache; the batch falling back to one row gives it its own
cache again; and through every change each sequence's greedy tokens are mlx-lm's alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache

from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.types import SamplingParams

LONG = tuple(range(5, 45))
SHORT = tuple(range(100, 112))


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


def alone(loaded: LoadedModel, prompt: tuple[int, ...], n: int) -> list[int]:
    """mlx-lm's greedy tokens for `prompt`, the reference."""
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=n)
    return [int(token) for token, _ in steps]


def decoder(loaded: LoadedModel) -> BatchDecoder:
    return BatchDecoder(
        loaded.model, frozenset(), vocab_size=len(loaded.tokenizer), plan=PrefillPlan(2048)
    )


def admit(batch: BatchDecoder, request_id: int, prompt: tuple[int, ...], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    batch.add(GenerationJob(request_id, prompt, params), None, 0)
    while batch.waiting:
        batch.prefill(4096, 60.0)
        batch.join()


def step(batch: BatchDecoder, tokens: dict[int, list[int]], kinds: list[str]) -> None:
    if batch.rows:
        kinds.append(type(batch._cache[0]).__name__)
    for result in batch.decode():
        assert result.error is None
        tokens.setdefault(result.seq.request_id, []).extend(result.tokens)


@pytest.mark.usefixtures("batch_pipeline")
def test_a_lone_row_joined_and_left_keeps_every_sequence_token_for_token(
    loaded: LoadedModel,
) -> None:
    batch = decoder(loaded)
    tokens: dict[int, list[int]] = {}
    kinds: list[str] = []
    admit(batch, 1, LONG, 20)
    assert batch.solo and type(batch._cache[0]) is KVCache
    for _ in range(5):
        step(batch, tokens, kinds)
    assert set(kinds) == {"KVCache"}
    # A second row of another length joins: one batch cache, padded.
    admit(batch, 2, SHORT, 4)
    assert not batch.solo and type(batch._cache[0]) is BatchKVCache
    assert len(batch.rows) == 2
    while len(tokens.get(2, [])) < 4:
        step(batch, tokens, kinds)
    # The short one finished: the long one goes on alone, on its own cache again.
    while batch.busy:
        step(batch, tokens, kinds)
    assert "BatchKVCache" in kinds and kinds[-1] == "KVCache"
    assert tokens[1] == alone(loaded, LONG, 20)
    assert tokens[2] == alone(loaded, SHORT, 4)


def test_a_finished_lone_row_hands_over_its_cache_with_its_fed_tokens(
    loaded: LoadedModel, batch_pipeline: bool
) -> None:
    """The lone row's cache is the one its snapshot is taken from: it holds the fed tokens,
    every generated one where pipelined (the last was fed to the step queued before it was
    read), all but the last where each step is read at once (no step after the last)."""
    batch = decoder(loaded)
    tokens: dict[int, list[int]] = {}
    admit(batch, 1, SHORT, 6)
    finished: list[Any] = []
    while batch.busy:
        for result in batch.decode():
            tokens.setdefault(1, []).extend(result.tokens)
            if result.finish is not None:
                finished.append(result.seq)
    (seq,) = finished
    assert seq.cache is not None and type(seq.cache[0]) is KVCache
    fed = len(SHORT) + (6 if batch_pipeline else 5)
    assert seq.cache[0].offset == len(seq.fed_tokens()) == fed
    assert not batch.solo and batch._cache == []


def test_with_solo_rows_off_a_lone_row_stays_in_a_batch_cache(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(BatchDecoder, "solo_rows", False)
    batch = decoder(loaded)
    tokens: dict[int, list[int]] = {}
    kinds: list[str] = []
    admit(batch, 1, LONG, 8)
    while batch.busy:
        step(batch, tokens, kinds)
    assert set(kinds) == {"BatchKVCache"}
    assert tokens[1] == alone(loaded, LONG, 8)
