"""The quart-trio application: routes, body parsing, and errors in the OpenAI shape.

Every response that is not a success is `{"error": {"message", "type", "param", "code"}}`:
unknown routes (404), wrong methods (405), bodies over `max_body_bytes` (413), non-JSON content
types (415), malformed JSON and validation failures (400 with `param`), unknown models (404),
admission refusals (429 with `Retry-After`), a model still loading or a dead engine (503), and
anything unexpected (500, logged with its traceback). Under `/v1/messages` (the Anthropic
Messages API), and for any request of an Anthropic client (`anthropic-version`), the same errors
take Anthropic's shape instead, with the same status codes but admission's refusal, Anthropic's
529 there (`http/anthropic/errors.py`); `GET /v1/models` answers such a client in Anthropic's
shape too (`http/anthropic/models.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

import trio
from pydantic import BaseModel, ValidationError
from quart import Response, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed, RequestEntityTooLarge
from werkzeug.routing import BaseConverter

from trio_mlx.http.access_log import AccessLog, record_of
from trio_mlx.http.anthropic.errors import anthropic_error, anthropic_status
from trio_mlx.http.anthropic.messages import count_tokens, start_message
from trio_mlx.http.anthropic.models import model_info, model_page
from trio_mlx.http.anthropic.request_ids import RequestIds, request_id_of, speaks_anthropic
from trio_mlx.http.anthropic.requests import CountTokensRequest, MessagesRequest
from trio_mlx.http.anthropic.stream import message_events
from trio_mlx.http.api_key import RequireAPIKey
from trio_mlx.http.chat import chat_completions
from trio_mlx.http.completions import completions
from trio_mlx.http.conversations import routes as conversations
from trio_mlx.http.conversations.requests import ConversationCreateRequest as CreateRequest
from trio_mlx.http.conversations.requests import ConversationItemsRequest as ItemsRequest
from trio_mlx.http.conversations.requests import ConversationUpdateRequest as UpdateRequest
from trio_mlx.http.errors import (
    INVALID_REQUEST,
    NOT_FOUND,
    SERVER_ERROR,
    APIError,
    default_code,
    error_body,
    from_validation_error,
    parse_json,
)
from trio_mlx.http.generation import SSE_HEADERS, joined, sse_frame
from trio_mlx.http.in_flight import CountInFlight, NoteArrivals
from trio_mlx.http.metrics import Metrics
from trio_mlx.http.objects import Health, ModelCard, ModelList, ResponseDeleted
from trio_mlx.http.openapi import openapi_document
from trio_mlx.http.ownership import RequestOwner
from trio_mlx.http.page import add_page_routes
from trio_mlx.http.requests import ChatCompletionRequest, CompletionRequest
from trio_mlx.http.responses.background import check_background
from trio_mlx.http.responses.items import delete_response, input_items_page, stored_response
from trio_mlx.http.responses.prompt import count_input_tokens
from trio_mlx.http.responses.requests import InputTokensRequest, ResponsesRequest
from trio_mlx.http.responses.run import start_response
from trio_mlx.http.responses.socket import serve_responses_socket
from trio_mlx.http.responses.stream import ResponseEvents, response_events
from trio_mlx.http.state import ServerState

log = logging.getLogger("trio_mlx.http")

M = TypeVar("M", bound=BaseModel)


def create_app(state: ServerState) -> QuartTrio:
    """The app for one server. `state.engine` may still be None (the model is loading)."""
    app = QuartTrio("trio_mlx")
    app.config.update(
        MAX_CONTENT_LENGTH=state.settings.max_body_bytes,
        RESPONSE_TIMEOUT=None,  # streams last as long as generation does
        BODY_TIMEOUT=60,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    app.url_map.converters["response_id"] = ResponseIdConverter
    metrics = state.metrics
    routes: Any = RequestOwner(app.asgi_app)
    if state.settings.api_key:
        # Inside the access log, so that a refused request is logged with its 401.
        routes = RequireAPIKey(
            routes, state.settings.api_key, max_body_bytes=state.settings.max_body_bytes
        )
    routes = RequestIds(routes)  # outside the key check: a 401 has its `request-id` too
    app.asgi_app = CountInFlight(  # type: ignore[method-assign,assignment]
        FinishResponses(AccessLog(NoteArrivals(routes, state), metrics.observe)), state
    )
    _routes(app, state, metrics)
    _error_handlers(app)
    return app


class ResponseIdConverter(BaseConverter):
    """A stored response's id in a path: any segment but `input_tokens`, so that
    `/v1/responses/input_tokens` is `POST`'s alone (its `Allow` lists no `GET` or `DELETE`)."""

    regex = r"(?!input_tokens(?:/|$))[^/]+"


