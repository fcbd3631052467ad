"""Rows of very different lengths in groups of their own buffers (`engine/batch_segments.py`): the
same logits as one left-padded buffer, rows leaving and joining each group on its own, and each
request's tokens as alone while a long prompt joins and leaves a decoding batch (tiny fp32
model)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import BatchKVCache, KVCache

import trio_mlx
from test_batching import assert_idle
from trio_mlx.engine import batch_layout, batch_segments
from trio_mlx.engine.batch_segments import SegmentedKVCache, starts_group
from trio_mlx.engine.compiled_step import COMPILABLE_MODULES
from trio_mlx.engine.decode_attention import install_dispatcher

GREEDY = {"max_tokens": 12, "temperature": 0.0}


def test_a_joiner_starts_a_group_only_where_together_would_hold_much_more() -> None:
    assert starts_group(16, 300, 8000)  # 17 x 8,000 against 12,800
    assert starts_group(1, 8000, 300)  # a short row after the long one
    assert not starts_group(16, 300, 400)  # narrow: a few padded columns
    assert not starts_group(3, 1500, 1600)  # alike
    assert not starts_group(0, 0, 9000)  # nothing to join: the group is its own
    groups = batch_segments._groups([300, 310, 8000, 20, 30])
    assert groups == [[0, 1], [2], [3, 4]]
    # at most MAX_PARTS parts: past them the last takes every joiner
    assert batch_segments._groups([8000, 10], rows=4, width=10, parts=4) == [[0, 1]]


def _row_caches(model: Any, prompts: list[list[int]]) -> list[list[Any]]:
    caches = []
    for prompt in prompts:
        cache = [KVCache() for _ in model.layers]
        mx.eval(model(mx.array(prompt)[None], cache=cache))
        caches.append(cache)
    return caches


def test_segmented_layers_give_one_buffers_logits_and_rows(tiny_model_dir: Path) -> None:
    from trio_mlx.engine.loading import load_model

    model = load_model(tiny_model_dir).model
    install_dispatcher(COMPILABLE_MODULES)
    assert batch_segments.supported(model)
    rng = random.Random(3)
    lengths = [12, 9, 1500, 14]
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in lengths]
    caches = _row_caches(model, prompts)
    plain = batch_layout.merged(caches)
    segmented = batch_segments.merged(caches, lengths)
    assert segmented is not None and type(segmented[0]) is SegmentedKVCache
    assert segmented[0].sizes == [2, 1, 1]  # the short two, the long one, the short one after
    # the short rows are not held at the long row's width
    assert 2 * segmented[0].nbytes < plain[0].nbytes
    inputs = mx.array([[rng.randrange(100, 40_000)] for _ in lengths])
    for _ in range(3):
        want = model(inputs, cache=plain)[:, -1]
        got = model(inputs, cache=segmented)[:, -1]
        assert mx.allclose(got, want, atol=1e-4).item()
        inputs = mx.argmax(want, axis=-1)[:, None]
    # a row out of a part is the row out of the one buffer
    for row in range(len(lengths)):
        length = lengths[row] + 3
        part, local = batch_segments.locate(segmented, row)
        ours = batch_layout.extract_row(part, local, length)
        theirs = batch_layout.extract_row(plain, row, length)
        assert mx.array_equal(ours[0].keys, theirs[0].keys).item()
    # a short row leaves: its part stays whole, the long row's untouched
    long_keys = segmented[0].parts[1].keys
    keep = [1, 2, 3]
    batch_segments.filter_rows(segmented, keep, [lengths[i] + 3 for i in keep])
    batch_layout.filter_rows(plain, keep, [lengths[i] + 3 for i in keep])
    assert segmented[0].sizes == [1, 1, 1] and segmented[0].parts[1].keys is long_keys
    inputs = inputs[mx.array(keep)]
    want = model(inputs, cache=plain)[:, -1]
    assert mx.allclose(model(inputs, cache=segmented)[:, -1], want, atol=1e-4).item()
    inputs = mx.argmax(want, axis=-1)[:, None]
    # the long row leaves: its part goes, and the short ones either side of it step as one
    # again (a plain batch layer)
    keep = [0, 2]
    kept = [lengths[1] + 4, lengths[3] + 4]
    batch_segments.filter_rows(segmented, keep, kept)
    batch_layout.filter_rows(plain, keep, kept)
    assert type(segmented[0]) is BatchKVCache and segmented[0].keys.shape[0] == 2
    inputs = inputs[mx.array(keep)]
    want = model(inputs, cache=plain)[:, -1]
    assert mx.allclose(model(inputs, cache=segmented)[:, -1], want, atol=1e-4).item()


def test_a_long_joiner_gets_a_part_and_the_short_rows_buffer_is_untouched(
    tiny_model_dir: Path,
) -> None:
    from trio_mlx.engine.loading import load_model

    model = load_model(tiny_model_dir).model
    rng = random.Random(5)
    short = _row_caches(model, [[rng.randrange(100, 40_000) for _ in range(n)] for n in (8, 11)])
    cache = batch_layout.merged(short)
    before = cache[0].keys
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in (1300, 7)]
    joiners = _row_caches(model, prompts)
    assert batch_segments.extend(cache, joiners, [1300, 7])
    assert type(cache[0]) is SegmentedKVCache and cache[0].sizes == [2, 1, 1]
    assert cache[0].parts[0].keys is before  # the short rows were not re-laid
    # the long row's part is its own cache's buffers, not a copy of them
    assert cache[0].parts[1].keys is joiners[0][0].keys
    # a joiner that fits the last group joins it: no new part
    late = _row_caches(model, [[rng.randrange(100, 40_000) for _ in range(9)]])
    assert batch_segments.extend(cache, late, [9])
    assert cache[0].sizes == [2, 1, 2]
    # a batch of one group that stays one: left to `batch_layout.extend`
    plain = batch_layout.merged(short)
    assert not batch_segments.extend(plain, late, [9])


async def alone(model_dir: Path, prompts: list[Any], **sampling: Any) -> list[list[int]]:
    async with trio_mlx.open_engine(model_dir, max_num_seqs=1) as engine:
        return [(await engine.generate(p, **sampling)).tokens for p in prompts]


@pytest.mark.usefixtures("batch_pipeline")
@pytest.mark.parametrize(
    ("mixed", "traced"),
    [(False, False), (True, False), (False, True)],
    ids=["chunks-apart", "chunks-in-the-pass", "small-batches-traced"],
)
async def test_a_long_prompt_joins_and_leaves_decoding_rows_each_as_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, mixed: bool, traced: bool
) -> None:
    """With `traced`, the batch's steps of 2 to 4 rows outside the parts take the traced
    step (`traced_batch_rows`), the segmented ones the plain step."""
    monkeypatch.setattr(batch_segments, "MIN_WIDTH", 256)
    carried_by_parts = 0
    if mixed:  # prompt chunks ride in the decode pass (CUDA's default), sized as test_mixed_step's
        from trio_mlx.engine import mixed_step, scheduling
        from trio_mlx.engine.batch import BatchDecoder

        monkeypatch.setattr(BatchDecoder, "mixed_prefill", True)
        monkeypatch.setattr(scheduling, "DEFAULT_DECODE_SHARE", 1000.0)
        monkeypatch.setattr(scheduling, "DEFAULT_MIXED_SHARE", 1000.0)
        forward = mixed_step.forward

        def counted(model: Any, inputs: Any, cache: Any, chunks: Any) -> Any:
            nonlocal carried_by_parts
            carried_by_parts += type(cache[0]) is SegmentedKVCache
            return forward(model, inputs, cache, chunks)

        monkeypatch.setattr(mixed_step, "forward", counted)
    rng = random.Random(11)
    long_prompt = [rng.randrange(100, 40_000) for _ in range(700)]
    shorts = ["Hello there", "Tell me about the sea", "Why is the sky blue?"]
    many = {"max_tokens": 80, "temperature": 0.0}
    expected_short = await alone(tiny_model_dir, shorts, **many)
    [expected_long] = await alone(tiny_model_dir, [long_prompt], **GREEDY)
    traced_rows = {"traced_batch_rows": 4} if traced else {}
    async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4, **traced_rows) as engine:
        results: dict[str, list[int]] = {}
        for abort_after in (None, 3):
            results.clear()
            decoding = trio.Event()
            long_started = trio.Event()

            async def short(name: str, prompt: str, started: trio.Event | None) -> None:
                got: list[int] = []
                async for out in engine.stream_generate(prompt, **many):
                    got.extend(out.new_tokens)
                    if started is not None and len(got) >= 2:
                        started.set()
                results[name] = got

            async def long(abort_after: int | None, started: trio.Event) -> None:
                got: list[int] = []
                job = engine.prepare_generate(long_prompt, **GREEDY)
                async with engine.open_stream(job) as out:
                    async for part in out:
                        got.extend(part.new_tokens)
                        started.set()
                        if abort_after is not None and len(got) >= abort_after:
                            break  # the client goes away; the short rows decode on
                results["long"] = got

            async with trio.open_nursery() as nursery:
                nursery.start_soon(short, "a", shorts[0], decoding)
                nursery.start_soon(short, "b", shorts[1], None)
                await decoding.wait()
                nursery.start_soon(long, abort_after, long_started)
                await long_started.wait()
                nursery.start_soon(short, "c", shorts[2], None)  # after the long row's part
            assert [results[k] for k in "abc"] == expected_short
            assert results["long"] == expected_long[: len(results["long"])]
            assert len(results["long"]) == (len(expected_long) if abort_after is None else 3)
        await assert_idle(engine)
        assert engine.get_stats()["runner"]["segmented_steps"] > 0
        assert (engine.get_stats()["runner"]["traced_steps"] > 0) == traced
        # the second round's long prompt started from the first one's snapshot, copied out of
        # its part when it finished (the short prompts are too short to save this many)
        assert engine.get_cache_stats()["tokens_saved"] >= 600
    if mixed:  # the late short prompt's chunk rode in a pass over the parts
        assert carried_by_parts > 0


def test_a_prompt_chunk_rides_in_a_segmented_batchs_pass(tiny_model_dir: Path) -> None:
    """`mixed_step` over rows in parts: the rows' logits are the plain step's, and the chunk's
    cache what its own pass writes."""
    from trio_mlx.engine import mixed_step
    from trio_mlx.engine.batch_sequence import BatchSequence
    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.engine.loading import load_model
    from trio_mlx.types import SamplingParams

    loaded = load_model(tiny_model_dir)
    model = loaded.model
    assert mixed_step.prepare(model)
    rng = random.Random(9)
    lengths = [10, 1200, 6]
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in lengths]
    caches = _row_caches(model, prompts)
    segmented = batch_segments.merged(caches, lengths)
    assert segmented is not None and segmented[0].sizes == [1, 1, 1]
    plain = batch_layout.merged(caches)
    inputs = mx.array([rng.randrange(100, 40_000) for _ in lengths], dtype=mx.uint32)
    prompt = tuple(rng.randrange(100, 40_000) for _ in range(40))
    seq = BatchSequence(
        GenerationJob(1, prompt, SamplingParams(max_tokens=1)),
        model,
        vocab_size=len(loaded.tokenizer),
        plan=PrefillPlan(16),
        max_kv_size=None,
        cache=None,
        cached_tokens=0,
        split_at_store_points=False,
    )
    assert mixed_step.mixable(segmented, seq)
    chunk = mixed_step.plan(seq, 16, rungs=False)
    logits, done = mixed_step.forward(model, inputs, segmented, [chunk])
    expected = model(inputs[:, None], cache=plain)[:, -1, :]
    assert done[0][0] == 16 and seq.prompt_done == 16
    assert mx.allclose(logits, expected, atol=1e-4).item()
    alone = [KVCache() for _ in model.layers]
    model(mx.array(prompt[:16])[None], cache=alone)
    assert mx.allclose(seq.cache[0].keys[..., :16, :], alone[0].keys[..., :16, :], atol=1e-4).item()
    # the parts advanced by the pass: the next plain step agrees again
    step = mx.argmax(expected, axis=-1)
    again = model(step[:, None], cache=segmented)[:, -1, :]
    assert mx.allclose(again, model(step[:, None], cache=plain)[:, -1, :], atol=1e-4).item()


def test_joiners_with_nothing_cached_join_a_segmented_batch(tiny_model_dir: Path) -> None:
    """A part of rows holding no position yet (one-token prompts: nothing cached before their
    first step) takes joiners as mlx-lm's own `extend` does; the step then gives the one
    buffer's logits."""
    from trio_mlx.engine.loading import load_model

    model = load_model(tiny_model_dir).model
    install_dispatcher(COMPILABLE_MODULES)
    rng = random.Random(4)
    long = _row_caches(model, [[rng.randrange(100, 40_000) for _ in range(1300)]])
    empty = [[KVCache() for _ in model.layers] for _ in range(2)]
    cache = batch_layout.merged([*long])
    assert batch_segments.extend(cache, [empty[0]], [0])  # a part of its own, holding nothing
    assert type(cache[0]) is SegmentedKVCache and cache[0].parts[1].keys is None
    assert batch_segments.extend(cache, [empty[1]], [0])  # into that part, before any step
    assert cache[0].sizes == [1, 2]
    plain = batch_layout.merged([*long, *empty])
    inputs = mx.array([[5], [6], [7]])
    want = model(inputs, cache=plain)[:, -1]
    assert mx.allclose(model(inputs, cache=cache)[:, -1], want, atol=1e-4).item()


