"""The exceptions trio-mlx raises to its callers.

Each carries a stable `code` (the OpenAI error `code` in the HTTP layer) so that a caller can
tell a refusal (retry later) from a bad request (fix it) from a dead engine (give up).
"""

from __future__ import annotations


class TrioMLXError(Exception):
    """Base class of every error trio-mlx raises on purpose."""

    code = "trio_mlx_error"


class ModelLoadError(TrioMLXError):
    """The model could not be resolved, converted or loaded. The message names the file and why."""

    code = "model_load_error"


class EngineBusy(TrioMLXError):
    """Admission refused the request: the serialized route is taken (and the queue full).

    `retry_after` is a hint in seconds for when a slot is likely to be free.
    """

    code = "engine_busy"

    def __init__(self, message: str, *, retry_after: float = 1.0, reason: str = "busy") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class EngineClosed(TrioMLXError):
    """The engine is shutting down or has shut down; no new work is accepted."""

    code = "engine_closed"


class EngineCrashed(TrioMLXError):
    """The runner thread died; the engine can no longer serve."""

    code = "engine_crashed"


class InvalidRequest(TrioMLXError, ValueError):
    """A request the engine cannot serve as asked: `param` names the offending field."""

    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLong(InvalidRequest):
    """The prompt (plus the requested completion) does not fit the model's context."""

    code = "context_length_exceeded"


class GenerationError(TrioMLXError):
    """The model failed while generating this request; the engine itself keeps serving."""

    code = "generation_error"
