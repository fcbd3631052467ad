"""SpecPrefill on the batched route (`engine/batch_specprefill.py`) on the tiny random models.

Driven step by step (`BatchDecoder`, both ways it steps): a SpecPrefill row decoding alone on its
own cache (`PositionedKVCache`), merged into a batch cache when a second row joins, alone again
when the other leaves; one scored and prefilled while two rows decode, then appended to their
batch cache; one alone under a grammar, jumping forward: each gives the serialized route's
`SpecPrefillSequence` tokens token for token (same selection, same true positions), and its
companions give mlx-lm's tokens alone. The batch cache holds its stored length (write index, left
padding) and its true RoPE position (`offset`), and copied out it is positioned again.

Through the engine: keep 1.0 gives full prefill's output on the batched route and the serialized
route's SpecPrefill output, and nothing enters the prefix cache; keep 0.3 gives the serialized
route's SpecPrefill output alone and when it arrives while companions decode (theirs unchanged);
an abort while the prompt is being scored frees its slot and leaves the companions' outputs as
they were alone; with a draft model that also scores, the sparse row decodes without drafting;
the stats count batched-route requests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache

import trio_mlx
from servers import eventually
from tiny_model import build_tiny_model
from trio_mlx.engine import batch_layout, batch_segments
from trio_mlx.engine.batch import BatchDecoder, RowResult
from trio_mlx.engine.batch_segments import SegmentedKVCache
from trio_mlx.engine.batch_specprefill import SpecPrefillRow
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.engine.specprefill import (
    SpecPrefillCounters,
    SpecPrefillSequence,
    SpecPrefillSettings,
)
from trio_mlx.engine.true_positions import PositionedKVCache
from trio_mlx.types import SamplingParams

THRESHOLD = 128
GREEDY = {"max_tokens": 12, "temperature": 0.0}
SETTINGS = SpecPrefillSettings(enabled=True, threshold=THRESHOLD, keep_pct=0.3, backbone_pct=0.05)
CHUNK = 64  # prompt tokens a prefill pass (both routes: the same scoring chunks)


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random model with the same tokenizer (as tests/test_specprefill.py's)."""
    out = tmp_path_factory.mktemp("scorers") / "small"
    return build_tiny_model(
        out, seed=7, hidden_size=32, intermediate_size=64, num_attention_heads=2
    )


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def scorer(scorer_dir: Path) -> LoadedModel:
    return load_model(scorer_dir)


def long_prompt(n: int, seed: int = 0) -> list[int]:
    """`n` token ids from the ordinary part of the vocabulary."""
    key = mx.random.key(seed)
    return [int(t) for t in mx.random.randint(200, 20000, (n,), key=key).tolist()]


def greedy_job(request_id: int, prompt: Any, max_tokens: int, grammar: Any = None) -> GenerationJob:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return GenerationJob(request_id, tuple(prompt), params, grammar=grammar)


# ---- step by step ----------------------------------------------------------------------------


def serialized(
    target: LoadedModel, scorer: LoadedModel, prompt: list[int], n: int, grammar: Any = None
) -> list[int]:
    """The serialized route's SpecPrefill tokens for `prompt`, the reference."""
    seq = SpecPrefillSequence(
        greedy_job(1, prompt, n, grammar),
        target.model,
        scorer.model,
        SETTINGS,
        SpecPrefillCounters(),
        frozenset(),
        vocab_size=len(target.tokenizer),
        chunk_tokens=CHUNK,
    )
    tokens: list[int] = []
    while not seq.finished:
        tokens += seq.step(CHUNK).tokens
    return tokens


def alone(target: LoadedModel, prompt: tuple[int, ...], n: int) -> list[int]:
    """mlx-lm's greedy tokens for `prompt`."""
    steps = generate_step(mx.array(prompt), target.model, max_tokens=n)
    return [int(token) for token, _ in steps]


