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
