"""The per-request stream actor: token events in, text deltas and a final result out.

`TokenSink` is the request's mailbox. The runner's per-step delivery appends to it and never
blocks: a consumer that falls behind finds several tokens waiting and handles them together
(deltas coalesce) instead of slowing the runner for everyone. It is deliberately not a memory
channel: a bounded one would make the delivery (one call for every live request's tokens)
block or drop tokens when one consumer is slow, and an unbounded one is this list without the
coalescing. What bounds it is the request itself (`max_tokens`). A consumer that has gone
`close()`s it; the next `push` returns False and the runner aborts the request. Its one consumer
waits on the task itself (`wait_task_rescheduled`, woken by `push`): a token costs no `Event`.

`RequestStream` owns the request's detokenizer, stop-string matcher, usage counts and timings, and
turns what the sink holds into `GenerationOutput`s. It runs in the consumer's own task: iterating
it is the actor's loop, so when the consumer goes away (cancelled, or breaks out of its loop), the
actor goes with it and the engine aborts the runner's work for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from trio_mlx.text.detokenizer import IncrementalDetokenizer
from trio_mlx.text.reasoning import ReasoningSplitter
from trio_mlx.text.stop import StopMatcher
from trio_mlx.types import FinishReason, GenerationOutput, SamplingParams, TokenLogprob


@dataclass(slots=True)
class SinkBatch:
    """Everything that arrived for a request since its consumer last looked."""

    tokens: list[int]
    logprobs: list[TokenLogprob]
    finish: FinishReason | None
    error: str | None
    first_token_at: float | None
    last_token_at: float | None


class TokenSink:
    """A request's mailbox: filled by the runner's deliveries on the Trio thread, drained by its
    `RequestStream`. `push` never blocks; once a finish has been pushed, later pushes are ignored.
    """

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._finish: FinishReason | None = None
        self._error: str | None = None
        #: The consumer's task while it waits in `next_batch` (woken by `push`).
        self._waiter: trio.lowlevel.Task | None = None
        self.closed = False
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        #: Prompt tokens the runner restored from the prefix cache (known from its first event).
        self.cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self._finish is not None

    def push(
        self,
        tokens: Sequence[int] = (),
        finish: FinishReason | None = None,
        error: str | None = None,
        logprobs: Sequence[TokenLogprob] = (),
        cached_tokens: int = 0,
    ) -> bool:
        """Add tokens and/or the finish. False when the consumer has gone (the request is dead)."""
        if self.closed:
            return False
        if self._finish is not None:
            return True
        if cached_tokens:
            self.cached_tokens = cached_tokens
        if tokens:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self._tokens.extend(tokens)
            self._logprobs.extend(logprobs)
        if finish is not None:
            self._finish = finish
            self._error = error
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter)
        return True

    def close(self) -> None:
        """The consumer is gone: later pushes report it."""
        self.closed = True

    async def next_batch(self) -> SinkBatch:
        """Wait until there is something new, and take all of it. One consumer at a time."""
        while not self._tokens and self._finish is None:
            if self._waiter is not None:
                raise RuntimeError("another task is already waiting on this request's tokens")
            self._waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        tokens, self._tokens = self._tokens, []
        logprobs, self._logprobs = self._logprobs, []
        return SinkBatch(
            tokens=tokens,
            logprobs=logprobs,
            finish=self._finish,
            error=self._error,
            first_token_at=self.first_token_at,
            last_token_at=self.last_token_at,
        )

    def _abort_wait(self, _: Any) -> trio.lowlevel.Abort:
        self._waiter = None  # cancelled while waiting
        return trio.lowlevel.Abort.SUCCEEDED


class RequestStream:
    """Async iterator of a request's `GenerationOutput`s; the last one has `finished=True`.

    `on_done` is called (synchronously) as soon as the outcome is known on this side, e.g. when a
    stop string matched, so that the runner can stop generating before the consumer even exits.
    """

    def __init__(
        self,
        *,
        request_id: int,
        sink: TokenSink,
        decode: Callable[[Sequence[int]], str],
        params: SamplingParams,
        prompt_tokens: int,
        submitted_at: float,
        on_done: Callable[[], None],
        reasoning: ReasoningSplitter | None = None,
    ) -> None:
        self.request_id = request_id
        self._reasoning = reasoning
        self._reasoning_text = ""
        self._want_logprobs = params.logprobs
        self._logprobs: list[TokenLogprob] = []
        self._sink = sink
        self._detokenizer = IncrementalDetokenizer(decode)
        self._stop = StopMatcher(params.stop)
        self._prompt_tokens = prompt_tokens
        self._submitted_at = submitted_at
        self._on_done = on_done
        self._text = ""
        self._tokens: list[int] = []
        self._done = False
        self.final: GenerationOutput | None = None

    @property
    def prompt_tokens(self) -> int:
        """The request's prompt length in tokens."""
        return self._prompt_tokens

    @property
    def splits_reasoning(self) -> bool:
        """Whether the reply's reasoning is told from its content (the template renders a
        reasoning block and the request did not turn it off)."""
        return self._reasoning is not None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationOutput:
        if self._done:
            raise StopAsyncIteration
        while True:
            batch = await self._sink.next_batch()
            try:
                output = self._absorb(batch)
            except Exception as exc:  # the tokenizer (or a stop/reasoning matcher) failed
                return self._fail(f"decoding the output failed: {type(exc).__name__}: {exc}")
            if output is not None:
                return output

    def _fail(self, error: str) -> GenerationOutput:
        """End this request with `finish_reason="error"` (its runner work is aborted); the text
        so far stands, the engine keeps serving."""
        self._done = True
        self._on_done()
        output = GenerationOutput(
            text=self._text,
            reasoning=self._reasoning_text,
            tokens=list(self._tokens),
            prompt_tokens=self._prompt_tokens,
            cached_tokens=self._sink.cached_tokens,
            completion_tokens=len(self._tokens),
            finish_reason="error",
            finished=True,
            error=error,
        )
        self.final = output
        return output

    def _absorb(self, batch: SinkBatch) -> GenerationOutput | None:
        new_text: list[str] = []
        new_tokens: list[int] = []
        finish: FinishReason | None = None
        for token in batch.tokens:
            new_tokens.append(token)
            emitted, stopped = self._stop.feed(self._detokenizer.add(token))
            new_text.append(emitted)
            if stopped:
                finish = "stop"
                break
        if finish is None and batch.finish is not None:
            emitted, stopped = self._stop.feed(self._detokenizer.flush())
            new_text.append(emitted)
            if not stopped:
                new_text.append(self._stop.flush())
            finish = "stop" if stopped else batch.finish
        if not new_tokens and finish is None:
            return None
        ended = finish is not None
        self._tokens.extend(new_tokens)
        delta = "".join(new_text)
        new_reasoning = ""
        if self._reasoning is not None:
            new_reasoning, delta = self._reasoning.feed(delta)
            if ended:
                held_reasoning, held_content = self._reasoning.flush()
                new_reasoning += held_reasoning
                delta += held_content
            self._reasoning_text += new_reasoning
        self._text += delta
        new_logprobs: list[TokenLogprob] | None = None
        if self._want_logprobs:
            new_logprobs = batch.logprobs[: len(new_tokens)]
            self._logprobs.extend(new_logprobs)
        output = GenerationOutput(
            text=self._text,
            new_text=delta,
            reasoning=self._reasoning_text,
            new_reasoning=new_reasoning,
            logprobs=list(self._logprobs) if self._want_logprobs else None,
            new_logprobs=new_logprobs,
            tokens=list(self._tokens),
            new_tokens=new_tokens,
            prompt_tokens=self._prompt_tokens,
            cached_tokens=self._sink.cached_tokens,
            completion_tokens=len(self._tokens),
            finish_reason=finish,
            finished=finish is not None,
            error=batch.error if finish == "error" else None,
            stop_sequence=self._stop.stopped_by if finish == "stop" else None,
        )
        if batch.first_token_at is not None:
            ttft = batch.first_token_at - self._submitted_at
            output.time_to_first_token = ttft
            if ttft > 0:
                output.prompt_tps = (self._prompt_tokens - self._sink.cached_tokens) / ttft
        if finish is not None:
            self._done = True
            if (
                batch.first_token_at is not None
                and batch.last_token_at is not None
                and len(self._tokens) > 1
                and batch.last_token_at > batch.first_token_at
            ):
                output.generation_tps = (len(self._tokens) - 1) / (
                    batch.last_token_at - batch.first_token_at
                )
            self.final = output
            self._on_done()
        return output
