"""Several arrivals prefilled in one forward pass (`engine/batch_prefill.py`), on the tiny fp32
model: the group's pass is one pass, each sequence's cache then holds exactly its prefix and
prompt with the keys of a prefill alone, cached prefixes of different lengths take part, and
every sequence's greedy tokens are mlx-lm's alone; what cannot be grouped prefills alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

from model_wrappers import FaultyModel, _Wrapped
from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.engine.batch_prefill import choose_group
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.types import SamplingParams

PROMPTS = [tuple(range(5, 5 + n)) for n in (9, 23, 14, 31)]


class PassLog(_Wrapped):
    """The real model, noting the shape (rows, tokens) of every multi-token pass."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.passes: list[tuple[int, int]] = []

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        if tokens.shape[1] > 1:
            self.passes.append((int(tokens.shape[0]), int(tokens.shape[1])))
        return self._inner(tokens, cache=cache)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


@pytest.fixture(autouse=True)
def grouping_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Group prefill is on by default only with padded prefill chunks (MLX's CUDA backend,
    `BatchDecoder.group_prefill`); these tests switch it on."""
    monkeypatch.setattr(BatchDecoder, "group_prefill", True)


def alone(loaded: LoadedModel, prompt: tuple[int, ...], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), loaded.model, max_tokens=n)
    return [int(token) for token, _ in steps]


def prefix_cache(loaded: LoadedModel, tokens: tuple[int, ...]) -> list[Any]:
    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def run(batch: BatchDecoder) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    while batch.busy:
        if batch.waiting:
            batch.prefill(4096, 60.0)
            batch.join()
        for result in batch.decode():
            assert result.error is None
            tokens.setdefault(result.seq.request_id, []).extend(result.tokens)
    return tokens


def decoder(model: Any, loaded: LoadedModel, plan: PrefillPlan | None = None) -> BatchDecoder:
    return BatchDecoder(
        model,
        frozenset(),
        vocab_size=len(loaded.tokenizer),
        plan=plan or PrefillPlan(64),
        split_at_store_points=False,
    )


#: Chunks of 64 in blocks of 8: rests count in whole blocks, as with a GPU's padded chunks.
BLOCKS_OF_8 = PrefillPlan(64, tail=64, block=8)


def job(i: int, prompt: tuple[int, ...], max_tokens: int = 10, **kw: Any) -> GenerationJob:
    return GenerationJob(i, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), **kw)


def test_arrivals_prefill_in_one_pass_and_decode_as_alone(loaded: LoadedModel) -> None:
    model = PassLog(loaded.model)
    batch = decoder(model, loaded)
    for i, prompt in enumerate(PROMPTS):
        batch.add(job(i, prompt), None, 0)
    results = batch.prefill(4096, 60.0)
    assert model.passes == [(4, max(len(p) for p in PROMPTS) - 1)]
    assert [r.prefilled for r in results] == [len(p) - 1 for p in PROMPTS]
    assert all(r.grouped for r in results)
    for seq, prompt in zip(batch.waiting, PROMPTS, strict=True):
        assert seq.ready and seq.cache is not None
        assert [type(c) for c in seq.cache] == [KVCache] * len(seq.cache)
        # exactly its prompt but the last token, with the keys of a prefill of its own
        own = prefix_cache(loaded, prompt[:-1])
        for mine, reference in zip(seq.cache, own, strict=True):
            assert mine.offset == len(prompt) - 1
            keys = mine.keys[..., : mine.offset, :]
            assert mx.allclose(keys, reference.keys[..., : reference.offset, :], atol=1e-5)
    assert batch.join() == 4
    tokens = run(batch)
    assert [tokens[i] for i in range(4)] == [alone(loaded, p, 10) for p in PROMPTS]


def test_cached_prefixes_of_different_lengths_take_part(loaded: LoadedModel) -> None:
    model = PassLog(loaded.model)
    batch = decoder(model, loaded)
    cached = [0, 7, 3, 20]
    for i, (prompt, n) in enumerate(zip(PROMPTS, cached, strict=True)):
        cache = prefix_cache(loaded, prompt[:n]) if n else None
        batch.add(job(i, prompt, store_points=(len(prompt) - 1,)), cache, n)
    results = batch.prefill(4096, 60.0)
    assert len(model.passes) == 1 and model.passes[0][0] == 4
    assert [r.prefilled for r in results] == [
        len(p) - 1 - n for p, n in zip(PROMPTS, cached, strict=True)
    ]
    assert [r.store_points for r in results] == [(len(p) - 1,) for p in PROMPTS]
    batch.join()
    tokens = run(batch)
    assert [tokens[i] for i in range(4)] == [alone(loaded, p, 10) for p in PROMPTS]


def test_what_cannot_be_grouped_prefills_alone(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One arrival: nothing to group.
    batch = decoder(loaded.model, loaded)
    batch.add(job(0, PROMPTS[0]), None, 0)
    assert choose_group(batch.waiting, 4096, 64, 1) == []
    # A prompt longer than a chunk (64 here) prefills by chunks; the short ones go together.
    model = PassLog(loaded.model)
    batch = decoder(model, loaded)
    long = tuple(range(300, 400))
    batch.add(job(0, PROMPTS[0]), None, 0)
    batch.add(job(1, long), None, 0)
    batch.add(job(2, PROMPTS[1]), None, 0)
    assert [s.request_id for s in choose_group(batch.waiting, 4096, 64, 1)] == [0, 2]
    tokens = run(batch)
    assert model.passes[0] == (2, len(PROMPTS[1]) - 1)
    assert (1, 64) in model.passes  # the long one's first chunk, alone
    assert [tokens[0], tokens[1], tokens[2]] == [
        alone(loaded, PROMPTS[0], 10),
        alone(loaded, long, 10),
        alone(loaded, PROMPTS[1], 10),
    ]
    # Switched off: one pass each.
    monkeypatch.setattr(BatchDecoder, "group_prefill", False)
    model = PassLog(loaded.model)
    batch = decoder(model, loaded)
    for i, prompt in enumerate(PROMPTS):
        batch.add(job(i, prompt), None, 0)
    batch.prefill(4096, 60.0)
    assert [rows for rows, _ in model.passes] == [1, 1, 1, 1]


def test_padding_is_bounded(loaded: LoadedModel) -> None:
    """Short rests ride with 60-token ones only while the padded pass stays within twice the
    real tokens: 60 + 60 + 3 + 3 (240 padded for 126), not a fifth rest of 3 (300 for 129)."""
    batch = decoder(loaded.model, loaded)
    batch.add(job(0, tuple(range(5, 66))), None, 0)
    batch.add(job(1, tuple(range(5, 9))), None, 0)
    batch.add(job(2, tuple(range(9, 13))), None, 0)
    batch.add(job(3, tuple(range(9, 70))), None, 0)
    batch.add(job(4, tuple(range(20, 24))), None, 0)
    assert [s.request_id for s in choose_group(batch.waiting, 4096, 64, 1)] == [0, 1, 2, 3]
    # within a budget of 70 tokens: one long rest and a short one
    assert [s.request_id for s in choose_group(batch.waiting, 70, 64, 1)] == [0, 1]


def test_a_short_rest_at_the_head_does_not_keep_the_burst_apart(loaded: LoadedModel) -> None:
    """A burst as it reaches a GPU's runner: the first arrival prefilled its first chunk alone
    and has a short rest left (3 tokens, one 8-token block), the next ones whole prompts of 60
    tokens to go (eight blocks). Padded to the longest, the head with any one of them alone
    would be too much padding (2 x 64 for 63); the group is all of them (4 x 64 for 183) in one
    pass, and every sequence's greedy tokens are its own alone."""
    model = PassLog(loaded.model)
    batch = decoder(model, loaded, BLOCKS_OF_8)
    head = tuple(range(100, 140))
    batch.add(job(0, head), prefix_cache(loaded, head[:36]), 36)
    prompts = [tuple(range(5 + i, 66 + i)) for i in range(3)]
    for i, prompt in enumerate(prompts, start=1):
        batch.add(job(i, prompt), None, 0)
    assert [s.request_id for s in choose_group(batch.waiting, 4096, 64, 8)] == [0, 1, 2, 3]
    batch.prefill(4096, 60.0)
    assert [rows for rows, _ in model.passes] == [4]
    assert batch.join() == 4
    tokens = run(batch)
    assert [tokens[i] for i in range(4)] == [alone(loaded, p, 10) for p in (head, *prompts)]


