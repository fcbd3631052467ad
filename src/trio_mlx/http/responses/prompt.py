"""A Responses request's prompt as the engine takes it, and `POST /v1/responses/input_tokens`.

`ResponsePrompt` checks what the request asks for (`check_supported`), picks the engine for its
model, turns `instructions` and `input` into the conversation (`conversation.input_messages`)
and plans its tools (`http/tooling.py`: the template's tools, or the fallback system prompt, and
a forced call's grammar). Every refusal is an `APIError` naming the request's own field, raised
before anything is admitted or sent. `count_input_tokens` counts the prompt the same planning
gives, so it is the length `POST /v1/responses` prefills.
"""

from __future__ import annotations

import re
from typing import Any

from trio_mlx.engine.prompts import renders_reasoning
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import prepare_async
from trio_mlx.http.objects import InputTokenCount
from trio_mlx.http.responses.conversation import input_messages, name_input_field
from trio_mlx.http.responses.requests import InputTokensRequest, ResponsesRequest
from trio_mlx.http.state import ServerState
from trio_mlx.http.tooling import plan_tools

_FUNCTION_PARAMETERS = re.compile(r"^tools\[(\d+)\]\.function\.parameters")


class ResponsePrompt:
    """A request's conversation as the engine takes it: its template messages (with what the
    tool plan adds), and where each came from (`where`: the input item, -1 for `instructions`
    or a message the plan added)."""

    def __init__(self, state: ServerState, body: ResponsesRequest | InputTokensRequest) -> None:
        body.check_supported()
        self.engine, self.model = state.engine_for(body.model)
        tokenizer = self.engine.tokenizer
        messages, where = input_messages(body, keep_reasoning=renders_reasoning(tokenizer))
        try:
            self.plan = plan_tools(
                messages,
                body.chat_tools(),
                body.tool_choice,
                body.parallel_tool_calls,
                tokenizer=tokenizer,
                parser=state.settings.tool_call_parser,
                nested_choice=False,
            )
        except APIError as exc:  # about a tool's schema, in the chat shape: the request's field
            exc.param = _FUNCTION_PARAMETERS.sub(r"tools[\1].parameters", exc.param or "") or None
            raise
        self.where = [-1] * (len(self.plan.messages) - len(messages)) + where

    def name_field(self, exc: APIError) -> None:
        """Name the request's own field in an error about a message the engine was given."""
        name_input_field(exc, self.where)


async def count_input_tokens(state: ServerState, body: InputTokensRequest) -> dict[str, Any]:
    """`{"object": "response.input_tokens", "input_tokens": N}`: the length of the prompt
    `POST /v1/responses` would prefill for the same fields (the chat template's rendering,
    tools included). With media (a vision-language model) the prompt is prepared as a response
    prepares it, the media fetched and processed, so it must fit the context."""
    prompt = ResponsePrompt(state, body)
    engine, plan = prompt.engine, prompt.plan
    try:
        if any(isinstance(message["content"], list) for message in plan.messages):
            prepared = await prepare_async(
                lambda: engine.prepare_chat_async(
                    plan.messages, max_tokens=1, tools=plan.template_tools
                )
            )
            count = len(prepared.prompt_tokens)
        else:
            count = await prepare_async(
                lambda: engine.count_chat_tokens_async(plan.messages, tools=plan.template_tools)
            )
    except APIError as exc:
        prompt.name_field(exc)
        raise
    return InputTokenCount(input_tokens=count).dump()