class Driver:
    """A `BatchDecoder` stepped by hand: the batch loop's decode step, then its prefill pass."""

    def __init__(self, target: LoadedModel, scorer: LoadedModel) -> None:
        self.batch = BatchDecoder(
            target.model, frozenset(), vocab_size=len(target.tokenizer), plan=PrefillPlan(2048)
        )
        self.scorer = scorer
        self.counters = SpecPrefillCounters()
        self.tokens: dict[int, list[int]] = {}
        self.kinds: list[str] = []  # the batch cache's first layer's class, each decode step
        self.jumps = 0

    def add_sparse(self, request_id: int, prompt: list[int], n: int, grammar: Any = None) -> None:
        job = greedy_job(request_id, prompt, n, grammar)
        self.batch.add_specprefill(job, self.scorer.model, SETTINGS, self.counters)

    def add_plain(self, request_id: int, prompt: tuple[int, ...], n: int) -> None:
        self.batch.add(greedy_job(request_id, prompt, n), None, 0)

    def step(self) -> None:
        batch = self.batch
        if batch.rows:
            self.kinds.append(type(batch._cache[0]).__name__)
            jumping = batch.can_jump()
            self.jumps += jumping
            self.record(batch.jump() if jumping else batch.decode())
        if batch.waiting:
            for pre in batch.prefill(CHUNK, 60.0):
                assert pre.error is None
            batch.join()

    def record(self, results: list[RowResult]) -> None:
        for result in results:
            assert result.error is None
            self.tokens.setdefault(result.seq.request_id, []).extend(result.tokens)

    def run_until(self, done: Any) -> None:
        for _ in range(500):
            if done():
                return
            self.step()
        raise AssertionError("the batch did not get there")


SHORT = tuple(range(100, 112))
MIDDLE = tuple(range(300, 330))


@pytest.mark.usefixtures("batch_pipeline")
def test_a_lone_sparse_row_joined_and_left_keeps_its_true_positions(
    target: LoadedModel, scorer: LoadedModel
) -> None:
    """Alone on its own positioned cache, merged into a batch cache by a second row, alone again
    (copied out of the batch cache) once that one finishes: the serialized route's tokens."""
    prompt = long_prompt(400, seed=1)
    expected = serialized(target, scorer, prompt, 24)
    drive = Driver(target, scorer)
    drive.add_sparse(1, prompt, 24)
    sparse = drive.batch.waiting[0]
    assert isinstance(sparse, SpecPrefillRow)
    drive.run_until(lambda: drive.batch.rows)
    assert drive.counters.requests == 1 and drive.counters.scoring_chunks > 1
    kept = sparse.kept_positions
    assert kept is not None and len(kept) == 120
    assert sparse.position_shift == 400 - 120
    assert drive.batch.solo and type(drive.batch._cache[0]) is PositionedKVCache
    drive.run_until(lambda: len(drive.tokens.get(1, [])) >= 5)
    drive.add_plain(2, SHORT, 6)
    drive.run_until(lambda: len(drive.batch.rows) == 2)
    assert not drive.batch.solo and type(drive.batch._cache[0]) is BatchKVCache
    drive.run_until(lambda: not drive.batch.busy)
    assert drive.tokens[2] == alone(target, SHORT, 6)
    assert drive.tokens[1] == expected
    assert drive.kinds[0] == "PositionedKVCache" and "BatchKVCache" in drive.kinds
    assert drive.kinds[-1] == "PositionedKVCache"  # alone again, its shift kept


@pytest.mark.usefixtures("batch_pipeline")
@pytest.mark.parametrize("segments", [False, True], ids=["one-buffer", "a-part-of-its-own"])
def test_a_sparse_row_joining_a_decoding_batch_keeps_its_true_positions(
    target: LoadedModel, scorer: LoadedModel, monkeypatch: pytest.MonkeyPatch, segments: bool
) -> None:
    """Scored and prefilled while two rows decode (one chunk a pass), appended to their batch
    cache (or, wide enough, joining as a part of its own: `batch_segments`), the last row left:
    the serialized route's tokens; theirs are mlx-lm's alone."""
    monkeypatch.setattr(batch_segments, "MIN_WIDTH", 64 if segments else 10**9)
    prompt = long_prompt(300, seed=2)
    expected = serialized(target, scorer, prompt, 40)
    drive = Driver(target, scorer)
    drive.add_plain(2, SHORT, 30)
    drive.run_until(lambda: drive.batch.rows)
    assert drive.batch.solo and type(drive.batch._cache[0]) is KVCache
    drive.add_plain(3, MIDDLE, 12)
    drive.run_until(lambda: len(drive.batch.rows) == 2)
    drive.add_sparse(1, prompt, 40)
    passes = 0
    while drive.batch.waiting:
        drive.step()
        passes += 1
    # scoring (300 - 32 tokens, then the window) and the sparse prefill, one chunk a pass, with a
    # decode step of the others each
    assert passes >= 5 + 2
    kind = SegmentedKVCache if segments else BatchKVCache
    assert len(drive.batch.rows) == 3 and type(drive.batch._cache[0]) is kind
    drive.run_until(lambda: not drive.batch.busy)
    assert drive.tokens[2] == alone(target, SHORT, 30)
    assert drive.tokens[3] == alone(target, MIDDLE, 12)
    assert drive.tokens[1] == expected
    assert drive.kinds[-1] == "PositionedKVCache"