def test_newer_arrivals_do_not_keep_the_oldest_waiting(loaded: LoadedModel) -> None:
    """The budget holds two 60-token rests but not a third sequence's 3 more: a group of two
    newer arrivals would take it all, and the oldest (3 tokens left, too short to ride with one
    of them alone) would get no chunk after it. Each round brings two more arrivals: the oldest
    still joins in the first round, as it did when the group was taken in admission order."""
    batch = decoder(loaded.model, loaded, BLOCKS_OF_8)
    head = tuple(range(100, 140))
    batch.add(job(0, head), prefix_cache(loaded, head[:36]), 36)
    joined_in: dict[int, int] = {}
    for round_ in range(3):
        for i in (1 + 2 * round_, 2 + 2 * round_):
            batch.add(job(i, tuple(range(5 + i, 66 + i))), None, 0)
        batch.prefill(120, 60.0)
        batch.join()
        for seq in batch.rows:
            joined_in.setdefault(seq.request_id, round_)
    assert joined_in.get(0) == 0


def test_a_long_prompt_at_the_head_is_not_kept_waiting_by_groups(loaded: LoadedModel) -> None:
    """A prompt longer than a chunk cannot be grouped; groups of newer short arrivals must not
    take the budget it waits for: it takes its chunk first in every round (admission order), and
    its tokens are its own alone."""
    model = PassLog(loaded.model)
    batch = decoder(model, loaded)  # chunks of 64
    long = tuple(range(300, 500))
    batch.add(job(0, long), None, 0)
    done = []
    for round_ in range(4):
        for i in (1 + 2 * round_, 2 + 2 * round_):
            batch.add(job(i, tuple(range(5 + i, 66 + i))), None, 0)
        batch.prefill(120, 60.0)
        done.append(next(s for s in batch.waiting if s.request_id == 0).prompt_done)
        batch.join()
    assert done == [64, 128, 192, 199]  # 199: all but its last token
    assert any(rows > 1 for rows, _ in model.passes)  # the newer ones did group meanwhile
    tokens = run(batch)
    assert tokens[0] == alone(loaded, long, 10)


