"""`POST /v1/chat/completions`, streaming (SSE) and not.

Stream framing: every chunk has the same `id` and `created`; the first chunk with content carries
`role: "assistant"` (no empty chunk is sent ahead of the first token, so clients measure a true
time to first token); content (and `reasoning_content`) deltas follow; then one chunk with an empty
delta and the `finish_reason`; with `stream_options.include_usage`, a chunk with `choices: []` and
the usage; then `data: [DONE]`, exactly once. A request that fails after the stream began ends
with `data: {"error": ...}` and `data: [DONE]`.

When the client goes away, the handler is cancelled and the generation is aborted at the runner's
next step boundary; the admission slot is free at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from trio_mlx.actors.request import ActiveRequest
from trio_mlx.http.access_log import RequestRecord
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import (
    DONE,
    TokenText,
    admit,
    failure,
    json_bytes,
    new_id,
    openai_finish_reason,
    outputs,
    prepare_async,
    raise_failure,
    run_to_end,
    sse,
)
from trio_mlx.http.objects import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    Usage,
)
from trio_mlx.http.requests import ChatCompletionRequest, ChatMessage
from trio_mlx.http.state import ServerState
from trio_mlx.http.structured_output import chat_output_format
from trio_mlx.types import GenerationOutput, TokenLogprob

TEXT_PARTS = {"text", "input_text", "output_text"}
_DELTA_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text content, `developer` as `system`.
    Media parts are refused (this route serves text models)."""
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type == "refusal":
                    texts.append(part.refusal or "")
                elif part.type in TEXT_PARTS:
                    if part.text is None:
                        raise APIError(
                            400,
                            "a text part needs `text`",
                            param=f"messages[{i}].content[{j}].text",
                            code="missing_required_parameter",
                        )
                    texts.append(part.text)
                else:
                    raise APIError(
                        400,
                        f"content parts of type {part.type!r} are not supported "
                        "by this model (text only)",
                        param=f"messages[{i}].content[{j}].type",
                        code="unsupported_value",
                    )
            text: str | None = "\n".join(texts)
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


async def chat_completions(
    state: ServerState, body: ChatCompletionRequest, record: RequestRecord
) -> dict[str, Any] | AsyncIterator[bytes]:
    """Answer one chat completion request: a JSON body, or the SSE byte stream."""
    body.check_supported()
    engine, model = state.engine_for(body.model)
    record.model = model
    messages = template_messages(body.messages)
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    options = body.sampling_options()
    if body.logprobs:
        options["logprobs"] = True
        options["top_logprobs"] = body.top_logprobs or 0
    if body.thinking_token_budget is not None:
        options["thinking_token_budget"] = body.thinking_token_budget
    output_format = chat_output_format(body.response_format)
    if output_format is not None:
        options["output_format"] = output_format
    prepared = await prepare_async(
        lambda: engine.prepare_chat_async(
            messages,
            max_tokens=body.completion_limit,
            tools=tools,
            chat_template_kwargs=body.chat_template_kwargs,
            **options,
        )
    )
    record.prompt_tokens = len(prepared.prompt_tokens)
    active = await admit(engine, prepared)
    reply = _ChatReply(new_id("chatcmpl"), int(time.time()), model, TokenText(engine.tokenizer))
    if body.stream:
        return reply.stream(active, record, include_usage=body.include_usage)
    final = await run_to_end(active, record)
    raise_failure(final)
    return reply.completion(final, with_logprobs=bool(body.logprobs)).dump()


class _ChatReply:
    """One chat completion's answer: its id, the whole body, or its SSE chunks."""

    def __init__(self, id: str, created: int, model: str, text: TokenText) -> None:
        self.id = id
        self.created = created
        self.model = model
        self.text = text
        # A content chunk is the same bytes around its delta every time: encoded once here, so
        # that a token costs one `json.dumps` of its delta (`_delta_chunk`), not three models.
        head = json_bytes(
            {"id": id, "object": "chat.completion.chunk", "created": created, "model": model}
        )
        self._delta_head = b"data: " + head[:-1] + b',"choices":[{"index":0,"delta":'

    def _delta_chunk(self, role: bool, content: str | None, reasoning: str | None) -> bytes:
        """The SSE event of a chunk carrying only a delta (no logprobs, no finish); the same
        bytes as `_chunk` builds for it."""
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        return self._delta_head + json_bytes(delta) + _DELTA_TAIL

    def completion(self, final: GenerationOutput, *, with_logprobs: bool) -> ChatCompletion:
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                ChatChoice(
                    message=AssistantMessage(
                        content=final.text, reasoning_content=final.reasoning or None
                    ),
                    logprobs=self.text.chat_logprobs(final.logprobs or [])
                    if with_logprobs
                    else None,
                    finish_reason=openai_finish_reason(final),
                )
            ],
            usage=Usage.of(final),
        )

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
        role_sent = False
        # Logprobs of tokens whose text is held back (a possible stop string) wait for the
        # chunk that carries their text.
        pending: list[TokenLogprob] = []
        last: GenerationOutput | None = None
        try:
            async for out in outputs(active):
                last = out
                if out.new_logprobs:
                    pending.extend(out.new_logprobs)
                if out.new_text or out.new_reasoning:
                    logprobs = self._take(pending, out)
                    if logprobs is None:
                        yield self._delta_chunk(not role_sent, out.new_text, out.new_reasoning)
                    else:
                        delta = ChatDelta(
                            role=None if role_sent else "assistant",
                            content=out.new_text or None,
                            reasoning_content=out.new_reasoning or None,
                        )
                        yield self._chunk(delta, logprobs=logprobs)
                    role_sent = True
                if not out.finished:
                    continue
                error = failure(out)
                if error is not None:
                    yield sse(error)
                    yield DONE
                    return
                if not role_sent:
                    yield self._chunk(ChatDelta(role="assistant", content=""))
                reason = openai_finish_reason(out)
                yield self._chunk(
                    ChatDelta(), logprobs=self._take(pending, out), finish_reason=reason
                )
                if include_usage:
                    usage = Usage.of(out)
                    yield sse(
                        ChatCompletionChunk(
                            id=self.id,
                            created=self.created,
                            model=self.model,
                            choices=[],
                            usage=usage,
                        ).dump()
                    )
                yield DONE
                return
        finally:
            active.close()
            record.finish(last)

    def _take(self, pending: list[TokenLogprob], out: GenerationOutput) -> ChoiceLogprobs | None:
        if out.logprobs is None or not pending:
            return None
        items = list(pending)
        pending.clear()
        return self.text.chat_logprobs(items)
