"""Native MTP speculative decoding (`engine/mtp.py`) on tiny random DeepSeek-V3 models.

The target with `mtp=True` drafts with its own MTP layer (kept at load, dropped by mlx-lm) and
verifies with the same acceptance code as a draft model: greedy output is the output of the same
weights without MTP, token for token, on both routes; with an MTP layer that is right every time
(the "copy" target and the "echo" MTP of `tiny_mtp_model`) every drafted token is accepted; a
model without MTP weights is refused at start-up; an abort mid-stream frees the slot.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_mlx
from servers import eventually
from tiny_mtp_model import build_tiny_mtp_model
from trio_mlx.errors import ModelLoadError

PROMPTS = [
    "Hello there, how",
    "The quick brown fox jumps over the lazy dog because",
    "1 2 3 4 5 6 7 8 9 10",
]
ROUTES = pytest.mark.parametrize("max_num_seqs", [1, 4], ids=["serialized", "batched"])
GREEDY = {"max_tokens": 24, "temperature": 0.0}


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random deepseek_v3 with a random MTP layer: its drafts are rarely right."""
    return build_tiny_mtp_model(tmp_path_factory.mktemp("mtp") / "with-mtp")


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same main weights as `mtp_dir`, without the MTP layer (what mlx-lm loads as is)."""
    return build_tiny_mtp_model(tmp_path_factory.mktemp("mtp") / "without-mtp", with_mtp=False)


@pytest.fixture(scope="module")
def plain_outputs(plain_dir: Path) -> list[Any]:
    async def run() -> list[Any]:
        async with trio_mlx.open_engine(plain_dir, max_num_seqs=1) as engine:
            return [await engine.generate(p, **GREEDY) for p in PROMPTS]

    return trio.run(run)


def speculation(engine: trio_mlx.Engine) -> dict[str, Any]:
    stats = engine.get_stats()["speculative"]
    assert stats is not None
    return stats


@ROUTES
async def test_greedy_output_with_mtp_is_the_models_own(
    mtp_dir: Path, plain_outputs: list[Any], max_num_seqs: int
) -> None:
    async with trio_mlx.open_engine(
        mtp_dir, max_num_seqs=max_num_seqs, mtp=True, mtp_num_draft_tokens=3
    ) as engine:
        outputs = [await engine.generate(p, **GREEDY) for p in PROMPTS]
        stats = speculation(engine)
        status = engine.get_stats()
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs]
    assert [o.text for o in outputs] == [o.text for o in plain_outputs]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain_outputs]
    assert stats["draft_model"] == "mtp" and stats["num_draft_tokens"] == 3
    assert stats["speculative_steps"] > 0
    assert 0 < stats["drafted_tokens"] <= 3 * stats["speculative_steps"]
    assert 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert status["acceptance_rate"] == stats["acceptance_rate"]


async def test_an_mtp_head_that_is_always_right_has_every_draft_accepted(
    tmp_path: Path,
) -> None:
    echo = build_tiny_mtp_model(tmp_path / "copy-echo", echo=True, copy_target=True)
    plain = build_tiny_mtp_model(tmp_path / "copy-plain", with_mtp=False, copy_target=True)
    async with trio_mlx.open_engine(plain, max_num_seqs=1) as engine:
        expected = [await engine.generate(p, **GREEDY) for p in PROMPTS[:2]]
    async with trio_mlx.open_engine(echo, max_num_seqs=1, mtp=True, mtp_num_draft_tokens=4) as e:
        outputs = [await e.generate(p, **GREEDY) for p in PROMPTS[:2]]
        stats = speculation(e)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert all(len(set(o.tokens)) == 1 for o in outputs)  # the copy target repeats a token
    assert stats["drafted_tokens"] > 0
    assert stats["accepted_tokens"] == stats["drafted_tokens"]
    assert stats["acceptance_rate"] == 1.0
    # The prompt's hidden states were captured at prefill: every step drafts, and the 23 tokens
    # after the first come in steps of up to 5.
    assert stats["plain_steps"] == 0
    assert stats["speculative_steps"] <= 2 * 5


@ROUTES
async def test_seeded_sampling_with_mtp_is_reproducible(mtp_dir: Path, max_num_seqs: int) -> None:
    sampling = {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    runs = []
    for _ in range(2):
        async with trio_mlx.open_engine(mtp_dir, max_num_seqs=max_num_seqs, mtp=True) as engine:
            runs.append([(await engine.generate(p, **sampling)).tokens for p in PROMPTS[:2]])
            assert speculation(engine)["drafted_tokens"] > 0
    assert runs[0] == runs[1]
    assert all(len(tokens) == 16 for tokens in runs[0])


async def test_batched_rows_decode_plainly_together_and_match(
    mtp_dir: Path, plain_outputs: list[Any]
) -> None:
    async with trio_mlx.open_engine(mtp_dir, max_num_seqs=4, mtp=True) as engine:
        results: dict[int, Any] = {}

        async def run(i: int) -> None:
            results[i] = await engine.generate(PROMPTS[i], **GREEDY)

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(run, i)
        stats = engine.get_stats()
    assert [results[i].tokens for i in range(len(PROMPTS))] == [o.tokens for o in plain_outputs]
    assert any(int(size) > 1 for size in stats["runner"]["batch_sizes"])


@ROUTES
async def test_aborting_mid_stream_frees_the_slot(
    mtp_dir: Path, plain_outputs: list[Any], max_num_seqs: int
) -> None:
    async with trio_mlx.open_engine(mtp_dir, max_num_seqs=max_num_seqs, mtp=True) as engine:
        seen = 0
        async for out in engine.stream_generate(PROMPTS[0], **GREEDY):
            seen += len(out.new_tokens)
            if seen >= 3:
                break
        await eventually(lambda: engine.get_stats()["runner"]["live_sequences"] == 0)
        assert engine.get_stats()["runner"]["aborted"] == 1
        again = await engine.generate(PROMPTS[0], **GREEDY)
    assert again.tokens == plain_outputs[0].tokens


# ---- refusals ---------------------------------------------------------------------------------


async def test_mtp_on_a_model_without_mtp_weights_is_refused(
    plain_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ModelLoadError, match="declares no MTP layer"):
        async with trio_mlx.open_engine(plain_dir, mtp=True):
            pass  # pragma: no cover
    with pytest.raises(ModelLoadError, match="model_type 'llama' has none supported"):
        async with trio_mlx.open_engine(tiny_model_dir, mtp=True):
            pass  # pragma: no cover
    # A config that declares an MTP layer over weights that lack it.
    lying = tmp_path / "declared-only"
    shutil.copytree(plain_dir, lying)
    config = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ModelLoadError, match=r"carries no MTP layer \(no model.layers.2"):
        async with trio_mlx.open_engine(lying, mtp=True):
            pass  # pragma: no cover


def test_serve_mtp_on_a_model_without_mtp_weights_is_one_startup_error_line(
    tiny_model_dir: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_mlx", "serve", str(tiny_model_dir), "--port", "0", "--mtp"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    (line,) = [x for x in done.stderr.splitlines() if "trio-mlx: error" in x]
    assert str(tiny_model_dir) in line and "--mtp needs a model whose checkpoint" in line
    assert "listening" not in done.stderr and "Traceback" not in done.stderr


def test_mtp_settings_are_checked(mtp_dir: Path) -> None:
    with pytest.raises(ValueError, match="mtp_num_draft_tokens"):
        trio_mlx.EngineConfig(model=mtp_dir, mtp=True, mtp_num_draft_tokens=0)
    with pytest.raises(ValueError, match="draft_model"):
        trio_mlx.EngineConfig(model=mtp_dir, mtp=True, draft_model=mtp_dir)
    with pytest.raises(ValueError, match="max_kv_size"):
        trio_mlx.EngineConfig(model=mtp_dir, mtp=True, max_kv_size=64)


def test_the_cli_passes_mtp_to_the_engine(mtp_dir: Path) -> None:
    from trio_mlx.cli import build_parser
    from trio_mlx.http.server import settings_from_args

    args = build_parser().parse_args(
        ["serve", str(mtp_dir), "--mtp", "--mtp-num-draft-tokens", "2"]
    )
    options = settings_from_args(args).engine_options
    assert options["mtp"] is True and options["mtp_num_draft_tokens"] == 2


# ---- the drafter's bookkeeping ------------------------------------------------------------------


def test_the_mtp_cache_after_steps_equals_one_computed_from_scratch(mtp_dir: Path) -> None:
    """After a chunked prefill and several speculative steps (refused drafts, chained entries cut
    back), the MTP block's next draft is the one computed afresh: the target's hidden states over
    the whole sequence, the block over every position from the second (its token with the hidden
    state before it)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.engine.loading import load_model
    from trio_mlx.engine.mtp import MtpDrafter
    from trio_mlx.engine.prompt_cache import make_cache
    from trio_mlx.engine.speculative import Speculator
    from trio_mlx.engine.speculative_sequence import SpeculativeSequence
    from trio_mlx.types import SamplingParams

    loaded = load_model(mtp_dir, mtp=True)
    model = loaded.model
    drafter = MtpDrafter(model)
    speculator = Speculator(model, drafter, num_draft_tokens=3)
    prompt = list(loaded.tokenizer.encode(PROMPTS[1]))
    params = SamplingParams(max_tokens=40, temperature=0.0)
    sequence = SpeculativeSequence(
        speculator,
        GenerationJob(request_id=1, prompt_tokens=tuple(prompt), params=params),
        model,
        loaded.eos_token_ids,
        PrefillPlan(8),  # several prefill chunks, each feeding the MTP block
        vocab_size=49152,
    )
    for _ in range(64):
        if sequence.generated >= 20 or sequence.finished:
            break
        sequence.step()
    assert speculator.counters.steps > 0
    assert speculator.counters.plain_steps == 0  # the prompt's hidden states: drafts at once
    history = list(sequence.fed_tokens())
    state = sequence._draft
    pending = sequence._pending
    assert pending is not None and not sequence.finished
    incremental = drafter.start(state, history, pending)

    full = [*history, pending]
    hidden = model.model(mx.array([full], dtype=mx.uint32), cache=make_cache(model))[0]
    tokens = mx.array([full[1:]], dtype=mx.uint32)
    fresh = model.mtp(model.model.embed_tokens(tokens), hidden[: len(full) - 1][None], KVCache())
    expected = model.lm_head(model.mtp.norm(fresh))[:, -1, :]
    assert mx.allclose(incremental, expected, atol=1e-4).item()
    assert int(mx.argmax(incremental).item()) == int(mx.argmax(expected).item())
