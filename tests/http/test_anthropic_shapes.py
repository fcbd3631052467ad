"""The Messages API's shapes, unit by unit: the hand-written delta event is the event model's
bytes, and the server's errors map to Anthropic's types with the field leading the message."""

from __future__ import annotations

import json

import pytest

from trio_mlx.http.anthropic.blocks import delta_event, event
from trio_mlx.http.anthropic.errors import (
    anthropic_error,
    anthropic_status,
    dotted,
    is_messages_path,
)
from trio_mlx.http.anthropic.objects import ContentBlockDeltaEvent, TextDelta, ThinkingDelta


@pytest.mark.parametrize("text", ["plain", ' "quoted" \\ ', "naïve 日本 🙂", "\n\t\x00", ""])
def test_a_delta_event_is_the_bytes_of_its_model(text: str) -> None:
    for index, kind, delta in (
        (0, "text", TextDelta(text=text)),
        (7, "thinking", ThinkingDelta(thinking=text)),
    ):
        model = ContentBlockDeltaEvent(index=index, delta=delta)
        assert delta_event(index, kind, text) == event(model)  # type: ignore[arg-type]
        data = delta_event(index, kind, text).split(b"\ndata: ", 1)[1]
        assert json.loads(data) == model.dump()


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (413, "request_too_large"),
        (415, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_each_status_has_its_anthropic_type(status: int, kind: str) -> None:
    body = anthropic_error(status, {"message": "m", "type": "x", "param": None, "code": None})
    assert body == {"type": "error", "error": {"type": kind, "message": "m"}}


def test_admission_s_refusal_is_anthropic_s_529_and_other_statuses_are_kept() -> None:
    assert anthropic_status(429) == 529
    assert [anthropic_status(s) for s in (400, 404, 413, 500, 503)] == [400, 404, 413, 500, 503]


def test_a_request_id_and_the_codes_clients_act_on_are_in_the_body() -> None:
    detail = {"message": "no", "param": "thread", "code": "thread_unsupported_request"}
    assert anthropic_error(400, detail, "req_1") == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "thread: no",
            "details": {"error_code": "thread_unsupported_request"},
        },
        "request_id": "req_1",
    }
    other = anthropic_error(400, {**detail, "code": "invalid_value"})
    assert other == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "thread: no"},
    }


def test_the_offending_field_leads_the_message_in_dotted_form() -> None:
    def message(detail: dict[str, object]) -> str:
        return str(anthropic_error(400, detail)["error"]["message"])

    assert dotted("messages[0].content[2].type") == "messages.0.content.2.type"
    assert (
        message({"message": "messages[1].role: bad", "param": "messages[1].role"})
        == "messages.1.role: bad"
    )
    assert message({"message": "too big", "param": "max_tokens"}) == "max_tokens: too big"
    assert message({"message": "max_tokens: too big", "param": "max_tokens"}) == (
        "max_tokens: too big"
    )
    assert message({"message": "no field", "param": None}) == "no field"


def test_only_the_messages_paths_take_anthropic_s_shape() -> None:
    assert is_messages_path("/v1/messages")
    assert is_messages_path("/v1/messages/count_tokens")
    assert not is_messages_path("/v1/messages_x")
    assert not is_messages_path("/v1/chat/completions")
