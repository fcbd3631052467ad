"""The values that cross the public API: what a caller asks for and what it gets back."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from trio_mlx.errors import InvalidRequest

#: The sampling defaults of every surface — the engine API, the HTTP routes, `trio-mlx generate`
#: — when a request names none: OpenAI's (its API documents temperature 1 and top_p 1). Greedy
#: decoding is `temperature=0`, asked for explicitly.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (before any sampling adjustment), and
    the `top_logprobs` most likely alternatives at that position, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it stops.

    `temperature == 0` is greedy. `seed` makes sampling reproducible: the same seed and request give
    the same tokens, whatever else the engine is doing. `stop` strings end the completion and are
    not part of its text.

    Adjustments apply in this order: `logit_bias`, `repetition_penalty` (over prompt and output,
    divides positive logits and multiplies negative ones), `presence_penalty` and
    `frequency_penalty` (over the output, OpenAI's definition), then temperature, `top_k`, `top_p`
    and `min_p` (relative to the most likely token). `logprobs` reports each chosen token's
    log-probability under the unadjusted model, with `top_logprobs` alternatives (0..20).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    #: SpecPrefill for this request (`engine/specprefill.py`): None follows the engine's setting
    specprefill: bool | None = None
    #: the fraction of a SpecPrefill prompt the target prefills (None: the engine's)
    specprefill_keep_pct: float | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens):
            raise InvalidRequest("max_tokens must be an integer", param="max_tokens")
        if self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        _check_range(self.temperature, "temperature", 0.0, 2.0)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p must be greater than 0 and at most 1", param="top_p")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequest("seed must be an integer", param="seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop strings must be non-empty strings", param="stop")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest("top_k must be a non-negative integer (0: off)", param="top_k")
        _check_range(self.min_p, "min_p", 0.0, 1.0)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequest(
                "repetition_penalty must be greater than 0 and at most 10",
                param="repetition_penalty",
            )
        _check_range(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check_range(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0])):
                raise InvalidRequest("logit_bias keys must be token ids", param="logit_bias")
            if not _is_number(pair[1]) or not -100.0 <= pair[1] <= 100.0:
                raise InvalidRequest(
                    f"logit_bias for token {pair[0]} must be between -100 and 100",
                    param="logit_bias",
                )
        if not isinstance(self.logprobs, bool):
            raise InvalidRequest("logprobs must be a boolean", param="logprobs")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= 20:
            raise InvalidRequest(
                "top_logprobs must be an integer from 0 to 20", param="top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs to be true", param="top_logprobs")
        if self.specprefill is not None and not isinstance(self.specprefill, bool):
            raise InvalidRequest("specprefill must be a boolean", param="specprefill")
        keep = self.specprefill_keep_pct
        if keep is not None and (not _is_number(keep) or not 0.0 < keep <= 1.0):
            raise InvalidRequest(
                "specprefill_keep_pct must be greater than 0 and at most 1",
                param="specprefill_keep_pct",
            )

    @staticmethod
    def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
        """`stop` as given by a caller (a string, a list, or nothing) as a tuple of strings."""
        if stop is None:
            return ()
        if isinstance(stop, str):
            return (stop,)
        return tuple(stop)

    @staticmethod
    def normalize_logit_bias(
        bias: Mapping[int | str, float] | None,
    ) -> tuple[tuple[int, float], ...]:
        """OpenAI's `{"token id": bias}` mapping (keys may be strings) as sorted pairs."""
        if not bias:
            return ()
        pairs = []
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InvalidRequest(
                    f"logit_bias key {key!r} is not a token id", param="logit_bias"
                ) from None
            pairs.append((token, value))
        return tuple(sorted(pairs))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_range(x: object, name: str, low: float, high: float) -> None:
    if not _is_number(x) or not low <= x <= high:  # type: ignore[operator]
        raise InvalidRequest(f"{name} must be between {low:g} and {high:g}", param=name)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class GenerationOutput:
    """One step of a generation as its consumer sees it (and, when `finished`, the whole result).

    `text` and `tokens` hold everything generated so far; `new_text` and `new_tokens` what this step
    added. `completion_tokens` counts generated tokens, stop-string tokens included, EOS excluded.
    `finish_reason` is set on the last output only: `stop` (EOS or a stop string), `length`
    (`max_tokens` or the context), `abort` (cancelled or the engine closed), `error` (see
    `error`). `stop_sequence` names the stop string that ended it (None for EOS or any other end).
    """

    text: str = ""
    new_text: str = ""
    tokens: list[int] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    #: Of `prompt_tokens`, how many were restored from the prefix cache instead of prefilled.
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    finished: bool = False
    #: The stop string that ended the generation (`finish_reason="stop"` by a stop string).
    stop_sequence: str | None = None
    error: str | None = None
    #: Seconds from submission to the first generated token (None until then).
    time_to_first_token: float | None = None
    #: Decode speed after the first token, tokens per second (set on the final output).
    generation_tps: float | None = None
    #: Prompt tokens prefilled (not restored from the cache) per second of `time_to_first_token`
    #: (set with it; the time includes admission and any queueing before the prefill).
    prompt_tps: float | None = None
    #: Per-token log-probabilities when the request asked for them: all so far, and this step's.
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    #: With reasoning separation on: the model's thinking, kept out of `text` (all, this step's).
    reasoning: str = ""
    new_reasoning: str = ""