class FinishResponses:
    """ASGI middleware: the last message of an HTTP response is sent shielded from cancellation.

    hypercorn 0.18 does a connection's bookkeeping after the last byte of a response (start the
    next request cycle, or close the socket when the connection cannot be reused) inside that
    `send` call, in the app's task; quart-trio 0.12 cancels the app's task as soon as its message
    reader sees the `http.disconnect` that hypercorn queues during that same call. Without the
    shield, closing the socket is cancelled halfway: a `Connection: close` request, a 413, or a
    response sent before its request's body had arrived left the connection open with nobody
    reading it, and the client's next request on it hung. The shielded work is a shielded socket
    write (hypercorn already shields it) and closing a socket; nothing there waits on the client.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def shielded_send(message: dict[str, Any]) -> None:
            with trio.CancelScope(shield=True):
                await send(message)

        def finishing_send(message: dict[str, Any]) -> Awaitable[None]:
            # Not a coroutine of its own: a streamed body's every chunk is awaited straight on
            # hypercorn's send, one frame less on each of its resumptions.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return shielded_send(message)
            return send(message)  # type: ignore[no-any-return]

        await self.app(scope, receive, finishing_send)


def _json(
    payload: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        json.dumps(payload, separators=(",", ":")),
        status=status,
        headers=headers,
        content_type="application/json",
    )


async def _frames(events: AsyncGenerator[list[tuple[str, str]]]) -> AsyncIterator[bytes]:
    """A Responses event stream's SSE body: each batch of events ready together, one write."""
    async with contextlib.aclosing(events) as batches:
        async for batch in batches:
            yield joined([sse_frame(type, data) for type, data in batch])


def _event_stream(chunks: AsyncIterator[bytes]) -> Response:
    response = Response(chunks, content_type="text/event-stream", headers=SSE_HEADERS)
    response.timeout = None
    return response


