"""Prefill chunks of recurring attention shapes (`prefill_shapes`, on by default on MLX's CUDA
backend, switched on here): long prompts admitted to a busy batch are cut into whole blocks
(rungs of the ladder where the budget cuts them), every chunk after a prompt's first attends over
a buffer grown to a few widths, and every request's tokens are those of the plain
chunks; one of them aborted while a padded chunk runs leaves the others' tokens as they were and
nothing held."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from model_wrappers import wrapping_loader
from test_batching import assert_idle
from trio_mlx.actors import batch_loop
from trio_mlx.engine.padded_attention import _PaddedView
from trio_mlx.engine.prefill_shapes import chunk_ladder, key_width, pass_size

BLOCK = 16
STEP = 128


def test_the_ladder_and_the_pass_size() -> None:
    assert chunk_ladder(16, 128) == (16, 32, 64, 128)
    assert chunk_ladder(64, 100) == (64,)
    assert pass_size(127, 16, 128) == 64  # the largest rung the budget allows
    assert pass_size(128, 16, 128) == 128
    assert pass_size(40, 16, 128) == 32
    assert pass_size(9, 16, 128) == 9  # less than a block: padded to one
    assert [key_width(n) for n in (1, 1024, 1025, 5000, 8192, 8193, 20000)] == [
        1024,
        1024,
        2048,
        8192,
        8192,
        16384,
        24576,  # powers of two, then multiples of 8,192
    ]


class ShapeRecorder:
    """Records every forward pass of more than one token on a cache of one row: (tokens fed,
    key length its attention sees). With `hold` cleared, the first padded pass waits for it
    (`held` set meanwhile)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.passes: list[tuple[int, int]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.held = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        fed = int(tokens.shape[1])
        if fed > 1 and cache and int(tokens.shape[0]) == 1:
            first = cache[0]
            keys = first._width if isinstance(first, _PaddedView) else int(first.offset) + fed
            self.passes.append((fed, keys))
            if isinstance(first, _PaddedView) and not self.hold.is_set():
                self.held.set()
                self.hold.wait(timeout=30)
        return self._inner(tokens, cache=cache)


PROMPT_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "owls",
    "watch",
    "quietly",
]


def long_prompt(i: int, words: int) -> str:
    return " ".join(PROMPT_WORDS[(i * 5 + k) % len(PROMPT_WORDS)] for k in range(words))


async def arrivals_during_a_decode(
    model_dir: Path, *, abort: int | None = None
) -> tuple[dict[int, list[int]], ShapeRecorder]:
    """One request decodes while three long prompts of different lengths arrive; their tokens
    by request, and the recorder. With `abort`, that arrival is cancelled while the first padded
    chunk is held in the model, and the engine is checked idle at the end."""
    loader, made = wrapping_loader(ShapeRecorder)
    async with trio_mlx.open_engine(
        model_dir,
        loader=loader,
        max_num_seqs=4,
        prefill_step_size=STEP,
        prefill_block=BLOCK,
        prefill_chunk_seconds=0.05,  # chunks well below the step: several a prompt
        cache_memory_bytes=0,
    ) as engine:
        outputs: dict[int, list[int]] = {}
        started = trio.Event()
        scopes = {i: trio.CancelScope() for i in (1, 2, 3)}

        async def running() -> None:
            async for out in engine.stream_generate(
                "Once upon a time", max_tokens=120, temperature=0.0
            ):
                if not started.is_set():  # what ran before (the padded chunk's check at the
                    made[0].passes.clear()  # batch's start, this prompt) is not the arrivals'
                started.set()
                outputs.setdefault(0, []).extend(out.new_tokens)

        async def arriving(i: int, words: int) -> None:
            await started.wait()
            with scopes[i]:
                out = await engine.generate(long_prompt(i, words), max_tokens=8, temperature=0.0)
                outputs[i] = list(out.tokens)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(running)
            for i, words in ((1, 150), (2, 333), (3, 90)):
                nursery.start_soon(arriving, i, words)
            if abort is not None:
                await started.wait()  # the batch's start (and its padded chunk's check) is past
                made[0].hold.clear()
                await trio.to_thread.run_sync(made[0].held.wait, 30.0)
                scopes[abort].cancel()
                await trio.sleep(0.05)  # the abort reaches the runner's inbox
                made[0].hold.set()
        if abort is not None:
            await assert_idle(engine)
    return outputs, made[0]


