"""The values that cross the public API: what a caller asks for and what it gets back."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from trio_mlx.errors import InvalidRequest

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it stops.

    `temperature == 0` is greedy. `seed` makes sampling reproducible: the same seed and request give
    the same tokens, whatever else the engine is doing. `stop` strings end the completion and are
    not part of its text.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidRequest("max_tokens must be an integer", param="max_tokens")
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be greater than 0 and at most 1", param="top_p")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise InvalidRequest("seed must be an integer", param="seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop strings must be non-empty strings", param="stop")

    @staticmethod
    def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
        """`stop` as given by a caller (a string, a list, or nothing) as a tuple of strings."""
        if stop is None:
            return ()
        if isinstance(stop, str):
            return (stop,)
        return tuple(stop)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class GenerationOutput:
    """One step of a generation as its consumer sees it (and, when `finished`, the whole result).

    `text` and `tokens` hold everything generated so far; `new_text` and `new_tokens` what this step
    added. `completion_tokens` counts generated tokens, stop-string tokens included, EOS excluded.
    `finish_reason` is set on the last output only: `stop` (EOS or a stop string), `length`
    (`max_tokens` or the context), `abort` (cancelled or the engine closed), `error` (see
    `error`).
    """

    text: str = ""
    new_text: str = ""
    tokens: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    finished: bool = False
    error: str | None = None
    #: Seconds from submission to the first generated token (None until then).
    time_to_first_token: float | None = None
    #: Decode speed after the first token, tokens per second (set on the final output).
    generation_tps: float | None = None
    #: Prompt tokens per second (set once the first token is out).
    prompt_tps: float | None = None