async def read_body(model: type[M]) -> M:
    """The request's JSON body validated as `model`."""
    content_type = request.headers.get("Content-Type", "")
    media = content_type.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(
            415,
            f"the body must be JSON (Content-Type: application/json), not {media!r}",
            code="unsupported_media_type",
        )
    raw = await request.get_data()
    payload = parse_json(raw, "body")
    if not isinstance(payload, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _routes(app: QuartTrio, state: ServerState, metrics: Metrics) -> None:
    @app.before_request
    async def read_whole_request() -> None:
        # Every request is read to its end before it is answered, refusals included (404, 405,
        # 415): an HTTP/1.1 connection serves its next request only once the previous one has
        # been read, so hypercorn closes a connection whose request was answered before its body
        # arrived (and, before FinishResponses, left it hanging instead). The body is bounded by
        # MAX_CONTENT_LENGTH and BODY_TIMEOUT; one over the limit is left to the route (413), and
        # its connection is closed.
        with contextlib.suppress(RequestEntityTooLarge):
            await request.get_data()

    @app.post("/v1/chat/completions")
    async def chat_route() -> Response:
        body = await read_body(ChatCompletionRequest)
        result = await chat_completions(state, body, record_of(request.scope))
        return _json(result) if isinstance(result, dict) else _event_stream(result)

    @app.post("/v1/completions")
    async def completions_route() -> Response:
        body = await read_body(CompletionRequest)
        result = await completions(state, body, record_of(request.scope))
        return _json(result) if isinstance(result, dict) else _event_stream(result)

    @app.post("/v1/messages")
    async def messages_route() -> Response:
        body = await read_body(MessagesRequest)
        run = await start_message(state, body, record_of(request.scope))
        return _event_stream(message_events(run)) if body.stream else _json(await run.final())

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route() -> Response:
        return _json(await count_tokens(state, await read_body(CountTokensRequest)))

    @app.post("/v1/responses")
    async def responses_route() -> Response:
        body = await read_body(ResponsesRequest)
        if body.background:
            check_background(state)
        run = await start_response(state, body, record_of(request.scope))
        if body.background:
            entry = state.background.start(run, ResponseEvents(run), streamed=bool(body.stream))
            return (
                _event_stream(_frames(entry.follow(-1))) if body.stream else _json(entry.response)
            )
        if not body.stream:
            return _json(await run.final())
        return _event_stream(_frames(response_events(run)))

    @app.get("/v1/responses/<response_id:response_id>")
    async def stored_response_route(response_id: str) -> Response:
        if request.args.get("stream", "").lower() == "true":  # a background stream, resumed
            after = request.args.get("starting_after")
            return _event_stream(
                _frames(state.background.follow(response_id, after, state.responses))
            )
        running = state.background.get(response_id)
        if running is not None:
            return _json(running.response)
        return _json(stored_response(state.responses, response_id).response)

    @app.post("/v1/responses/<response_id:response_id>/cancel")
    async def cancel_response_route(response_id: str) -> Response:
        return _json(await state.background.cancel(response_id, state.responses))

    @app.delete("/v1/responses/<response_id:response_id>")
    async def delete_response_route(response_id: str) -> Response:
        if state.background.forget(response_id):
            state.responses.delete(response_id)
            return _json(ResponseDeleted(id=response_id).dump())
        return _json(delete_response(state.responses, response_id))

    @app.get("/v1/responses/<response_id:response_id>/input_items")
    async def input_items_route(response_id: str) -> Response:
        query = {
            name: request.args[name] for name in ("after", "limit", "order") if name in request.args
        }
        return _json(input_items_page(state.responses, response_id, query))

    @app.post("/v1/responses/input_tokens")
    async def input_tokens_route() -> Response:
        return _json(await count_input_tokens(state, await read_body(InputTokensRequest)))

    @app.websocket("/v1/responses")
    async def responses_socket() -> None:
        await serve_responses_socket(state, websocket, record_of(websocket.scope))

    _conversation_routes(app, state)

    @app.get("/v1/models")
    async def models_route() -> Response:
        state.engine_for(None)
        if speaks_anthropic(request.scope):
            return _json(model_page(state, request.args))
        cards = [ModelCard(id=name, created=state.created) for name in state.model_names]
        return _json(ModelList(data=cards).dump())

    @app.get("/v1/models/<path:name>")
    async def model_route(name: str) -> Response:
        state.engine_for(name)
        if speaks_anthropic(request.scope):
            return _json(model_info(state, name))
        return _json(ModelCard(id=name, created=state.created).dump())

    @app.get("/health")
    async def health_route() -> Response:
        phase = state.phase
        health = Health(
            status="ok" if phase == "ready" else phase,
            model=state.model_names[0] if state.engine is not None else None,
            detail=None if state.load_error is None else str(state.load_error),
        )
        return _json(health.dump(), status=200 if phase == "ready" else 503)

    @app.get("/v1/status")
    async def status_route() -> Response:
        engine, model = state.engine_for(None)
        stats = engine.get_stats()
        stats["server"] = {
            "phase": state.phase,
            "model": model,
            "names": state.model_names,
            "response_store": dataclasses.asdict(state.responses.statistics()),
            "background_responses": state.background.statistics(),
            "conversations": dataclasses.asdict(state.conversations.statistics()),
        }
        return _json(stats)

    @app.get("/v1/cache/stats")
    async def cache_stats_route() -> Response:
        engine, _ = state.engine_for(None)
        return _json(engine.get_cache_stats())

    @app.delete("/v1/cache")
    async def cache_clear_route() -> Response:
        engine, _ = state.engine_for(None)
        return _json(await engine.clear_runtime_caches())

    @app.get("/metrics")
    async def metrics_route() -> Response:
        engine = state.engine
        names = state.model_names
        text = metrics.render(
            names[0] if names else "",
            engine.get_stats() if engine is not None else None,
            engine.get_cache_stats() if engine is not None else None,
        )
        return Response(text, content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/openapi.json")
    async def openapi_route() -> Response:
        return _json(openapi_document())

    add_page_routes(app, state)


def _conversation_routes(app: QuartTrio, state: ServerState) -> None:
    """The Conversations API (`http/conversations/routes.py`)."""
    store = state.conversations

    @app.post("/v1/conversations")
    async def create_conversation_route() -> Response:
        return _json(conversations.create_conversation(store, await read_body(CreateRequest)))

    @app.get("/v1/conversations/<conversation_id>")
    async def conversation_route(conversation_id: str) -> Response:
        return _json(conversations.retrieve_conversation(store, conversation_id))

    @app.post("/v1/conversations/<conversation_id>")
    async def update_conversation_route(conversation_id: str) -> Response:
        body = await read_body(UpdateRequest)
        return _json(conversations.update_conversation(store, conversation_id, body))

    @app.delete("/v1/conversations/<conversation_id>")
    async def delete_conversation_route(conversation_id: str) -> Response:
        return _json(conversations.delete_conversation(store, conversation_id))

    @app.post("/v1/conversations/<conversation_id>/items")
    async def add_items_route(conversation_id: str) -> Response:
        body = await read_body(ItemsRequest)
        return _json(conversations.add_items(store, conversation_id, body))

    @app.get("/v1/conversations/<conversation_id>/items")
    async def list_items_route(conversation_id: str) -> Response:
        query = {
            name: request.args[name] for name in ("after", "limit", "order") if name in request.args
        }
        return _json(conversations.list_items(store, conversation_id, query))

    @app.get("/v1/conversations/<conversation_id>/items/<item_id>")
    async def item_route(conversation_id: str, item_id: str) -> Response:
        return _json(conversations.retrieve_item(store, conversation_id, item_id))

    @app.delete("/v1/conversations/<conversation_id>/items/<item_id>")
    async def delete_item_route(conversation_id: str, item_id: str) -> Response:
        return _json(conversations.delete_item(store, conversation_id, item_id))


def _error_handlers(app: QuartTrio) -> None:
    def error_response(
        body: dict[str, Any], status: int, headers: dict[str, str] | None = None
    ) -> Response:
        if speaks_anthropic(request.scope):
            status = anthropic_status(status)
            body = anthropic_error(status, body["error"], request_id_of(request.scope))
        return _json(body, status=status, headers=headers)

    @app.errorhandler(APIError)
    async def api_error(exc: APIError) -> Response:
        return error_response(exc.body(), exc.status, exc.headers)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        headers: dict[str, str] = {}
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
            headers["Allow"] = ", ".join(exc.valid_methods)
        if status == 404:
            message = f"no route {request.method} {request.path}"
            kind, code = NOT_FOUND, "not_found"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.path}"
            kind, code = INVALID_REQUEST, "method_not_allowed"
        elif status == 413:
            message = "the request body is larger than this server accepts"
            kind, code = INVALID_REQUEST, "request_too_large"
        else:
            message = exc.description or exc.name
            kind, code = (SERVER_ERROR if status >= 500 else INVALID_REQUEST), default_code(status)
        return error_response(error_body(message, type=kind, code=code), status, headers)

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(
            error_body(
                f"internal error: {type(exc).__name__}", type=SERVER_ERROR, code="internal_error"
            ),
            500,
        )
