"""A Responses request's `instructions` and `input` items as the chat template's conversation.

Messages, earlier `function_call`s (one assistant turn with their calls) and their
`function_call_output`s (tool results) become chat-template messages. An earlier `reasoning`
item goes with the assistant turn after it, as its `reasoning_content`, where the model's chat
template renders reasoning; where it does not, it is left out, as the template leaves out the
reasoning of earlier turns (the Responses API hands reasoning items back to be sent again, and
decides itself which it keeps).

Each message remembers the field it came from, so that an error about a message names the
request's own field (`input[3].content`, `instructions`, `previous_response_id` for an item of
the conversation it continues) rather than the chat shape's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trio_mlx.http.chat import template_messages
from trio_mlx.http.errors import APIError
from trio_mlx.http.requests import ChatMessage
from trio_mlx.http.responses.requests import InputItem


def input_messages(
    instructions: str | None,
    items: Sequence[InputItem],
    fields: Sequence[str],
    *,
    keep_reasoning: bool = False,
) -> tuple[list[dict[str, Any]], list[str]]:
    """`instructions` and the conversation's input `items` as chat-template messages, and for
    each message the field it comes from as the client sent it (`fields[i]` names `items[i]`:
    `input[3]`, or `previous_response_id` for the items of the response it continues), to name
    a refused field. `keep_reasoning`: the template renders reasoning, so `reasoning` items
    become the next assistant turn's `reasoning_content` (else they are left out)."""
    messages: list[ChatMessage] = []
    where: list[str] = []  # the field each message comes from
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
        where.append("instructions")
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn after them
    for item, field in zip(items, fields, strict=True):
        if item.type == "reasoning":
            text = item.reasoning(field)
            if keep_reasoning and text:
                reasoning.append(text)
            continue
        message = _item_message(item, field, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
            where.append(field)
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


def name_input_field(exc: APIError, where: Sequence[str]) -> None:
    """Name the field as the client sent it: `messages[i]` is the field that message came from
    (`where[i]`: an input item, `input[3]` or `items[3]`, with the rest of the path;
    `instructions`, `previous_response_id` or `conversation`, alone)."""
    if not exc.param or not exc.param.startswith("messages"):
        return
    if not exc.param.startswith("messages["):
        exc.param = "input" + exc.param[len("messages") :]
        return
    index = int(exc.param[len("messages[") :].split("]")[0])
    rest = exc.param.split("]", 1)[1]
    if 0 <= index < len(where):
        field = where[index]
        exc.param = field + rest if field.endswith("]") else field


def _item_message(item: InputItem, field: str, previous: ChatMessage | None) -> ChatMessage | None:
    """The chat message an input item becomes; None when it joined `previous` (a call of the
    same assistant turn)."""
    if item.type == "function_call":
        if item.call_id is None or item.name is None or item.arguments is None:
            missing = next(k for k in ("call_id", "name", "arguments") if getattr(item, k) is None)
            raise APIError(
                400,
                f"a function_call item needs {missing}",
                param=f"{field}.{missing}",
                code="missing_required_parameter",
            )
        if not item.name:
            raise APIError(
                400, "a function_call item's name must not be empty", param=f"{field}.name"
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
                param=f"{field}.{missing}",
                code="missing_required_parameter",
            )
        return ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
    if item.role is None or item.content is None:
        missing = "role" if item.role is None else "content"
        raise APIError(
            400,
            f"a message item needs {missing}",
            param=f"{field}.{missing}",
            code="missing_required_parameter",
        )
    return ChatMessage(role=item.role, content=item.content)
