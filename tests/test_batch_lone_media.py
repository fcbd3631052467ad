"""A request with media alone in the decode batch takes its lane's path (`BatchDecoder.lone_media`,
engine/batch_lone_media.py), driven step by step on the tiny random Qwen2-VL (tests/tiny_vlm.py):
its first token comes from its prompt's last pass, read at once (the whole prompt on the GPU's
plan, a fused tail of 1,024 tokens; the last token alone after its chunk on the CPU's), its
steps go through its own model while it decodes alone; a text
request joining it mid-decode merges it into the batch, where it decodes at its rope delta;
the text leaving gives it its own cache and model again; and throughout, every sequence's
greedy tokens are what it gives alone (the image request's: its media lane's,
`MultimodalSequence`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from media_samples import image
from trio_mlx.engine.batch import BatchDecoder
from trio_mlx.engine.batch_join import PrefillResult
from trio_mlx.engine.decode import GenerationJob, PrefillPlan
from trio_mlx.engine.loading import LoadedModel, load_model
from trio_mlx.multimodal.job import MultimodalJob, MultimodalSequence
from trio_mlx.multimodal.joining import JoiningMediaSequence
from trio_mlx.multimodal.prepare import VisionInputs, template_owner
from trio_mlx.multimodal.vision import VisionFeatureCache
from trio_mlx.types import SamplingParams

#: the GPU's plan (a fused tail of 1,024 tokens: the whole prompt with its first token) and the
#: CPU's (the last prompt token alone)
PLANS = {"tail-1024": PrefillPlan(2048, 1024), "tail-1": PrefillPlan(2048)}
TEXT = tuple(range(100, 130))


@pytest.fixture(scope="module")
def loaded(tiny_vlm_dir: Path) -> LoadedModel:
    return load_model(tiny_vlm_dir)


@pytest.fixture(params=sorted(PLANS))
def plan(request: pytest.FixtureRequest) -> PrefillPlan:
    return PLANS[request.param]


def media_job(
    loaded: LoadedModel, request_id: int, max_tokens: int, **params: Any
) -> MultimodalJob:
    """A greedy chat about one image, prepared as the engine prepares it."""
    vlm = loaded.multimodal
    assert vlm is not None
    processor = vlm.processing.processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi."}]}]
    prompt = template_owner(processor).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    arrays = {
        k: np.asarray(v) for k, v in dict(processor(text=[prompt], images=[image(3)])).items()
    }
    ids = tuple(int(t) for t in arrays.pop("input_ids").reshape(-1))
    arrays.pop("attention_mask", None)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    vision = VisionInputs(arrays=arrays, media_key=f"image-{request_id}", images=1, videos=0)
    return MultimodalJob(request_id, ids, sampling, vision=vision, cache_key=ids)


def vocab(loaded: LoadedModel) -> int:
    return len(loaded.tokenizer)


def in_its_lane(loaded: LoadedModel, job: MultimodalJob, plan: PrefillPlan) -> list[int]:
    """The request's tokens in its media lane (the serialized route's sequence)."""
    assert loaded.multimodal is not None
    seq = MultimodalSequence(
        job, loaded.multimodal, VisionFeatureCache(), loaded.eos_token_ids, plan,
        vocab_size=vocab(loaded),
    )  # fmt: skip
    tokens: list[int] = []
    while not seq.finished:
        tokens.extend(seq.step().tokens)
    return tokens


def decoder(
    loaded: LoadedModel, plan: PrefillPlan, eos: frozenset[int] | None = None
) -> BatchDecoder:
    eos = loaded.eos_token_ids if eos is None else eos
    return BatchDecoder(loaded.model, eos, vocab_size=vocab(loaded), plan=plan)


def admit_media(batch: BatchDecoder, loaded: LoadedModel, job: MultimodalJob) -> Any:
    """`job`'s vision step, then its admission to the batch (as the media lane hands it over)."""
    assert loaded.multimodal is not None
    seq = batch.sequence(job, None, 0, key_tokens=job.keyed().prompt_tokens)
    JoiningMediaSequence(seq, loaded.multimodal, VisionFeatureCache()).step()
    batch.admit(seq)
    return seq


def prefill_and_join(batch: BatchDecoder, tokens: dict[int, list[int]]) -> list[PrefillResult]:
    """Prefill and join until nothing waits; the prefill results (first tokens noted)."""
    results: list[PrefillResult] = []
    while batch.waiting:
        for result in batch.prefill(4096, 60.0):
            assert result.error is None
            tokens.setdefault(result.seq.request_id, []).extend(result.tokens)
            results.append(result)
        batch.join()
    return results


def step(batch: BatchDecoder, tokens: dict[int, list[int]], kinds: list[str]) -> None:
    if batch.rows:
        kinds.append(type(batch._cache[0]).__name__)
    for result in batch.decode():
        assert result.error is None
        tokens.setdefault(result.seq.request_id, []).extend(result.tokens)


