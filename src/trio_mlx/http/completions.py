"""`POST /v1/completions`, streaming (SSE) and not: a text prompt or token ids, `echo`,
`logprobs` (an integer: how many alternatives per token, 0..20).

Stream framing: `text_completion` chunks with the same `id` and `created`, each with the new
text; the last chunk carries the `finish_reason`; the usage chunk (`choices: []`) when asked;
`data: [DONE]` once. A failure after the stream began: `data: {"error": ...}`, `data: [DONE]`.
A client that goes away aborts the generation at the next step boundary.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from trio_mlx.actors.request import ActiveRequest
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.generation import (
    DONE,
    TokenText,
    failure,
    joined,
    json_bytes,
    json_string,
    new_id,
    openai_finish_reason,
    raise_failure,
    run_to_end,
    sse,
    start,
)
from trio_mlx.http.objects import Completion, CompletionChoice, CompletionLogprobs, Usage
from trio_mlx.http.requests import CompletionRequest
from trio_mlx.http.state import ServerState
from trio_mlx.types import GenerationOutput, TokenLogprob

_TEXT_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'


async def completions(
    state: ServerState, body: CompletionRequest, record: RequestRecord
) -> dict[str, Any] | AsyncIterator[bytes]:
    """Answer one completion request: a JSON body, or the SSE byte stream."""
    body.check_supported()
    engine, model = state.engine_for(body.model)
    record.model = model
    prompt = body.single_prompt()
    options = body.sampling_options()
    if body.logprobs is not None:
        options["logprobs"] = True
        options["top_logprobs"] = body.logprobs
    active = await start(
        lambda: engine.start_generate(
            prompt, max_tokens=body.max_tokens, arrival=record.arrival, **options
        )
    )
    record.prompt_tokens = active.stream.prompt_tokens
    echo = ""
    if body.echo:
        echo = prompt if isinstance(prompt, str) else str(engine.tokenizer.decode(prompt))
    reply = _CompletionReply(
        new_id("cmpl"),
        int(time.time()),
        model,
        TokenText(engine.tokenizer),
        echo=echo,
        with_logprobs=body.logprobs is not None,
    )
    if body.stream:
        return reply.stream(active, record, include_usage=body.include_usage)
    return (await reply.whole(active, record)).dump()


class _CompletionReply:
    """One completion's answer: its id, the whole body, or its SSE chunks."""

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        text: TokenText,
        *,
        echo: str,
        with_logprobs: bool,
    ) -> None:
        self.id = id
        self.created = created
        self.model = model
        self.text = text
        self.echo = echo
        self.with_logprobs = with_logprobs
        # A text chunk without logprobs is the same bytes around its text every time: encoded
        # once here, so that a token costs the encoding of its text (`_text_chunk`).
        head = json_bytes(
            {"id": id, "object": "text_completion", "created": created, "model": model}
        )
        self._text_head = b"data: " + head[:-1] + b',"choices":[{"index":0,"text":'

    def _text_chunk(self, text: str) -> bytes:
        """The SSE event of a chunk carrying only text: the bytes `sse(self._body(
        CompletionChoice(text=text)).dump())` gives."""
        return self._text_head + json_string(text) + _TEXT_TAIL

    def _body(self, choice: CompletionChoice, usage: Usage | None = None) -> Completion:
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        )

    def _logprobs(self, items: list[TokenLogprob], offset: int) -> CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        return self.text.completion_logprobs(items, offset)

    async def whole(self, active: ActiveRequest, record: RequestRecord) -> Completion:
        final = await run_to_end(active, record)
        raise_failure(final)
        choice = CompletionChoice(
            text=self.echo + final.text,
            logprobs=self._logprobs(final.logprobs or [], len(self.echo)),
            finish_reason=openai_finish_reason(final),
        )
        usage = Usage.of(final)
        return self._body(choice, usage)

    async def stream(
        self, active: ActiveRequest, record: RequestRecord, *, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """The SSE body; the events of one output go out as one body chunk (one write)."""
        pending: list[TokenLogprob] = []
        offset = len(self.echo)
        prefix = self.echo
        last: GenerationOutput | None = None
        try:
            async for out in active.stream:
                last = out
                if out.finished:
                    active.close()  # the slot is free before the last events are written
                events: list[bytes] = []
                if out.new_logprobs:
                    pending.extend(out.new_logprobs)
                if out.new_text or (prefix and out.finished):
                    text = prefix + out.new_text
                    prefix = ""
                    if self.with_logprobs:
                        logprobs = self._logprobs(pending, offset)
                        choice = CompletionChoice(text=text, logprobs=logprobs)
                        events.append(sse(self._body(choice).dump()))
                    else:
                        events.append(self._text_chunk(text))
                    pending = []
                    offset += len(out.new_text)
                if out.finished:
                    events += self._final_events(out, pending, offset, include_usage)
                if events:
                    yield joined(events)
                if out.finished:
                    return
        finally:
            active.close()
            record.finish(last)

    def _final_events(
        self, out: GenerationOutput, pending: list[TokenLogprob], offset: int, include_usage: bool
    ) -> list[bytes]:
        """The events after the last text: the finish chunk, the usage, `[DONE]`."""
        error = failure(out)
        if error is not None:
            return [sse(error), DONE]
        reason = openai_finish_reason(out)
        logprobs = self._logprobs(pending, offset) if pending else None
        events = [
            sse(
                self._body(
                    CompletionChoice(text="", logprobs=logprobs, finish_reason=reason)
                ).dump()
            )
        ]
        if include_usage:
            usage = Usage.of(out)
            events.append(
                sse(
                    Completion(
                        id=self.id, created=self.created, model=self.model, choices=[], usage=usage
                    ).dump()
                )
            )
        events.append(DONE)
        return events
