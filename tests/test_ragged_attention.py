"""Rows of very different lengths attend in two groups (`engine/ragged_attention.py`): the short
rows over only the columns they use. The same attention as mlx-lm's over the whole width, and the
same tokens as each request alone, an abort of the long row included (tiny fp32 model)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio

import trio_mlx
from test_batching import assert_idle
from trio_mlx.engine import ragged_attention
from trio_mlx.engine.ragged_attention import RaggedPlan, plan_for

GREEDY = {"max_tokens": 16, "temperature": 0.0}
SHORT = ["Hello there", "Tell me about the sea", "Why is the sky blue?"]


def test_the_plan_splits_only_where_it_reads_much_less() -> None:
    plan = plan_for([2000, 20, 30, 25])
    assert plan is not None
    short, long = plan.groups
    assert plan.members == ((1, 3, 2), (0,))
    assert short.rows.tolist() == [1, 3, 2] and short.window == 30 and short.masked
    assert long.rows == slice(0, 1) and long.window == 2000 and not long.masked
    # back in row order: row 0 is the long group's first output, after the three short ones
    assert plan.order.tolist() == [3, 0, 2, 1]
    again = plan_for([2001, 21, 31, 26], plan)  # the same groups, a step later
    assert again is not None and again.groups[0].rows is short.rows and again.order is plan.order
    # consecutive groups in row order: views, and no putting back
    plan = plan_for([20, 20, 20, 2000])
    assert plan is not None and plan.order is None
    assert [(g.rows, g.window, g.masked) for g in plan.groups] == [
        (slice(0, 3), 20, False),
        (slice(3, 4), 2000, False),
    ]
    assert plan_for([1500, 1400, 1450]) is None  # rows of like lengths: one group
    assert plan_for([900, 10]) is None  # narrow: the gathers would cost more than they save
    assert plan_for([5000]) is None


def test_grouped_attention_equals_attention_over_the_whole_width() -> None:
    mx.random.seed(3)
    rows, heads, kv_heads, width, dims = 6, 4, 2, 1300, 16
    lengths = [1300, 30, 12, 1100, 7, 40]  # the row of 1,100 is padded in the long group
    queries = mx.random.normal((rows, heads, 1, dims))
    keys = mx.random.normal((rows, kv_heads, width, dims))
    values = mx.random.normal((rows, kv_heads, width, dims))
    padding = mx.array([width - n for n in lengths])
    mask = (mx.arange(width)[None, :] >= padding[:, None])[:, None, None, :]
    plan = plan_for(lengths)
    assert plan is not None and sorted(plan.members[0]) == [1, 2, 4, 5]
    grouped = plan(queries, keys, values, 0.25, mask)
    whole = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
    assert grouped.shape == whole.shape
    assert mx.allclose(grouped, whole, atol=1e-5).item()
    masked = plan
    # short rows of one length: no mask, exactly their window (one column more would be
    # padding: not the same attention)
    aligned = [1300, 40, 40, 40, 40, 40]
    padding = mx.array([width - n for n in aligned])
    mask = (mx.arange(width)[None, :] >= padding[:, None])[:, None, None, :]
    whole = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask)
    plan = plan_for(aligned)
    assert plan is not None and not any(g.masked for g in plan.groups)
    assert mx.allclose(plan(queries, keys, values, 0.25, mask), whole, atol=1e-5).item()
    off = plan_for([1300, 41, 41, 41, 41, 41])
    assert off is not None
    assert not mx.allclose(off(queries, keys, values, 0.25, mask), whole, atol=1e-5).item()
    # what it declines: a multi-token pass, no array mask, another row count
    assert masked(mx.concatenate([queries, queries], axis=2), keys, values, 0.25, mask) is None
    assert masked(queries, keys, values, 0.25, None) is None
    assert masked(queries[:5], keys[:5], values[:5], 0.25, mask[:5]) is None


def test_the_warm_up_runs_a_grouped_attention_in_the_models_shape(tiny_model_dir: Path) -> None:
    from trio_mlx.engine.loading import load_model

    loaded = load_model(tiny_model_dir)
    assert ragged_attention.warm_up(loaded.model) is True
    assert ragged_attention.warm_up(object()) is False  # not a model the dispatcher reaches


async def alone(model_dir: Path, prompts: list[Any], **sampling: Any) -> list[list[int]]:
    async with trio_mlx.open_engine(model_dir, max_num_seqs=1) as engine:
        return [(await engine.generate(p, **sampling)).tokens for p in prompts]


@pytest.mark.usefixtures("batch_pipeline")
@pytest.mark.parametrize("short_prompts", [SHORT, [SHORT[1]] * 3], ids=["unlike", "alike"])
async def test_a_long_row_among_short_ones_gives_each_its_tokens_alone_and_aborts_cleanly(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, short_prompts: list[str]
) -> None:
    # Narrow enough for the tiny model's prompts. The windows are exactly what the rows hold:
    # one position short, or one of padding in a group without a mask, changes a token.
    monkeypatch.setattr(ragged_attention, "MIN_WIDTH", 256)
    grouped_steps = 0
    original = RaggedPlan.__call__

    def counted(self: RaggedPlan, *args: Any) -> Any:
        nonlocal grouped_steps
        result = original(self, *args)
        grouped_steps += result is not None
        return result

    monkeypatch.setattr(RaggedPlan, "__call__", counted)
    rng = random.Random(7)
    long_prompt = [rng.randrange(100, 40_000) for _ in range(600)]
    expected = await alone(tiny_model_dir, [*short_prompts, long_prompt], **GREEDY)
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
        results: dict[int, list[int]] = {}

        async def short(i: int) -> None:
            results[i] = (await engine.generate(short_prompts[i], **GREEDY)).tokens

        async def long(abort_after: int | None) -> None:
            got: list[int] = []
            job = engine.prepare_generate(long_prompt, **GREEDY)
            async with engine.open_stream(job) as out:
                async for part in out:
                    got.extend(part.new_tokens)
                    if abort_after is not None and len(got) >= abort_after:
                        break  # the client goes away while the short rows decode beside it
            results[3] = got

        for abort_after in (None, 3):
            results.clear()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long, abort_after)
                for i in range(len(short_prompts)):
                    nursery.start_soon(short, i)
            for i in range(len(short_prompts)):
                assert results[i] == expected[i]
            assert results[3] == expected[3][: len(results[3])]
            assert len(results[3]) == (len(expected[3]) if abort_after is None else 3)
        await assert_idle(engine)  # the aborted row left, nothing held
        assert engine.get_stats()["runner"]["grouped_attention_steps"] > 0
    assert grouped_steps > 0  # the long row and the short ones did decode together
