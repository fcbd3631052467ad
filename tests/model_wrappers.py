"""Test models: the real tiny model wrapped to follow a script or to fail on cue.

They go through the engine's `loader` hook, so everything else (runner thread, KV cache, sampler,
detokenizer, stop matcher) is the real code path.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from trio_mlx.engine.loading import LoadedModel, load_model


class _Wrapped:
    """Delegates everything to the wrapped mlx-lm model (layers, make_cache, ...)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ScriptedModel(_Wrapped):
    """Runs the real forward pass, then forces the token at absolute position `p` to be
    `script[p - prompt_len]` (greedy), so the completion is exactly `script` (then free)."""

    def __init__(self, inner: Any, prompt_len: int, script: Sequence[int]) -> None:
        super().__init__(inner)
        self.prompt_len = prompt_len
        self.script = list(script)

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        before = cache[0].offset if cache else 0
        logits = self._inner(tokens, cache=cache)
        index = before + tokens.shape[1] - self.prompt_len
        if 0 <= index < len(self.script):
            bias = mx.zeros((logits.shape[-1],), dtype=logits.dtype)
            bias[self.script[index]] = 1e4
            logits = logits + bias
        return logits


class FaultyModel(_Wrapped):
    """Raises `RuntimeError` from the forward pass whenever `poison` is among the input tokens,
    or once the cache holds `fail_at_position` tokens (for a failure in the middle of decoding)."""

    def __init__(self, inner: Any, poison: int, fail_at_position: int | None = None) -> None:
        super().__init__(inner)
        self.poison = poison
        self.fail_at_position = fail_at_position
        self.calls = 0

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        self.calls += 1
        before = cache[0].offset if cache else 0
        if any(self.poison in row for row in tokens.tolist()):  # any row of a batched pass
            raise RuntimeError("injected fault: poison token in the input")
        if self.fail_at_position is not None and before >= self.fail_at_position:
            raise RuntimeError("injected fault while decoding")
        return self._inner(tokens, cache=cache)


class GatedModel(_Wrapped):
    """Blocks each forward pass until the test opens the gate: lets a test hold the runner in
    the middle of a step (a `threading.Event`, set from the test). `held` is set once a forward
    pass waits at the closed gate."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        if not self.gate.is_set():
            self.held.set()
        self.gate.wait(timeout=30)
        return self._inner(tokens, cache=cache)


def wrapping_loader(
    wrap: Callable[[Any], Any],
) -> tuple[Callable[[str | Path | None], LoadedModel], list[Any]]:
    """A loader that wraps the loaded model with `wrap`; the list receives the wrapper."""
    made: list[Any] = []

    def loader(spec: str | Path | None) -> LoadedModel:
        loaded = load_model(spec)
        wrapped = wrap(loaded.model)
        made.append(wrapped)
        return dataclasses.replace(loaded, model=wrapped)

    return loader, made


class PausingModel(_Wrapped):
    """Holds the first forward pass that starts at or past `pause_at` cached positions until the
    test sets `resume`; `paused` is set while it waits (to stop the runner mid-prefill at a
    known place)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.pause_at: int | None = None
        self.paused = threading.Event()
        self.resume = threading.Event()

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        before = cache[0].offset if cache else 0
        if self.pause_at is not None and before >= self.pause_at and not self.resume.is_set():
            self.paused.set()
            self.resume.wait(timeout=30)
        return self._inner(tokens, cache=cache)


