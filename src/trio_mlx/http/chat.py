"""`POST /v1/chat/completions`, streaming (SSE) and not.

Stream framing: every chunk has the same `id` and `created`; the first chunk with content carries
`role: "assistant"` (no empty chunk is sent ahead of the first token, so clients measure a true
time to first token); content (and `reasoning_content`) deltas follow; then one chunk with an empty
delta and the `finish_reason`; with `stream_options.include_usage`, a chunk with `choices: []` and
the usage; then `data: [DONE]`, exactly once. A request that fails after the stream began ends
with `data: {"error": ...}` and `data: [DONE]`.

With tools (`http/tooling.py`), the reply's text goes through the model family's call reader:
content stays `content` (text that may start call markup is held until it cannot), a call is
sent as a `tool_calls` delta with its index, id, type and name, then as pieces of its
`arguments`; the finish reason is `tool_calls` when the reply made calls.

When the client goes away, the handler is cancelled and the generation is aborted at the runner's
next step boundary; the admission slot is free at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from trio_mlx.actors.request import ActiveRequest
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.errors import APIError
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
from trio_mlx.http.objects import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    FunctionCall,
    MessageToolCall,
    Usage,
)
from trio_mlx.http.requests import (
    MEDIA_PART_FIELDS,
    TEXT_PART_TYPES,
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
)
from trio_mlx.http.state import ServerState
from trio_mlx.http.structured_output import chat_output_format
from trio_mlx.http.tooling import CallReader, chat_deltas, plan_tools
from trio_mlx.types import GenerationOutput, TokenLogprob

TEXT_PARTS = frozenset(TEXT_PART_TYPES)
#: content parts carrying media: passed on to the engine, which fetches them for a
#: vision-language model and refuses them (400 naming the part) for a text model
MEDIA_PARTS = frozenset(MEDIA_PART_FIELDS)
_DELTA_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'
_CONTENT_TAIL = b"}" + _DELTA_TAIL


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text content, `developer` as `system`.
    A message with media parts keeps its content as a list of parts (text parts as
    `{"type": "text"}`, media parts as sent) for the engine, which fetches the media for a
    vision-language model and refuses them, naming the part, for a text model."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        text: str | list[dict[str, Any]] | None
        if isinstance(content, list) and any(part.type in MEDIA_PARTS for part in content):
            text = _media_content(content, i)
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type == "refusal":
                    texts.append(part.refusal or "")
                elif part.type in TEXT_PARTS:
                    texts.append(_part_text(part, i, j))
                else:
                    raise APIError(
                        400,
                        f"content parts of type {part.type!r} are not supported "
                        "by this model (text only)",
                        param=f"messages[{i}].content[{j}].type",
                        code="unsupported_value",
                    )
            text = "\n".join(texts)
        else:
            text = content
        if text is None and message.role not in ("assistant", "tool"):
            raise APIError(
                400,
                f"a {message.role} message needs content",
                param=f"messages[{i}].content",
                code="missing_required_parameter",
            )
        item: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": text or "",
        }
        # `reasoning_content` goes to the template, which renders it or is refused for it
        # (`prompts.check_reasoning_rendered`): never accepted and dropped.
        for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(message, name)
            if value is not None:
                item[name] = value
        out.append(item)
    return out


def _part_text(part: ContentPart, i: int, j: int) -> str:
    if part.text is None:
        raise APIError(
            400,
            "a text part needs `text`",
            param=f"messages[{i}].content[{j}].text",
            code="missing_required_parameter",
        )
    return part.text


def _media_content(content: list[ContentPart], i: int) -> list[dict[str, Any]]:
    """A content list with media, as parts (`multimodal.parts` reads them)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type in MEDIA_PARTS:
            parts.append(part.model_dump(exclude_none=True))
        elif part.type == "refusal":
            parts.append({"type": "text", "text": part.refusal or ""})
        elif part.type in TEXT_PARTS:
            parts.append({"type": "text", "text": _part_text(part, i, j)})
        else:
            raise APIError(
                400,
                f"content parts of type {part.type!r} are not supported",
                param=f"messages[{i}].content[{j}].type",
                code="unsupported_value",
            )
    return parts


