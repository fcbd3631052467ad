"""Schemathesis hooks for `test_schemathesis.py` (loaded by `st run` through SCHEMATHESIS_HOOKS).

`positive_data_acceptance_here` is schemathesis's `positive_data_acceptance` (a request the
published document calls valid must be accepted) less the refusals that depend on the model and
on the server's settings, which a static document cannot state:

- a prompt longer than the model's context (code `context_length_exceeded`);
- `max_tokens` (or `max_completion_tokens`, `max_output_tokens`) above the server's
  `--max-tokens` (TRIO_MLX_ST_MAX_TOKENS here);
- token ids (`prompt`, `logit_bias` keys) outside the model's vocabulary;
- an earlier turn's `reasoning_content` that the model's chat template does not render;
- a JSON schema (`response_format`, `text.format`) that the grammar library cannot compile
  (code `invalid_output_format`): which schemas it can enforce is the library's, not the
  document's.
- an image or video part (chat's `image_url`, `video_url`; Responses' `input_image`; an Anthropic
  `image` block) sent to a text-only model, or in a tool result where the model's chat template
  does not render tool messages (results are then written into the prompt as text): what the
  model takes is the model's;
- a `tool_choice` naming a tool that is not among the request's `tools` (or needing tools when
  there are none), and two tools of one name;
- a `previous_response_id` naming no response the server has stored (code
  `previous_response_not_found`), or an item list's `after` naming no item of the list (code
  `after_not_found`): which responses and items exist is the server's state.

Each of them is a 400 whose `param` names the field and whose message says which limit (under
/v1/messages, Anthropic's error shape: the field leads the message); any other refusal of valid
data still fails the check.

`GET /v1/responses` is left out of it: that operation is the WebSocket upgrade, which an HTTP
client cannot perform (no handshake), so it always gets its documented 405; the WebSocket mode
has its own tests (tests/http/test_responses_http.py). Every other check still applies to it.
"""

from __future__ import annotations

import json
import os

import schemathesis
from schemathesis import Case, CheckContext, Response
from schemathesis.specs.openapi.checks import positive_data_acceptance

MAX_TOKENS = int(os.environ.get("TRIO_MLX_ST_MAX_TOKENS", "16"))
TOKEN_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def error_fields(body: bytes) -> tuple[str | None, str | None, str]:
    """`(param, code, message)` of an error body: the OpenAI shape, or Anthropic's (under
    /v1/messages), whose message starts with the field in dotted form and which has no code."""
    payload = json.loads(body)
    error = payload["error"]
    message = str(error["message"])
    if payload.get("type") != "error":
        return error["param"], error["code"], message
    param = message.split(": ", 1)[0] if ": " in message else None
    code = "context_length_exceeded" if param == "messages" and "context" in message else None
    return param, code, message


def depends_on_model_or_settings(response: Response) -> bool:
    if response.status_code != 400:
        return False
    try:
        param, code, message = error_fields(response.content)
    except (ValueError, KeyError, TypeError):
        return False
    if code in ("context_length_exceeded", "previous_response_not_found", "after_not_found"):
        return True
    if param in TOKEN_LIMITS and f"this server allows at most {MAX_TOKENS}" in message:
        return True
    if str(param).endswith(".reasoning_content") and "does not render reasoning" in message:
        return True
    # `tool_choice` naming a function, or "required" (Anthropic's `any`): which functions exist
    # is the request's own `tools`, which a schema cannot tie it to (under /v1/messages the
    # field is `tool_choice.name` or `tool_choice.type`). Nor can it say that tool names are
    # unique (only whole items).
    if str(param).startswith("tool_choice") and (
        "not among the tools" in message or "needs tools" in message
    ):
        return True
    if str(param).startswith("tools.") and "tool names must be unique" in message:
        return True
    if "is a text-only model: it cannot take images or video" in message:
        return True
    if "chat template does not render tool messages" in message:
        return True
    if param in ("response_format", "text.format") and code == "invalid_output_format":
        return True
    return param in ("prompt", "logit_bias") and "vocabulary" in message


def is_websocket_upgrade(case: Case) -> bool:
    return case.operation.method.upper() == "GET" and case.operation.path == "/v1/responses"


@schemathesis.check
def positive_data_acceptance_here(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    if depends_on_model_or_settings(response) or is_websocket_upgrade(case):
        return None
    return positive_data_acceptance(ctx, response, case)