def break_the_runner_loop(monkeypatch: Any, at_call: int = 3) -> None:
    """Make the runner's own loop (not the model) raise on its `at_call`-th command batch, which
    kills the runner thread: the engine can no longer serve. Either route's loop (the serialized
    route's `_take_commands`, the batched route's `_apply`)."""
    from trio_mlx.actors import batch_loop, serial_loop

    calls = {"n": 0}

    def dying(original: Any) -> Any:
        def call(*args: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == at_call:
                raise RuntimeError("the runner loop itself broke")
            return original(*args)

        return call

    monkeypatch.setattr(serial_loop, "_take_commands", dying(serial_loop._take_commands))
    monkeypatch.setattr(batch_loop, "_apply", dying(batch_loop._apply))


class RecordingModel(_Wrapped):
    """Records each forward pass as (tokens the cache held before it, tokens fed), and the
    number of tokens the cache holds after it (as the next step sees it)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        before = cache[0].offset if cache else 0
        self.calls.append((before, int(tokens.shape[1])))
        return self._inner(tokens, cache=cache)


class GatedTokenizer:
    """Delegates to the real tokenizer, but holds any `encode` or `apply_chat_template` of a
    text longer than `gate_above` characters until the test sets `release` (at most
    `hold_limit` seconds); `entered` is set while one waits. Tells whether tokenization blocks
    whatever thread runs it."""

    def __init__(self, inner: Any, gate_above: int, hold_limit: float = 5.0) -> None:
        self._inner = inner
        self.gate_above = gate_above
        self.hold_limit = hold_limit
        self.entered = threading.Event()
        self.release = threading.Event()
        #: Whether the held call was let go by the test (False: it timed out).
        self.released_by_test: bool | None = None
        self.held_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def _hold(self, size: int) -> None:
        if size > self.gate_above:
            self.held_calls += 1
            self.entered.set()
            self.released_by_test = self.release.wait(timeout=self.hold_limit)

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self._hold(len(text))
        return self._inner.encode(text, *args, **kwargs)

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        self._hold(sum(len(str(m.get("content", ""))) for m in messages))
        return self._inner.apply_chat_template(messages, *args, **kwargs)


def tokenizer_loader(
    wrap: Callable[[Any], Any],
) -> tuple[Callable[[str | Path | None], LoadedModel], list[Any]]:
    """A loader that wraps the loaded tokenizer with `wrap`; the list receives the wrapper."""
    made: list[Any] = []

    def loader(spec: str | Path | None) -> LoadedModel:
        loaded = load_model(spec)
        wrapped = wrap(loaded.tokenizer)
        made.append(wrapped)
        return dataclasses.replace(loaded, tokenizer=wrapped)

    return loader, made


class ScriptedReplies(_Wrapped):
    """Each request's completion starts with the next script of `replies` (token ids; end one
    with EOS to end the reply there), forced greedily on top of the real forward pass; with no
    script left, the model's own tokens. `prompts` receives each request's prompt tokens but
    the last.

    A request is recognised by its first forward pass, the one that starts at cache offset 0;
    the server must run with `max_num_seqs=1`, `fused_tail_tokens=1`, no prefix cache and
    one-chunk prefills, so that this pass holds the whole prompt but its last token (which the
    next pass feeds, giving the first completion token). Passes before `armed` is set (the
    engine's load-time probes) are not requests.

    Under an output grammar (a forced tool call, a JSON schema) the grammar's mask wins: a
    script token it refuses is not taken, the reply goes on with the model's own choices (the
    random tiny model's, which need not close the grammar within `max_tokens`), and the script
    is out of step from there. Script such a request in the grammar's own format."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.replies: list[list[int]] = []
        self.prompts: list[list[int]] = []
        self.armed = False
        self._script: list[int] | None = None
        self._prompt_len = 0

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        before = cache[0].offset if cache else 0
        fed = int(tokens.shape[1])
        if self.armed and before == 0:
            self.prompts.append(tokens.tolist()[0])
            self._script = self.replies.pop(0) if self.replies else None
            self._prompt_len = fed + 1
        logits = self._inner(tokens, cache=cache)
        index = before + fed - self._prompt_len
        if self._script is not None and 0 <= index < len(self._script):
            bias = mx.zeros((logits.shape[-1],), dtype=logits.dtype)
            bias[self._script[index]] = 1e4
            logits = logits + bias
        return logits
