"""Jump-forward decoding under a grammar (`structured/forced_runs.py`, `ActiveSequence`), on the
tiny random model on the serialized route: the runs of tokens a grammar forces go through the
model in one forward pass each, and the tokens are exactly those of one step a token; sampled
requests and requests with logprobs keep one step a token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trio_mlx
from test_structured_output import FORMAT, PERSON, USER, assert_valid
from trio_mlx.engine import decode
from trio_mlx.engine.decode import ActiveSequence
from trio_mlx.structured.forced_runs import MAX_RUN, forced_run
from trio_mlx.structured.masked_choice import forced_tokens


async def run_both(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, requests: list[dict[str, Any]]
) -> dict[bool, list[tuple[Any, int]]]:
    """Each request's output and the decode steps it took, with jump-forward off and on."""
    found: dict[bool, list[tuple[Any, int]]] = {}
    for on in (False, True):
        monkeypatch.setattr(ActiveSequence, "jump_forward", on)
        found[on] = []
        async with trio_mlx.open_engine(model_dir, max_num_seqs=1) as engine:
            for options in requests:
                before = engine.get_stats()["runner"]["decode_steps"]
                out = await engine.chat(USER, output_format=FORMAT, **options)
                steps = engine.get_stats()["runner"]["decode_steps"] - before
                found[on].append((out, steps))
    return found


async def test_forced_runs_take_one_pass_and_give_the_same_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = await run_both(tiny_model_dir, monkeypatch, [{"max_tokens": 120, "temperature": 0}])
    (off, off_steps), (on, on_steps) = found[False][0], found[True][0]
    assert on.tokens == off.tokens and on.finish_reason == off.finish_reason == "stop"
    assert_valid(on.text, PERSON)
    assert on_steps < off_steps / 2  # most of a JSON object is forced


