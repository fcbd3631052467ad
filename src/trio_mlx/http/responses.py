"""`POST /v1/responses` and its WebSocket mode: the Responses API over one text output message.

`response_events` turns one request into the API's event sequence — `response.created`,
`response.in_progress`, `response.output_item.added`, `response.content_part.added`, one
`response.output_text.delta` per piece of text, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, then `response.completed` (or
`response.incomplete` when `max_output_tokens` ran out, `response.failed` when generation
failed). The SSE route frames them with `event:` lines (no `[DONE]`: the Responses API has none);
the WebSocket sends each as one JSON message; the non-streaming route returns the final response.

Validation and admission errors are raised (as `APIError`) before the first event. A client that
goes away aborts the generation at the next step boundary.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from trio_mlx.actors.engine import Engine
from trio_mlx.actors.request import ActiveRequest
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.chat import template_messages
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import admit, failure, new_id, outputs, prepare_async, run_to_end
from trio_mlx.http.objects import (
    ErrorDetail,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseStreamEvent,
    ResponseUsage,
)
from trio_mlx.http.requests import ChatMessage, ResponsesRequest
from trio_mlx.http.state import ServerState
from trio_mlx.http.structured_output import responses_output_format
from trio_mlx.types import GenerationOutput


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat-template messages."""
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
    else:
        for item in body.input:
            messages.append(ChatMessage(role=item.role, content=item.content))
    try:
        return template_messages(messages)
    except APIError as exc:  # name the field as the client sent it
        if exc.param and exc.param.startswith("messages") and body.instructions:
            index = int(exc.param[len("messages[") :].split("]")[0]) - 1
            exc.param = f"input[{index}]" + exc.param.split("]", 1)[1]
        elif exc.param:
            exc.param = "input" + exc.param[len("messages") :]
        raise


async def start_response(
    state: ServerState, body: ResponsesRequest, record: RequestRecord
) -> ResponseRun:
    """Validate and admit a Responses request; raises `APIError` before anything is sent."""
    body.check_supported()
    engine, model = state.engine_for(body.model)
    record.model = model
    messages = input_messages(body)
    options = body.sampling_options()
    output_format = responses_output_format(body.text.format if body.text else None)
    if output_format is not None:
        options["output_format"] = output_format
    prepared = await prepare_async(
        lambda: engine.prepare_chat_async(messages, max_tokens=body.max_output_tokens, **options)
    )
    record.prompt_tokens = len(prepared.prompt_tokens)
    active = await admit(engine, prepared)
    return ResponseRun(engine, model, body, active, record)


class ResponseRun:
    """One admitted response: its events, or its final object."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        body: ResponsesRequest,
        active: ActiveRequest,
        record: RequestRecord,
    ) -> None:
        self.engine = engine
        self.model = model
        self.body = body
        self.active = active
        self.record = record
        self.id = new_id("resp")
        self.message_id = new_id("msg")
        self.created_at = int(time.time())
        self._sequence = 0

    def close(self) -> None:
        self.active.close()

    def response(
        self, status: str, text: str | None = None, final: GenerationOutput | None = None
    ) -> ResponseObject:
        output = []
        if text is not None:
            output.append(
                OutputMessage(
                    id=self.message_id,
                    status="incomplete" if status == "incomplete" else "completed",
                    content=[OutputText(text=text)],
                )
            )
        usage = None
        incomplete = None
        error = None
        if final is not None:
            usage = ResponseUsage(
                input_tokens=final.prompt_tokens,
                output_tokens=final.completion_tokens,
                total_tokens=final.prompt_tokens + final.completion_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=final.cached_tokens),
            )
            if final.finish_reason == "length":
                incomplete = IncompleteDetails(reason="max_output_tokens")
            failed = failure(final)
            if failed is not None:
                error = ErrorDetail(**failed["error"])
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            status=status,  # type: ignore[arg-type]
            model=self.model,
            output=output,
            instructions=self.body.instructions,
            max_output_tokens=self.body.max_output_tokens,
            temperature=self.body.temperature,
            top_p=self.body.top_p,
            incomplete_details=incomplete,
            error=error,
            usage=usage,
            metadata=self.body.metadata or {},
            output_text=text,
        )

    def _event(self, type: str, **fields: Any) -> dict[str, Any]:
        event = ResponseStreamEvent(type=type, sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event.dump()

    async def final(self) -> dict[str, Any]:
        """Run to the end; the response object (completed, incomplete or failed)."""
        last = await run_to_end(self.active, self.record)
        return self.response(_status(last), last.text, last).dump()

    async def events(self) -> AsyncGenerator[dict[str, Any]]:
        """The event sequence of a streamed response."""
        last: GenerationOutput | None = None
        try:
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            item = OutputMessage(id=self.message_id, status="in_progress", content=[])
            where: dict[str, Any] = {"item_id": self.message_id, "output_index": 0}
            yield self._event("response.output_item.added", output_index=0, item=item)
            yield self._event(
                "response.content_part.added",
                **where,
                content_index=0,
                part=OutputText(text=""),
            )
            async for out in outputs(self.active):
                last = out
                if out.new_text:
                    yield self._event(
                        "response.output_text.delta",
                        **where,
                        content_index=0,
                        delta=out.new_text,
                        logprobs=[],
                    )
                if not out.finished:
                    continue
                status = _status(out)
                if status != "failed":
                    part = OutputText(text=out.text)
                    yield self._event(
                        "response.output_text.done",
                        **where,
                        content_index=0,
                        text=out.text,
                        logprobs=[],
                    )
                    yield self._event(
                        "response.content_part.done", **where, content_index=0, part=part
                    )
                    done = OutputMessage(
                        id=self.message_id,
                        status="incomplete" if status == "incomplete" else "completed",
                        content=[part],
                    )
                    yield self._event("response.output_item.done", output_index=0, item=done)
                yield self._event(
                    f"response.{status}", response=self.response(status, out.text, out)
                )
                return
        finally:
            self.close()
            self.record.finish(last)


def _status(final: GenerationOutput) -> str:
    if final.finish_reason in ("error", "abort"):
        return "failed"
    return "incomplete" if final.finish_reason == "length" else "completed"