@pytest.mark.usefixtures("batch_pipeline")
def test_a_lone_sparse_row_jumps_forward_at_its_true_positions(
    target: LoadedModel, scorer: LoadedModel
) -> None:
    """Under a grammar, alone: the forced runs go through its positioned cache in one pass each
    (`batch_jump`), giving the serialized route's tokens (which jumps forward the same way)."""
    from test_structured_output import FORMAT
    from trio_mlx.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(target.tokenizer)
    prompt = long_prompt(300, seed=6)
    expected = serialized(target, scorer, prompt, 60, compiler.compile(FORMAT))
    drive = Driver(target, scorer)
    drive.add_sparse(1, prompt, 60, compiler.compile(FORMAT))
    drive.run_until(lambda: not drive.batch.busy)
    assert drive.jumps > 0 and set(drive.kinds) == {"PositionedKVCache"}
    assert drive.tokens[1] == expected


def test_a_sparse_rows_positions_are_its_own_in_the_batch_cache(
    target: LoadedModel, scorer: LoadedModel
) -> None:
    """The batch cache built with a sparse row holds its stored positions (write index and left
    padding) and its true RoPE position (`offset`); copied out, it is positioned again."""
    drive = Driver(target, scorer)
    drive.add_plain(2, SHORT, 40)
    drive.add_sparse(1, long_prompt(200, seed=4), 40)
    while drive.batch.waiting:  # no decode step: the short row holds its prompt only
        drive.batch.prefill(CHUNK, 60.0)
        drive.batch.join()
    assert len(drive.batch.rows) == 2
    layer = drive.batch._cache[0]
    assert type(layer) is BatchKVCache
    stored = 60 - 1  # the kept tokens but the last (its first input)
    assert layer._idx == stored
    assert layer.left_padding.tolist() == [stored - (len(SHORT) - 1), 0]
    assert layer.offset.tolist() == [len(SHORT) - 1, 200 - 1]
    rows = [s.request_id for s in drive.batch.rows]
    own = batch_layout.extract_row(
        drive.batch._cache, rows.index(1), stored, drive.batch.rows[1].position_shift
    )
    assert type(own[0]) is PositionedKVCache
    assert own[0].stored == stored and own[0].offset == 200 - 1


# ---- through the engine ----------------------------------------------------------------------


def open_engine(model: Path, scorer: Path | None, max_num_seqs: int, **config: Any) -> Any:
    if scorer is not None:
        config |= {
            "specprefill_enabled": True,
            "specprefill_threshold": THRESHOLD,
            "specprefill_draft_model": scorer,
        }
    return trio_mlx.open_engine(model, max_num_seqs=max_num_seqs, **config)


def specprefill_stats(engine: Any) -> dict[str, Any]:
    stats = engine.get_stats()["specprefill"]
    assert stats is not None
    return stats