async def test_max_tokens_inside_a_run_cuts_where_one_step_a_token_does(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = [{"max_tokens": n, "temperature": 0} for n in (1, 2, 3, 5, 8, 13)]
    found = await run_both(tiny_model_dir, monkeypatch, requests)
    for (off, _), (on, _), request in zip(found[False], found[True], requests, strict=True):
        assert on.tokens == off.tokens and len(on.tokens) == request["max_tokens"]
        assert on.finish_reason == off.finish_reason == "length"


async def test_sampled_and_logprob_requests_keep_one_step_a_token(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = [
        {"max_tokens": 40, "temperature": 0.8, "seed": 7},
        {"max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    ]
    found = await run_both(tiny_model_dir, monkeypatch, requests)
    for (off, off_steps), (on, on_steps) in zip(found[False], found[True], strict=True):
        assert on.tokens == off.tokens and on_steps == off_steps
    assert found[True][1][0].logprobs == found[False][1][0].logprobs


async def test_padded_runs_as_on_a_gpu_give_the_same_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where attention shapes must recur (CUDA) a run's pass is padded to `MAX_RUN` tokens over
    the cache's whole buffer and the padding trimmed: the same tokens."""
    found = await run_both(tiny_model_dir, monkeypatch, [{"max_tokens": 120, "temperature": 0}])
    monkeypatch.setattr(decode, "padded_attention_default", lambda: True)
    padded = await run_both(tiny_model_dir, monkeypatch, [{"max_tokens": 120, "temperature": 0}])
    assert padded[True][0][0].tokens == found[False][0][0].tokens


def test_a_run_stops_at_a_choice_at_its_limit_and_at_the_end(tiny_model_dir: Path) -> None:
    from trio_mlx.engine.loading import load_model
    from trio_mlx.structured.compiler import GrammarCompiler

    loaded = load_model(tiny_model_dir)
    width = len(loaded.tokenizer)
    compiled = GrammarCompiler(loaded.tokenizer).compile(FORMAT)
    grammar = compiled.matcher()
    run = forced_run(grammar, width, MAX_RUN)
    assert run  # `{"name": "` is forced from the start
    # each was the only token its mask allowed: replayed on a fresh matcher, they are forced again
    replay = compiled.matcher()
    for token in run:
        assert forced_tokens(replay.allowed_words()[None], width) == [token]
        replay.consume(token)
    # the run ends where the model chooses (the name's first character) or at its limit
    stop = forced_tokens(grammar.allowed_words()[None], width)
    assert stop == [None] or len(run) == MAX_RUN
    limited = compiled.matcher()
    assert forced_run(limited, width, 1) == run[:1]


# ---- the batched route's lone row (`engine/batch_jump.py`) -------------------------------------


def batched_run(
    model_dir: Path, jump: bool, max_tokens: int, companion_at: int | None = None
) -> tuple[dict[int, list[int]], dict[int, str | None], int]:
    """A constrained greedy request alone on a `BatchDecoder` (as `batch_loop` steps it), and
    optionally a plain companion joining after `companion_at` steps: every request's tokens and
    finish, and the forward passes taken."""
    from model_wrappers import _Wrapped
    from trio_mlx.engine.batch import BatchDecoder
    from trio_mlx.engine.decode import GenerationJob, PrefillPlan
    from trio_mlx.engine.loading import load_model
    from trio_mlx.structured.compiler import GrammarCompiler
    from trio_mlx.types import SamplingParams

    class Counted(_Wrapped):
        passes = 0

        def __call__(self, tokens: Any, cache: Any = None) -> Any:
            Counted.passes += 1
            return self._inner(tokens, cache=cache)

    loaded = load_model(model_dir)
    model = Counted(loaded.model)
    batch = BatchDecoder(
        model,
        loaded.eos_token_ids,
        vocab_size=len(loaded.tokenizer),
        plan=PrefillPlan(2048),
        split_at_store_points=False,
    )
    batch.jump_forward = jump
    grammar = GrammarCompiler(loaded.tokenizer).compile(FORMAT)
    prompt = tuple(range(5, 30))
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    batch.add(GenerationJob(1, prompt, greedy, grammar=grammar), None, 0)
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str | None] = {}
    steps = 0
    while batch.busy:
        if batch.waiting:
            batch.prefill(4096, 60.0)
            batch.join()
        step = batch.jump() if batch.can_jump() else batch.decode()
        for result in step:
            assert result.error is None
            tokens.setdefault(result.seq.request_id, []).extend(result.tokens)
            if result.finish is not None:
                finish[result.seq.request_id] = result.finish
        steps += 1
        if steps == companion_at:
            plain = SamplingParams(max_tokens=12, temperature=0.0)
            batch.add(GenerationJob(2, tuple(range(40, 52)), plain), None, 0)
    return tokens, finish, Counted.passes


@pytest.mark.usefixtures("batch_pipeline")
@pytest.mark.parametrize("max_tokens", [7, 120])
def test_a_lone_batched_row_jumps_forward_with_the_same_tokens(
    tiny_model_dir: Path, max_tokens: int
) -> None:
    off, off_finish, off_passes = batched_run(tiny_model_dir, False, max_tokens)
    on, on_finish, on_passes = batched_run(tiny_model_dir, True, max_tokens)
    assert on == off and on_finish == off_finish
    assert on_passes < off_passes
    if max_tokens == 120:
        assert_valid(bytes_text(tiny_model_dir, on[1]), PERSON)
        assert on_passes < off_passes * 0.7


@pytest.mark.usefixtures("batch_pipeline")
def test_a_companion_joining_ends_the_jumps_and_both_keep_their_tokens(
    tiny_model_dir: Path,
) -> None:
    off, _, _ = batched_run(tiny_model_dir, False, 120, companion_at=3)
    on, _, _ = batched_run(tiny_model_dir, True, 120, companion_at=3)
    assert on == off and len(on[2]) == 12


def bytes_text(model_dir: Path, tokens: list[int]) -> str:
    from trio_mlx.engine.loading import load_model

    return str(load_model(model_dir).tokenizer.decode(tokens))


async def test_the_batched_route_through_the_engine_gives_the_same_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_mlx.engine.batch import BatchDecoder

    found = {}
    for on in (False, True):
        monkeypatch.setattr(BatchDecoder, "jump_forward", on)
        async with trio_mlx.open_engine(tiny_model_dir, max_num_seqs=4) as engine:
            out = await engine.chat(USER, output_format=FORMAT, max_tokens=120, temperature=0)
            found[on] = (out.tokens, out.finish_reason, engine.get_stats()["runner"]["steps"])
    assert found[True][:2] == found[False][:2]
    assert found[True][2] < found[False][2]  # fewer runner steps
    assert_valid(bytes_text(tiny_model_dir, list(found[True][0])), PERSON)