def test_the_parts_offsets_follow_the_layers_without_a_chain_of_additions() -> None:
    """Each pass advances the parts' RoPE positions as views of the layer's own (which the next
    pass evaluates): after many passes a part's offsets are right and their graph shallow."""
    import re
    import tempfile

    rows = [KVCache() for _ in range(3)]
    for i, row in enumerate(rows):
        n = 5 if i != 1 else 1500
        row.update_and_fetch(mx.zeros((1, 2, n, 8)), mx.zeros((1, 2, n, 8)))
    layer = batch_segments.merged([[r] for r in rows], [5, 1500, 5])
    assert layer is not None
    segmented = layer[0]
    for _ in range(200):
        mx.eval(segmented.offset)  # what the model's RoPE does each pass
        segmented.update_and_fetch(mx.zeros((3, 2, 1, 8)), mx.zeros((3, 2, 1, 8)))
    with tempfile.NamedTemporaryFile(suffix=".dot") as out:  # before reading them evaluates them
        mx.export_to_dot(out.name, segmented.parts[0].offset)
        operations = len(re.findall(r'label ="[A-Za-z]', Path(out.name).read_text()))
    assert operations < 10  # 400 as a chain (an addition and a broadcast a pass)
    assert [p.offset.tolist() for p in segmented.parts] == [[205], [1700], [205]]