async def chat_completions(
    state: ServerState, body: ChatCompletionRequest, record: RequestRecord
) -> dict[str, Any] | AsyncIterator[bytes]:
    """Answer one chat completion request: a JSON body, or the SSE byte stream."""
    body.check_supported()
    engine, model = state.engine_for(body.model)
    record.model = model
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    plan = plan_tools(
        template_messages(body.messages),
        tools or None,
        body.tool_choice,
        body.parallel_tool_calls,
        tokenizer=engine.tokenizer,
        parser=state.settings.tool_call_parser,
    )
    options = body.sampling_options() | plan.options
    if body.logprobs:
        options["logprobs"] = True
        options["top_logprobs"] = body.top_logprobs or 0
    if body.thinking_token_budget is not None:
        options["thinking_token_budget"] = body.thinking_token_budget
    output_format = chat_output_format(body.response_format)
    if output_format is not None:  # a forced tool call's grammar (plan.options) comes first:
        options.setdefault("output_format", output_format)  # its reply has no content
    active = await start(
        lambda: engine.start_chat(
            plan.messages,
            max_tokens=body.completion_limit,
            tools=plan.template_tools,
            chat_template_kwargs=body.chat_template_kwargs,
            arrival=record.arrival,
            **options,
        )
    )
    record.prompt_tokens = active.stream.prompt_tokens
    reply = _ChatReply(
        new_id("chatcmpl"), int(time.time()), model, TokenText(engine.tokenizer), plan.reader()
    )
    if body.stream:
        return reply.stream(active, record, include_usage=body.include_usage)
    final = await run_to_end(active, record)
    raise_failure(final)
    return reply.completion(final, with_logprobs=bool(body.logprobs)).dump()