class CountedModel:
    """A sequence's own model, its calls counted."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.usefixtures("batch_pipeline")
def test_a_lone_image_row_takes_its_lanes_path_and_a_text_row_joins_and_leaves_it(
    loaded: LoadedModel, plan: PrefillPlan
) -> None:
    job = media_job(loaded, 1, 24)
    expected = in_its_lane(loaded, job, plan)
    text_job = GenerationJob(2, TEXT, SamplingParams(max_tokens=5, temperature=0.0))
    text_alone = decoder(loaded, plan)
    text_alone.add(text_job, None, 0)
    alone_tokens: dict[int, list[int]] = {}
    prefill_and_join(text_alone, alone_tokens)
    while text_alone.busy:
        step(text_alone, alone_tokens, [])

    batch = decoder(loaded, plan)
    tokens: dict[int, list[int]] = {}
    kinds: list[str] = []
    seq = admit_media(batch, loaded, job)
    assert seq.rope_delta != 0  # its positions run at a delta of their own
    own = seq.prefill_model = CountedModel(seq.prefill_model)
    results = prefill_and_join(batch, tokens)
    # its first token from its prompt's last pass, read at once, as in its lane: the whole
    # prompt in one (the GPU's plan), or its chunk, then its last token alone (the CPU's)
    assert [r.first_token for r in results] == ([True] if plan.tail > 1 else [False, True])
    assert own.calls == len(results) and len(tokens[1]) == 1
    assert batch.solo and type(batch._cache[0]) is KVCache
    calls = own.calls
    for _ in range(6):
        step(batch, tokens, kinds)
    assert own.calls == calls + 6  # alone: its own model, every step
    # A text request joins: one batch cache, the image row at its delta in the shared pass.
    batch.add(text_job, None, 0)
    prefill_and_join(batch, tokens)
    assert not batch.solo and type(batch._cache[0]) is BatchKVCache
    calls = own.calls
    while len(tokens.get(2, [])) < 5:
        step(batch, tokens, kinds)
    assert own.calls == calls
    # The text finished: the image row goes on alone, on its own cache and model again.
    while batch.busy:
        step(batch, tokens, kinds)
    assert "BatchKVCache" in kinds and kinds[-1] == "KVCache"
    assert own.calls > calls
    assert tokens[1] == expected
    assert tokens[2] == alone_tokens[2]


def test_off_a_lone_image_row_prefills_joins_and_decodes_as_any_row(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lone_media` off (what bench.media_lone measures against): no first token from the
    prefill, every step through the batch's model, the same tokens."""
    monkeypatch.setattr(BatchDecoder, "lone_media", False)
    plan = PLANS["tail-1024"]
    job = media_job(loaded, 1, 12)
    batch = decoder(loaded, plan)
    tokens: dict[int, list[int]] = {}
    seq = admit_media(batch, loaded, job)
    own = seq.prefill_model = CountedModel(seq.prefill_model)
    results = prefill_and_join(batch, tokens)
    assert not any(r.first_token for r in results) and own.calls == 1  # its one prefill chunk
    while batch.busy:
        step(batch, tokens, [])
    assert own.calls == 1
    assert tokens[1] == in_its_lane(loaded, job, plan)


@pytest.mark.parametrize("ending", ["length", "stop"])
def test_a_lone_image_request_can_end_at_its_first_token(loaded: LoadedModel, ending: str) -> None:
    """Its first token is its last (`max_tokens` 1, or an EOS): it ends in the prefill, never
    joins, and keeps its own cache holding its prompt (for a snapshot)."""
    plan = PLANS["tail-1024"]
    first = in_its_lane(loaded, media_job(loaded, 1, 1), plan)[0]
    job = media_job(loaded, 1, 1 if ending == "length" else 8)
    batch = decoder(loaded, plan, eos=frozenset({first}) if ending == "stop" else None)
    seq = admit_media(batch, loaded, job)
    (result,) = batch.prefill(4096, 60.0)
    assert result.first_token and result.finish == ending
    assert result.tokens == ((first,) if ending == "length" else ())
    assert batch.join() == 0 and not batch.busy
    assert seq.finished and seq.cache is not None
    assert seq.fed_tokens() == job.prompt_tokens
    assert seq.cache[0].offset == len(job.prompt_tokens)


def test_an_image_row_s_first_token_from_its_prompt_has_its_lane_s_logprobs(
    loaded: LoadedModel,
) -> None:
    """The first token's logprobs (chosen from its prompt's last pass) are its lane's."""
    plan = PLANS["tail-1024"]
    job = media_job(loaded, 1, 3, logprobs=True, top_logprobs=2)
    assert loaded.multimodal is not None
    lane = MultimodalSequence(
        job, loaded.multimodal, VisionFeatureCache(), loaded.eos_token_ids, plan,
        vocab_size=vocab(loaded),
    )  # fmt: skip
    lane.step()
    want = lane.step()
    batch = decoder(loaded, plan)
    admit_media(batch, loaded, job)
    (result,) = batch.prefill(4096, 60.0)
    assert result.tokens == want.tokens
    (got,) = result.logprobs
    assert got.token == want.logprobs[0].token
    assert got.logprob == pytest.approx(want.logprobs[0].logprob, abs=1e-5)
    assert [t for t, _ in got.top] == [t for t, _ in want.logprobs[0].top]