def test_a_failing_group_pass_falls_back_to_one_pass_each(loaded: LoadedModel) -> None:
    """A pass that raises cannot say whose prompt it was: each prefills alone, and only the
    sequence whose own pass raises fails."""
    model = FaultyModel(loaded.model, poison=31337)
    batch = decoder(model, loaded)
    poisoned = (*PROMPTS[1][:3], 31337, *PROMPTS[1][4:])
    for i, prompt in enumerate((PROMPTS[0], poisoned, PROMPTS[2])):
        batch.add(job(i, prompt), None, 0)
    results = batch.prefill(4096, 60.0)
    assert batch.group_failures == 1
    failed = [r.seq.request_id for r in results if r.error is not None]
    assert failed == [1] and "poison" in (results[1].error or "")
    assert [r.seq.request_id for r in results if r.prefilled] == [0, 2]
    assert not any(r.grouped for r in results)
    batch.join()
    tokens = run(batch)
    assert [tokens[0], tokens[2]] == [alone(loaded, PROMPTS[0], 10), alone(loaded, PROMPTS[2], 10)]


def test_bucketed_groups_take_a_rung_and_a_power_of_two_of_rows(loaded: LoadedModel) -> None:
    """With recurring shapes (`prefill_shapes`, CUDA's default, switched on here) three arrivals
    go through one pass of four rows (the last copied) and a width from the chunk ladder, and
    decode as alone; the copied row leaves no trace."""
    model = PassLog(loaded.model)
    batch = BatchDecoder(
        model,
        frozenset(),
        vocab_size=len(loaded.tokenizer),
        plan=PrefillPlan(64, 16, 8),  # blocks of 8: the ladder is 8, 16, 32, 64
        split_at_store_points=False,
        padded_prefill=True,
    )
    prompts, cached = PROMPTS[1:], [0, 0, 8]  # 23, 14 and 31 tokens, the last 8 of them cached
    for i, (prompt, n) in enumerate(zip(prompts, cached, strict=True)):
        cache = prefix_cache(loaded, prompt[:n]) if n else None
        batch.add(job(i, prompt), cache, n)
    results = batch.prefill(4096, 60.0)
    assert model.passes == [(4, 32)]  # longest rest 22 tokens: 3 blocks, the rung above is 32
    assert [r.prefilled for r in results] == [
        len(p) - 1 - n for p, n in zip(prompts, cached, strict=True)
    ]
    assert batch.join() == 3 and len(batch.rows) == 3
    tokens = run(batch)
    assert [tokens[i] for i in range(3)] == [alone(loaded, p, 10) for p in prompts]
