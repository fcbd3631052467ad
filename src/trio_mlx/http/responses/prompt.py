"""A Responses request's prompt as the engine takes it, and `POST /v1/responses/input_tokens`.

`ResponsePrompt` checks what the request asks for (`check_supported`), picks the engine for its
model, resolves the conversation (the items of the response named by `previous_response_id`, or
of the conversation named by `conversation`, then the request's own `input`; the earlier
response's `instructions` do not carry over, as at OpenAI), turns it into chat-template
messages after `instructions` (`conversation.input_messages`) and plans its tools
(`http/tooling.py`: the template's tools, or the fallback system prompt, and a forced call's
grammar). Every refusal is an `APIError` naming the request's own field, raised before anything
is admitted or sent. `count_input_tokens` counts the prompt the same planning gives, so it is
the length `POST /v1/responses` prefills.

`truncation: "auto"` (`truncate`): a conversation longer than the context loses its oldest
input items, the fewest that make it fit (found by halving, each try a token count): never
`instructions`, nor a system or developer message, nor the newest item (nor the call it answers),
and a `function_call_output` whose call is gone goes with it. What is left is the conversation
the response keeps for the next turn.
"""

from __future__ import annotations

import re
from typing import Any

from trio_mlx.engine.prompts import renders_reasoning
from trio_mlx.http.conversations.turn import ConversationTurn
from trio_mlx.http.errors import APIError
from trio_mlx.http.generation import prepare_async
from trio_mlx.http.objects import InputTokenCount
from trio_mlx.http.responses.conversation import input_messages, name_input_field
from trio_mlx.http.responses.items import kept_item, own_items
from trio_mlx.http.responses.requests import InputItem, InputTokensRequest, ResponsesRequest
from trio_mlx.http.responses.store import LaneCache, StoredResponse, previous_response
from trio_mlx.http.state import ServerState
from trio_mlx.http.tooling import plan_tools

