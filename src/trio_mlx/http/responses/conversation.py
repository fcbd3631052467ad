"""A Responses request's `instructions` and `input` items as the chat template's conversation.

Messages, earlier `function_call`s (one assistant turn with their calls) and their
`function_call_output`s (tool results) become chat-template messages. An earlier `reasoning`
item goes with the assistant turn after it, as its `reasoning_content`, where the model's chat
template renders reasoning; where it does not, it is left out, as the template leaves out the
reasoning of earlier turns (the Responses API hands reasoning items back to be sent again, and
decides itself which it keeps).

Each message remembers the input item it came from, so that an error about a message names the
request's own field (`input[3].content`, `instructions`) rather than the chat shape's.
"""

from __future__ import annotations

from typing import Any

from trio_mlx.http.chat import template_messages
from trio_mlx.http.errors import APIError
from trio_mlx.http.requests import ChatMessage
from trio_mlx.http.responses.requests import InputItem, InputTokensRequest, ResponsesRequest


def input_messages(
    body: ResponsesRequest | InputTokensRequest, *, keep_reasoning: bool = False
) -> tuple[list[dict[str, Any]], list[int]]:
    """`instructions` and `input` as chat-template messages, and for each message the input item
    it comes from (-1: `instructions`), to name a refused field as the client sent it.
    `keep_reasoning`: the template renders reasoning, so `reasoning` items become the next
    assistant turn's `reasoning_content` (else they are left out)."""
    messages: list[ChatMessage] = []
    where: list[int] = []  # the input item each message comes from (-1: instructions)
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
        where.append(-1)
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
        where.append(0)
    elif body.input is not None:
        reasoning: list[str] = []  # reasoning items waiting for the assistant turn after them
        for i, item in enumerate(body.input):
            if item.type == "reasoning":
                text = item.reasoning(i)
                if keep_reasoning and text:
                    reasoning.append(text)
                continue
            message = _item_message(item, i, messages[-1] if messages else None)
            if message is not None:
                messages.append(message)
                where.append(i)
            turn = message or messages[-1]
            if reasoning and turn.role == "assistant":
                earlier = [turn.reasoning_content] if turn.reasoning_content else []
                turn.reasoning_content = "\n".join([*earlier, *reasoning])
            reasoning = []
    try:
        return template_messages(messages), where
    except APIError as exc:
        name_input_field(exc, where)
        raise


def name_input_field(exc: APIError, where: list[int]) -> None:
    """Name the field as the client sent it: `messages[i]` is the input item that message came
    from (`where[i]`, -1 for `instructions`)."""
    if not exc.param or not exc.param.startswith("messages"):
        return
    if not exc.param.startswith("messages["):
        exc.param = "input" + exc.param[len("messages") :]
        return
    index = int(exc.param[len("messages[") :].split("]")[0])
    rest = exc.param.split("]", 1)[1]
    if 0 <= index < len(where):
        exc.param = f"input[{where[index]}]{rest}" if where[index] >= 0 else "instructions"


def _item_message(item: InputItem, i: int, previous: ChatMessage | None) -> ChatMessage | None:
    """The chat message an input item becomes; None when it joined `previous` (a call of the
    same assistant turn)."""
    if item.type == "function_call":
        if item.call_id is None or item.name is None or item.arguments is None:
            missing = next(k for k in ("call_id", "name", "arguments") if getattr(item, k) is None)
            raise APIError(
                400,
                f"a function_call item needs {missing}",
                param=f"input[{i}].{missing}",
                code="missing_required_parameter",
            )
        call = {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        if previous is not None and previous.role == "assistant":
            previous.tool_calls = [*(previous.tool_calls or []), call]
            return None
        return ChatMessage(role="assistant", content=None, tool_calls=[call])
    if item.type == "function_call_output":
        if item.call_id is None or item.output is None:
            missing = "call_id" if item.call_id is None else "output"
            raise APIError(
                400,
                f"a function_call_output item needs {missing}",
                param=f"input[{i}].{missing}",
                code="missing_required_parameter",
            )
        return ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
    if item.role is None or item.content is None:
        missing = "role" if item.role is None else "content"
        raise APIError(
            400,
            f"a message item needs {missing}",
            param=f"input[{i}].{missing}",
            code="missing_required_parameter",
        )
    return ChatMessage(role=item.role, content=item.content)