class _ChatReply:
    """One chat completion's answer: its id, the whole body, or its SSE chunks."""

    def __init__(
        self, id: str, created: int, model: str, text: TokenText, calls: CallReader | None = None
    ) -> None:
        self.id = id
        self.created = created
        self.model = model
        self.text = text
        #: Reads function calls out of the reply (None: the reply is all content).
        self.calls = calls
        # A content chunk is the same bytes around its delta every time: encoded once here, so
        # that a token costs one `json.dumps` of its delta (`_delta_chunk`), not three models.
        head = json_bytes(
            {"id": id, "object": "chat.completion.chunk", "created": created, "model": model}
        )
        self._delta_head = b"data: " + head[:-1] + b',"choices":[{"index":0,"delta":'
        self._content_head = self._delta_head + b'{"content":'
        #: Whether a chunk has carried `role` (the first one does).
        self._role_sent = False
        #: Logprobs of tokens whose text is held back (a possible stop string) wait for the
        #: chunk that carries their text.
        self._pending: list[TokenLogprob] = []

    def _delta_chunk(self, role: bool, content: str | None, reasoning: str | None) -> bytes:
        """The SSE event of a chunk carrying only a delta (no logprobs, no finish); the same
        bytes as `_chunk` builds for it, with only the delta's strings encoded."""
        if content and not role and not reasoning:  # nearly every token's chunk
            return self._content_head + json_string(content) + _CONTENT_TAIL
        fields = [b'"role":"assistant"'] if role else []
        if content:
            fields.append(b'"content":' + json_string(content))
        if reasoning:
            fields.append(b'"reasoning_content":' + json_string(reasoning))
        return self._delta_head + b"{" + b",".join(fields) + b"}" + _DELTA_TAIL

    def completion(self, final: GenerationOutput, *, with_logprobs: bool) -> ChatCompletion:
        content: str | None = final.text
        reasoning = final.reasoning
        tool_calls = None
        if self.calls is not None:
            parsed = self.calls.parse(final.text)
            reasoning += parsed.reasoning
            content = parsed.content
            if parsed.calls:
                content = content or None
                tool_calls = [
                    MessageToolCall(
                        id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)
                    )
                    for c in parsed.calls
                ]
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                ChatChoice(
                    message=AssistantMessage(
                        content=content, reasoning_content=reasoning or None, tool_calls=tool_calls
                    ),
                    logprobs=self.text.chat_logprobs(final.logprobs or [])
                    if with_logprobs
                    else None,
                    finish_reason=self._finish_reason(final),
                )
            ],
            usage=Usage.of(final),
        )

    def _finish_reason(self, final: GenerationOutput) -> Literal["stop", "length", "tool_calls"]:
        """OpenAI's reason; "tool_calls" when the reply made calls (and was not cut short)."""
        reason = openai_finish_reason(final)
        if reason == "stop" and self.calls is not None and self.calls.calls:
            return "tool_calls"
        return reason

    def _chunk(
        self,
        delta: ChatDelta,
        *,
        logprobs: ChoiceLogprobs | None = None,
        finish_reason: Any = None,
    ) -> bytes:
        choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        ).dump()
        # OpenAI sends both keys on every choice of a chunk, null when there is nothing.
        chunk["choices"][0].setdefault("logprobs", None)
        chunk["choices"][0].setdefault("finish_reason", None)
        return sse(chunk)

    async def stream(
        self, active: ActiveRequest, record: RequestRecord, *, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """The SSE body. The events of one output (its content, then at the end the finish
        chunk, the usage and `[DONE]`) go out as one body chunk: one write, the same events."""
        last: GenerationOutput | None = None
        try:
            async for out in active.stream:
                last = out
                if out.finished:
                    active.close()  # the slot is free before the last events are written
                events = self._events(out, include_usage)
                if events:
                    yield joined(events)
                if out.finished:
                    return
        finally:
            active.close()
            record.finish(last)

    def _events(self, out: GenerationOutput, include_usage: bool) -> list[bytes]:
        """The SSE events of one output, in order."""
        pending = self._pending
        if out.new_logprobs:
            pending.extend(out.new_logprobs)
        events: list[bytes] = []
        if self.calls is not None:
            events += self._call_chunks(out, pending, self._role_sent)
            self._role_sent = self._role_sent or bool(events)
        elif out.new_text or out.new_reasoning:
            logprobs = self._take(pending, out)
            if logprobs is None:
                events.append(
                    self._delta_chunk(not self._role_sent, out.new_text, out.new_reasoning)
                )
            else:
                delta = ChatDelta(
                    role=None if self._role_sent else "assistant",
                    content=out.new_text or None,
                    reasoning_content=out.new_reasoning or None,
                )
                events.append(self._chunk(delta, logprobs=logprobs))
            self._role_sent = True
        if not out.finished:
            return events
        error = failure(out)
        if error is not None:
            events += (sse(error), DONE)
            return events
        if not self._role_sent:
            events.append(self._chunk(ChatDelta(role="assistant", content="")))
        reason = self._finish_reason(out)
        events.append(
            self._chunk(ChatDelta(), logprobs=self._take(pending, out), finish_reason=reason)
        )
        if include_usage:
            usage = Usage.of(out)
            events.append(
                sse(
                    ChatCompletionChunk(
                        id=self.id, created=self.created, model=self.model, choices=[], usage=usage
                    ).dump()
                )
            )
        events.append(DONE)
        return events

    def _call_chunks(
        self, out: GenerationOutput, pending: list[TokenLogprob], role_sent: bool
    ) -> list[bytes]:
        """The chunks of one output when calls are read: its reasoning, then what the call
        reader makes of its text (content, call starts, argument pieces); at the end, what the
        reader held back. Pending logprobs ride on the first chunk."""
        assert self.calls is not None
        deltas = []
        if out.new_reasoning:
            deltas.append(ChatDelta(reasoning_content=out.new_reasoning))
        events = self.calls.feed(out.new_text)
        if out.finished and failure(out) is None:
            events += self.calls.finish()
        deltas += chat_deltas(events)
        chunks = []
        for delta in deltas:
            if not role_sent:
                delta.role = "assistant"
                role_sent = True
            chunks.append(self._chunk(delta, logprobs=self._take(pending, out)))
        return chunks

    def _take(self, pending: list[TokenLogprob], out: GenerationOutput) -> ChoiceLogprobs | None:
        if out.logprobs is None or not pending:
            return None
        items = list(pending)
        pending.clear()
        return self.text.chat_logprobs(items)