async def test_keep_one_gives_full_prefill_and_the_serialized_routes_output(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    prompts = [long_prompt(400, seed=s) for s in range(2)]
    async with open_engine(tiny_model_dir, None, 4) as engine:
        full = [(await engine.generate(p, **GREEDY)).tokens for p in prompts]
    async with open_engine(tiny_model_dir, scorer_dir, 1, specprefill_keep_pct=1.0) as engine:
        serial = [(await engine.generate(p, **GREEDY)).tokens for p in prompts]
    async with open_engine(tiny_model_dir, scorer_dir, 4, specprefill_keep_pct=1.0) as engine:
        batched = [(await engine.generate(p, **GREEDY)).tokens for p in prompts]
        stats = specprefill_stats(engine)
        assert engine.get_stats()["runner"]["batching"]
        cache = engine.get_cache_stats()
    assert batched == full == serial
    assert cache["entries"] == 0 and cache["snapshots_taken"] == 0
    assert stats["requests"] == 2
    assert stats["kept_fraction"] == 1.0 and stats["skipped_tokens"] == 0


COMPANION_TOKENS = 150


def companion_prompts() -> list[list[int]]:
    return [list(range(500 + 40 * i, 510 + 40 * i + 3 * i)) for i in range(3)]


async def decoding(engine: Any, rows: int) -> None:
    await eventually(lambda: engine.get_stats()["runner"]["decoding"] == rows)


async def test_keep_03_gives_the_serialized_routes_output_alone_and_among_companions(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    prompt = long_prompt(500, seed=5)
    options = {"max_tokens": 16, "temperature": 0.0}
    companion_options = {"max_tokens": COMPANION_TOKENS, "temperature": 0.0}
    async with open_engine(tiny_model_dir, scorer_dir, 1, prefill_step_size=32) as engine:
        expected = (await engine.generate(prompt, **options)).tokens
    async with open_engine(tiny_model_dir, scorer_dir, 4, prefill_step_size=32) as engine:
        companions = [
            (await engine.generate(p, **companion_options)).tokens for p in companion_prompts()
        ]
        assert (await engine.generate(prompt, **options)).tokens == expected
        assert specprefill_stats(engine)["requests"] == 1

        # The long prompt arrives while the companions decode: it is scored and prefilled a
        # chunk a pass while they step, then decodes among them.
        outputs: dict[int, list[int]] = {}
        companion_tokens = [0]
        sparse_started_at: list[int] = []
        first_sparse_token_at: list[int] = []

        async def sparse() -> None:
            tokens: list[int] = []
            sparse_started_at.append(companion_tokens[0])
            async for out in engine.stream_generate(prompt, **options):
                if out.new_tokens and not tokens:
                    first_sparse_token_at.append(companion_tokens[0])
                tokens += out.new_tokens
            outputs[0] = tokens

        async def companion(i: int, p: list[int]) -> None:
            tokens: list[int] = []
            async for out in engine.stream_generate(p, **companion_options):
                tokens += out.new_tokens
                companion_tokens[0] += len(out.new_tokens)
            outputs[i + 1] = tokens

        async with trio.open_nursery() as nursery:
            for i, p in enumerate(companion_prompts()):
                nursery.start_soon(companion, i, p)
            await decoding(engine, 3)
            nursery.start_soon(sparse)
        stats = engine.get_stats()
    assert outputs[0] == expected
    assert [outputs[i + 1] for i in range(3)] == companions
    # the companions stepped while it was scored and prefilled, and still did when it decoded
    assert sparse_started_at[0] < first_sparse_token_at[0] < 3 * COMPANION_TOKENS
    assert stats["specprefill"]["requests"] == 2
    assert stats["specprefill"]["kept_tokens"] == 2 * 150


async def test_an_abort_while_scoring_frees_the_slot_and_spares_the_companions(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    prompt = long_prompt(1000)
    companion_options = {"max_tokens": 60, "temperature": 0.0}
    async with open_engine(tiny_model_dir, scorer_dir, 4, prefill_step_size=16) as engine:
        companions = [
            (await engine.generate(p, **companion_options)).tokens for p in companion_prompts()
        ]
        outputs: dict[int, list[int]] = {}
        finished_at_abort: list[int] = []

        async def companion(i: int, p: list[int]) -> None:
            outputs[i] = (await engine.generate(p, **companion_options)).tokens

        async def sparse() -> None:
            async for _ in engine.stream_generate(prompt, **GREEDY):
                pass

        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            for i, p in enumerate(companion_prompts()):
                nursery.start_soon(companion, i, p)
            await decoding(engine, 3)
            nursery.start_soon(_in_scope, scope, sparse)
            await eventually(lambda: specprefill_stats(engine)["scoring_chunks"] >= 2)
            finished_at_abort.append(len(outputs))
            scope.cancel()
        await eventually(lambda: engine.get_stats()["runner"]["live_sequences"] == 0)
        stats = engine.get_stats()
        # the slot is free: another long prompt goes through
        after = await engine.generate(long_prompt(200), **GREEDY)
    assert finished_at_abort == [0]
    assert [outputs[i] for i in range(3)] == companions
    assert stats["runner"]["aborted"] == 1
    assert stats["specprefill"]["requests"] == 0  # never got past scoring
    assert len(after.tokens) > 0


async def _in_scope(scope: trio.CancelScope, body: Any) -> None:
    """Run `body` under `scope` (cancelled by the test) from a nursery task."""
    with scope:
        await body()


async def test_with_a_draft_model_scoring_a_lone_sparse_row_decodes_without_it(
    tiny_model_dir: Path, scorer_dir: Path
) -> None:
    """`--specprefill --draft-model X` on the batched route: X scores; the sparse row decodes
    without drafting (as on the serialized route), a short prompt alone still speculates."""
    prompt = long_prompt(300, seed=8)
    options = {"max_tokens": 16, "temperature": 0.0}
    config = {"draft_model": scorer_dir, "specprefill_enabled": True}
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=1, specprefill_threshold=THRESHOLD, **config
    ) as engine:
        expected = (await engine.generate(prompt, **options)).tokens
    async with trio_mlx.open_engine(
        tiny_model_dir, max_num_seqs=4, specprefill_threshold=THRESHOLD, **config
    ) as engine:
        output = (await engine.generate(prompt, **options)).tokens
        stats = engine.get_stats()
        assert stats["speculative"]["speculative_steps"] == 0
        assert stats["specprefill"]["requests"] == 1
        await engine.generate(list(range(100, 140)), **options)
        assert engine.get_stats()["speculative"]["speculative_steps"] > 0
    assert output == expected