async def test_long_prompts_prefill_in_recurring_shapes_with_the_same_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, plain_shapes = await arrivals_during_a_decode(tiny_model_dir)
    monkeypatch.setattr(batch_loop, "padded_prefill_default", lambda: True)
    padded, shapes = await arrivals_during_a_decode(tiny_model_dir)
    assert padded == plain and sorted(plain) == [0, 1, 2, 3]
    ladder = set(chunk_ladder(BLOCK, STEP))
    assert shapes.passes and all(fed % BLOCK == 0 for fed, _ in shapes.passes), shapes.passes
    assert any(fed in ladder for fed, _ in shapes.passes)
    widths = {keys for _, keys in shapes.passes if keys % 1024 == 0}
    assert widths, shapes.passes  # chunks after a prompt's first attend over a width bucket
    # Far fewer distinct attention shapes than the plain chunks take.
    assert len(set(shapes.passes)) < len(set(plain_shapes.passes))


async def test_an_abort_during_a_padded_chunk_disturbs_no_one(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, _ = await arrivals_during_a_decode(tiny_model_dir)
    monkeypatch.setattr(batch_loop, "padded_prefill_default", lambda: True)
    aborted, shapes = await arrivals_during_a_decode(tiny_model_dir, abort=2)
    assert shapes.held.is_set()
    assert 2 not in aborted
    assert aborted == {i: plain[i] for i in (0, 1, 3)}


def test_a_rest_that_fits_goes_whole_and_a_cut_one_takes_a_rung(tiny_model_dir: Path) -> None:
    """A lone prompt is not cut into more passes than before (a pass has a fixed cost on a GPU);
    where the budget cuts the prompt, the chunk is a rung."""
    from trio_mlx.engine.batch_sequence import BatchSequence
    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.engine.loading import load_model
    from trio_mlx.types import SamplingParams

    loaded = load_model(tiny_model_dir)
    recorder = ShapeRecorder(loaded.model)

    def sequence(length: int) -> BatchSequence:
        job = GenerationJob(1, tuple(range(5, 5 + length)), SamplingParams(max_tokens=2))
        return BatchSequence(
            job,
            recorder,
            vocab_size=len(loaded.tokenizer),
            plan=PrefillPlan(STEP, BLOCK, BLOCK),
            max_kv_size=None,
            cache=None,
            cached_tokens=0,
            split_at_store_points=False,
            padded=True,
        )

    whole = sequence(100)  # 99 to prefill: 96 in whole blocks, then 3 padded to a block
    while not whole.ready:
        whole.prefill_chunk(recorder, 4096)
    assert recorder.passes == [(96, 96), (BLOCK, key_width(100))]
    recorder.passes.clear()
    cut = sequence(300)  # a budget of 40 tokens a chunk: rungs of 32
    assert cut.prefill_chunk(recorder, 40)[0] == 32
    assert cut.prefill_chunk(recorder, 40)[0] == 32
    assert recorder.passes == [(32, 32), (32, key_width(64))]
    recorder.passes.clear()
    # While rows decode (`rungs`), a rest that fits the budget is cut to rungs too: 99 tokens go
    # as 64 and 32 (and the last 3 padded to a block), not as one pass of 96, a new shape.
    decoding = sequence(100)
    while not decoding.ready:
        decoding.prefill_chunk(recorder, 4096, rungs=True)
    assert [tokens for tokens, _ in recorder.passes] == [64, 32, BLOCK]


class IgnoresCacheMasks:
    """The tiny model as one that builds its attention mask itself: every layer's cache is
    asked for no mask, so a padded chunk would attend to the bucket's padding."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        if cache and isinstance(cache[0], _PaddedView):
            for view in cache:
                view._mask = None  # attends over the whole bucket, unmasked
        return self._inner(tokens, cache=cache)


def test_the_padded_chunk_is_checked_against_the_plain_one(tiny_model_dir: Path) -> None:
    from trio_mlx.engine.loading import load_model
    from trio_mlx.engine.prefill_shapes import padded_prefill_agrees

    model = load_model(tiny_model_dir).model
    assert padded_prefill_agrees(model, BLOCK)
    assert not padded_prefill_agrees(IgnoresCacheMasks(model), BLOCK)


def test_the_warm_up_runs_every_rung_on_a_fresh_cache_and_over_every_width(
    tiny_model_dir: Path,
) -> None:
    from trio_mlx.engine.loading import load_model
    from trio_mlx.engine.prefill_shapes import PADDED_UP_TO, warm_graphs

    loaded = load_model(tiny_model_dir)
    widths = [1024, 2048, 4096, 8192, 16384, 24576, 32768]
    assert widths[-1] == PADDED_UP_TO and [key_width(w) for w in widths] == widths
    # rungs 16, 32, 64: each causal on its own keys, then over each of the 7 widths
    assert warm_graphs(loaded.model, BLOCK, 64) == 3 * (2 + len(widths))
    assert warm_graphs(loaded.model, BLOCK, 64, seconds=0.0) == 0  # out of time at once
    assert warm_graphs(object(), BLOCK, 64) == 0  # a model whose shape it cannot read