_FUNCTION_PARAMETERS = re.compile(r"^tools\[(\d+)\]\.function\.parameters")
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ResponsePrompt:
    """A request's conversation as the engine takes it: its template messages (with what the
    tool plan adds), where each came from (`where`: the field the client sent it in), and the
    conversation's input items as the response keeps them (`items`)."""

    def __init__(
        self,
        state: ServerState,
        body: ResponsesRequest | InputTokensRequest,
        connection: LaneCache | None = None,
    ) -> None:
        body.check_supported()
        self.engine, self.model = state.engine_for(body.model)
        self._body = body
        self._parser = state.settings.tool_call_parser
        #: The response this one continues (`previous_response_id`), or the conversation
        #: (`conversation`): never both (`check_supported`).
        self.previous: StoredResponse | None = None
        self.conversation: ConversationTurn | None = None
        earlier: tuple[dict[str, Any], ...] = ()
        if body.previous_response_id is not None:
            self.previous = previous_response(
                body.previous_response_id, state.responses, connection
            )
            earlier = self.previous.conversation
        elif body.conversation_id is not None:
            self.conversation = ConversationTurn(state.conversations, body.conversation_id)
            earlier = self.conversation.items
        own = own_items(body.input)
        self._models = [*(InputItem.model_validate(item) for item in earlier), *own]
        #: The items as kept: the earlier ones as stored; the request's own are made kept
        #: (`items`) only for a response that is kept.
        self._items: list[dict[str, Any] | InputItem] = [*earlier, *own]
        self._own = len(earlier)  # where the request's own items start
        earlier_field = "previous_response_id" if self.previous is not None else "conversation"
        self._fields = [earlier_field] * len(earlier)
        self._fields += [f"input[{i}]" for i in range(len(own))]
        #: The positions of the items the prompt holds (all but what truncation dropped).
        self._kept = list(range(len(self._items)))
        self._plan()

    def items(self) -> list[dict[str, Any]]:
        """The conversation's input items the prompt holds, oldest first, as kept (the
        request's own given their ids the first time)."""
        kept = []
        for i in self._kept:
            item = self._items[i]
            if isinstance(item, InputItem):
                item = self._items[i] = kept_item(item)
            kept.append(item)
        return kept

    def request_items(self) -> list[dict[str, Any]]:
        """The request's own input items, as kept (the same ids as `items` gives them), all of
        them whether or not truncation dropped some from the prompt: what a conversation
        appends."""
        kept = []
        for i in range(self._own, len(self._items)):
            item = self._items[i]
            if isinstance(item, InputItem):
                item = self._items[i] = kept_item(item)
            kept.append(item)
        return kept

    def _plan(self) -> None:
        tokenizer = self.engine.tokenizer
        messages, where = input_messages(
            self._body.instructions,
            [self._models[i] for i in self._kept],
            [self._fields[i] for i in self._kept],
            keep_reasoning=renders_reasoning(tokenizer),
        )
        body = self._body
        try:
            self.plan = plan_tools(
                messages,
                body.chat_tools(),
                body.tool_choice,
                body.parallel_tool_calls,
                tokenizer=tokenizer,
                parser=self._parser,
                nested_choice=False,
            )
        except APIError as exc:  # about a tool's schema, in the chat shape: the request's field
            exc.param = _FUNCTION_PARAMETERS.sub(r"tools[\1].parameters", exc.param or "") or None
            raise
        self.where = ["instructions"] * (len(self.plan.messages) - len(messages)) + where

    def name_field(self, exc: APIError) -> None:
        """Name the request's own field in an error about a message the engine was given."""
        name_input_field(exc, self.where)

    async def length(self) -> int:
        """The prompt's length in tokens, as the engine would prefill it. With media (a
        vision-language model) the prompt is prepared, the media fetched and processed, so it
        must fit the context (else the 400 `context_length_exceeded`)."""
        engine, plan = self.engine, self.plan
        try:
            if any(isinstance(message["content"], list) for message in plan.messages):
                prepared = await prepare_async(
                    lambda: engine.prepare_chat_async(
                        plan.messages, max_tokens=1, tools=plan.template_tools
                    )
                )
                return len(prepared.prompt_tokens)
            return await prepare_async(
                lambda: engine.count_chat_tokens_async(plan.messages, tools=plan.template_tools)
            )
        except APIError as exc:
            self.name_field(exc)
            raise

    async def truncate(self) -> bool:
        """`truncation: "auto"`: drop the fewest oldest items that make the prompt fit the
        context (see the module docstring); whether it fits now. Nothing is dropped when no
        cut fits."""
        newest = self._models[self._kept[-1]]
        answered = newest.call_id if newest.type == "function_call_output" else None
        droppable = [i for i in self._kept[:-1] if self._droppable(self._models[i], answered)]
        kept = self._kept
        low, high = 1, len(droppable)  # the fewest that may fit, the most that may go
        fitting: list[int] | None = None
        while low <= high:
            count = (low + high) // 2
            self._kept = self._without(kept, droppable[:count])
            self._plan()
            if await self._fits():
                fitting, high = self._kept, count - 1
            else:
                low = count + 1
        self._kept = fitting if fitting is not None else kept
        self._plan()
        return fitting is not None

    @staticmethod
    def _droppable(item: InputItem, answered: str | None) -> bool:
        """Whether truncation may drop `item`: not a system prompt's message, nor the call
        whose output (`answered`) is the newest item."""
        if item.type == "message":
            return item.role not in _KEPT_ROLES
        return not (item.type == "function_call" and item.call_id == answered)

    def _without(self, kept: list[int], dropped: list[int]) -> list[int]:
        """`kept` less `dropped`, and less the function call outputs whose call went with it."""
        models = self._models
        gone = set(dropped)
        calls = {models[i].call_id for i in dropped if models[i].type == "function_call"}
        return [
            i
            for i in kept
            if i not in gone
            and not (models[i].type == "function_call_output" and models[i].call_id in calls)
        ]

    async def _fits(self) -> bool:
        try:
            return await self.length() < self.engine.context_length
        except APIError as exc:
            if exc.code == CONTEXT_LENGTH_EXCEEDED:
                return False
            raise


#: The roles of the messages truncation keeps: the system prompt's.
_KEPT_ROLES = ("system", "developer")


async def count_input_tokens(state: ServerState, body: InputTokensRequest) -> dict[str, Any]:
    """`{"object": "response.input_tokens", "input_tokens": N}`: the length of the prompt
    `POST /v1/responses` would prefill for the same fields (the chat template's rendering,
    tools included, the stored conversation of `previous_response_id` before `input`)."""
    return InputTokenCount(input_tokens=await ResponsePrompt(state, body).length()).dump()
