"""How one sequence's steps use the device (`ActiveSequence`, on the tiny random model): the first
token is handed over before anything is queued after it; later steps queue the next token before
reading the current one (pipelined) unless a logits processor must see each token first; and the
tokens are mlx-lm's, greedy, either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from model_wrappers import _Wrapped
from trio_mlx.engine.decode import ActiveSequence, GenerationJob, PrefillPlan
from trio_mlx.engine.loading import load_model
from trio_mlx.types import SamplingParams

PROMPT = tuple(range(5, 45))


class EventModel(_Wrapped):
    """The real model, noting each forward pass as `forward N` (N tokens fed)."""

    def __init__(self, inner: Any, events: list[str]) -> None:
        super().__init__(inner)
        self.events = events

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        self.events.append(f"forward {tokens.shape[1]}")
        return self._inner(tokens, cache=cache)


class Retiring:
    """A logits processor that changes nothing and retires after `calls` calls."""

    def __init__(self, calls: int) -> None:
        self.left = calls
        self.is_retired = False

    def __call__(self, tokens: Any, logits: Any) -> Any:
        self.left -= 1
        self.is_retired = self.left <= 0
        return logits


def run_steps(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, processors: tuple[Any, ...] = ()
) -> tuple[list[list[str]], list[int]]:
    """Every step of a 6-token greedy generation, as the events inside it: `forward N` (the
    model called on N tokens), `queue` (`mx.async_eval`), `read` (a token read back, i.e. the
    step's result); and the tokens."""
    loaded = load_model(model_dir)
    events: list[str] = []
    model = EventModel(loaded.model, events)
    queue = mx.async_eval

    def recording_queue(*arrays: Any) -> None:
        events.append("queue")
        queue(*arrays)

    monkeypatch.setattr(mx, "async_eval", recording_queue)
    job = GenerationJob(
        1, PROMPT, SamplingParams(max_tokens=6, temperature=0.0), logits_processors=processors
    )
    seq = ActiveSequence(
        job,
        model,
        frozenset(),
        PrefillPlan(2048, tail=64),
        vocab_size=len(loaded.tokenizer),
    )
    steps, tokens = [], []
    while not seq.finished:
        events.clear()
        result = seq.step()
        tokens.extend(result.tokens)
        steps.append([*events, "read"])
    monkeypatch.undo()
    reference = [int(t) for t, _ in generate_step(mx.array(PROMPT), loaded.model, max_tokens=6)]
    assert tokens == reference
    return steps, tokens


def test_the_first_token_is_read_before_its_successor_is_queued(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, tokens = run_steps(tiny_model_dir, monkeypatch)
    assert len(tokens) == 6
    # The prompt and the first token in one pass, queued; the second token's graph is built
    # while the device works, but queued only once the first token has been handed over.
    assert steps[0] == ["forward 40", "queue", "forward 1", "read"]
    # Then pipelined: queue what was built, build and queue the next, read the current.
    assert steps[1] == ["queue", "forward 1", "queue", "read"]
    assert steps[2:5] == [["forward 1", "queue", "read"]] * 3
    assert steps[5] == ["read"]  # the last token: nothing after it


def test_with_a_logits_processor_each_token_is_read_before_the_next_is_built(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, _ = run_steps(tiny_model_dir, monkeypatch, processors=(Retiring(3),))
    assert steps[0] == ["forward 40", "queue", "forward 1", "read"]  # built after the read
    assert steps[1] == ["queue", "forward 1", "queue", "read"]
    # From the third token on: the processor (retired after its third call) no longer holds
    # the steps back.
    assert steps[2:5] == [["forward 1", "queue", "read"]] * 3
