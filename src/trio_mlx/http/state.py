"""What the HTTP app knows about the server: its settings, and the engine once it is loaded.

The app is created before the model has loaded (so that `/health` can answer 503 meanwhile);
`ServerState.engine_for` is how a route gets the engine, refusing with the right error while the
model loads, after it failed or died, and for a model name the server does not serve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import trio

from trio_mlx.actors.engine import Engine
from trio_mlx.http.conversations.store import ConversationStore
from trio_mlx.http.errors import NOT_FOUND, UNAVAILABLE, APIError
from trio_mlx.http.metrics import Metrics
from trio_mlx.http.responses.background import BackgroundResponses
from trio_mlx.http.responses.store import DEFAULT_MEGABYTES, DEFAULT_RESPONSES, ResponseStore


@dataclass(frozen=True)
class ServerSettings:
    """How `trio-mlx serve` runs: where it listens, under which names, its limits, the engine."""

    model: str | Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    shutdown_timeout: float = 10.0
    #: When set, every route but /health and the chat page needs this key (`http/api_key.py`).
    api_key: str | None = None
    #: How function calls are read from replies: "auto" (from the chat template) or a format
    #: name of `trio_mlx.tools.PARSER_CHOICES`.
    tool_call_parser: str = "auto"
    #: The bounds of the stored Responses (`http/responses/store.py`): how many, how many bytes
    #: in all; 0 stores none. The conversations (`http/conversations/store.py`) have the same
    #: bounds, a budget of their own.
    response_store_size: int = DEFAULT_RESPONSES
    response_store_bytes: int = int(DEFAULT_MEGABYTES * 1024 * 1024)
    engine_options: dict[str, Any] = field(default_factory=dict)


Phase = Literal["loading", "ready", "draining", "dead"]


class ServerState:
    """Shared by every route of one server. Lives on the Trio thread."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        #: Set once the model is loaded and the engine serves.
        self.ready = trio.Event()
        #: HTTP requests and WebSockets whose response has not ended (`http.in_flight`).
        self.in_flight = 0
        self._idle = trio.Event()
        self._idle.set()
        self.created = int(time.time())
        #: Responses kept for `previous_response_id` and the retrieval routes.
        self.responses = ResponseStore(settings.response_store_size, settings.response_store_bytes)
        #: Conversations (`/v1/conversations`, `conversation`), bounded as the responses are.
        self.conversations = ConversationStore(
            settings.response_store_size, settings.response_store_bytes
        )
        #: Responses running in the background (`background`), and the last ended ones; each
        #: running one counts as a request in flight.
        #: The request metrics of `/metrics` (each generation observed once, as it ends).
        self.metrics = Metrics()
        self.background = BackgroundResponses(
            settings.response_store_size,
            settings.response_store_bytes,
            self.request_started,
            self.request_ended,
            observe=self.metrics.observe,
        )

    @property
    def model_names(self) -> list[str]:
        """Names clients may use, the first one the canonical one."""
        names = list(self.settings.served_model_names)
        if self.engine is not None and not names:
            names.append(self.engine.model_name)
        return names

    @property
    def phase(self) -> Phase:
        if self.load_error is not None:
            return "dead"
        if self.engine is None:
            return "loading"
        if not self.engine.is_alive and not self.draining:
            return "dead"
        return "draining" if self.draining else "ready"

    def request_started(self) -> None:
        if self.in_flight == 0:
            self._idle = trio.Event()
        self.in_flight += 1

    def request_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        while self.in_flight:
            await self._idle.wait()

    def engine_for(self, model: str | None) -> tuple[Engine, str]:
        """The engine and the name to report for a request naming `model` (None: the default).

        Refuses with 503 while the model loads, after it failed, and while the server drains.
        """
        if self.draining:
            raise APIError(
                503,
                "the server is shutting down and accepts no new requests",
                type=UNAVAILABLE,
                code="server_draining",
            )
        engine = self.engine
        if engine is None:
            if self.load_error is not None:
                raise APIError(
                    503,
                    f"the model failed to load: {self.load_error}",
                    type=UNAVAILABLE,
                    code="model_load_error",
                )
            raise APIError(
                503,
                "the model is still loading",
                type=UNAVAILABLE,
                code="model_loading",
                headers={"Retry-After": "1"},
            )
        names = self.model_names
        if model is None or model == "":
            return engine, names[0]
        if model in names:
            return engine, model
        raise APIError(
            404,
            f"the model {model!r} does not exist on this server; it serves "
            + ", ".join(repr(n) for n in names),
            type=NOT_FOUND,
            param="model",
            code="model_not_found",
        )
