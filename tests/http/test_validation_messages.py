"""A refused body's message names what is wrong with what was sent: where a field takes several
shapes (a string or a list of blocks), the error is the one of the shape the client used, not
the first shape pydantic tried."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from trio_mlx.http.anthropic.requests import MessagesRequest
from trio_mlx.http.errors import from_validation_error
from trio_mlx.http.requests import ChatCompletionRequest, CompletionRequest

HI = [{"role": "user", "content": "hi"}]
ANTHROPIC = {"model": "m", "max_tokens": 4, "messages": HI}


def refusal(model: type[BaseModel], body: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    error = from_validation_error(caught.value)
    assert error.status == 400
    return error.param, str(error.message)


@pytest.mark.parametrize(
    ("model", "body", "param", "says"),
    [
        # A list of five: "Input should be a valid string" blamed the string shape.
        (ChatCompletionRequest, {"messages": HI, "stop": list("abcde")}, "stop", "at most 4"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
            "valid string",
        ),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": ["hi"]}]},
            "messages[0].content[0]",
            "",
        ),
        (
            MessagesRequest,
            {**ANTHROPIC, "system": [{"type": "text"}]},
            "system[0].text",
            "required",
        ),
        (
            MessagesRequest,
            {**ANTHROPIC, "messages": [{"role": "user", "content": [{"type": "txt"}]}]},
            "messages[0].content[0].type",
            "'text'",
        ),
        (CompletionRequest, {"prompt": ["a", "b"]}, "prompt", "at most 1 item"),
        # Sent in neither shape: the first shape's error still stands.
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "string",
        ),
        (ChatCompletionRequest, {"messages": HI, "stop": 5}, "stop", "string"),
        # A later message's clearer failure does not take the place of the first one's.
        (
            MessagesRequest,
            {
                **ANTHROPIC,
                "messages": [
                    {"role": "user", "content": 5},
                    {"role": "user", "content": [{"type": "txt"}]},
                ],
            },
            "messages[0].content",
            "string",
        ),
    ],
)
def test_a_union_field_s_error_is_that_of_the_shape_sent(
    model: type[BaseModel], body: dict[str, Any], param: str, says: str
) -> None:
    got_param, message = refusal(model, body)
    assert got_param == param, message
    assert message.startswith(f"{param}: ")
    assert says in message, message
