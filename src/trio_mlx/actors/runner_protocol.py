"""What crosses between the Trio side and the runner thread (see `runner` for the protocol).

- Trio -> runner, through the runner's command queue: `StartJob`, `AbortJob`,
  `ClearSnapshots` (a `Command`), read by the thread between steps on either route
  (`serial_loop._take_commands`, `batch_loop._apply`);
- runner -> Trio, posted to the runner's `handoff.Handoff`: one batch of `SequenceEvent`s a
  step, and the value of an `Answer`;
- `RunnerCounters`: written by the runner thread only, read by anyone (`Engine.get_stats`).

Messages are frozen dataclasses; an `Answer` is resolved at most once, on the Trio thread.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import trio

from trio_mlx.engine.decode import GenerationJob
from trio_mlx.types import FinishReason, TokenLogprob


@dataclass(frozen=True)
class SequenceEvent:
    """One request's share of a step."""

    request_id: int
    tokens: tuple[int, ...] = ()
    finish: FinishReason | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    #: Prompt tokens restored from the prefix cache rather than prefilled.
    cached_tokens: int = 0


@dataclass(frozen=True)
class StartJob:
    """Start `job` (its sink is registered by `Runner.submit`)."""

    job: GenerationJob


@dataclass(frozen=True)
class AbortJob:
    """Stop `request_id` at the next step boundary (nothing if it has ended)."""

    request_id: int
    #: Snapshot the sequence if its prefill is complete (not when the engine is closing).
    store: bool = True


class Answer:
    """A one-shot answer from the runner thread, resolved on the Trio thread."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: dict[str, Any] | None = None

    def resolve(self, value: dict[str, Any] | None) -> None:
        if not self.event.is_set():
            self.value = value
            self.event.set()


@dataclass(frozen=True)
class ClearSnapshots:
    """Drop every snapshot, empty the book, free MLX's buffer cache; `reply` gets what was
    freed."""

    reply: Answer


Command = StartJob | AbortJob | ClearSnapshots


#: steps kept for `RunnerCounters.slowest_recent_step` (a few seconds of a busy batch)
RECENT_STEPS = 256


class StepRecord(NamedTuple):
    """One batched step, as `RunnerCounters.note_step` keeps it: `seconds` in all, `decode` and
    `prefill` of them, `since_join` steps after the last join (1: the first step after one; its
    decode reads the step queued before the join, so a join's own device work shows in the
    second; None: no join yet), the `rows` it decoded, the `prompt_tokens` it prefilled in
    chunks of their own and the `mixed_tokens` that rode in its decode pass (`mixed_step`;
    pipelined, a step's wait is mostly the pass queued a step before: its chunk is the previous
    record's)."""

    seconds: float
    decode: float
    prefill: float
    since_join: int | None
    rows: int = 0
    prompt_tokens: int = 0
    mixed_tokens: int = 0


@dataclass
class RunnerCounters:
    """Written by the runner thread only; read by anyone (plain ints)."""

    steps: int = 0
    prefill_chunks: int = 0
    #: passes that prefilled several arrivals together, and the sequences in them (batched
    #: route: `batch_prefill`)
    prefill_groups: int = 0
    grouped_prefills: int = 0
    prefill_group_failures: int = 0
    #: decode steps whose rows attended in two groups (batched route: `ragged_attention`)
    grouped_attention_steps: int = 0
    #: decode steps whose rows sat in groups of their own buffers (batched route:
    #: `batch_segments`)
    segmented_steps: int = 0
    #: decode steps through the traced batch step (batched route: `traced_batch_rows`)
    traced_steps: int = 0
    #: decode steps queued on the device only once the tokens read before them were handed
    #: over (batched route: `dispatch_order`)
    deferred_dispatches: int = 0
    #: joins of prompts of several chunks put off by a step (batched route: `BatchDecoder.join`)
    deferred_joins: int = 0
    #: prefill chunks that rode in a decode step's pass (batched route: `mixed_step`)
    mixed_chunks: int = 0
    #: bursts whose first arrivals waited (prefilled) for the requests on their way before
    #: decoding, and the seconds the runner slept meanwhile (batched route: `batch_loop`)
    burst_holds: int = 0
    burst_hold_seconds: float = 0.0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    started: int = 0
    aborted: int = 0
    failed: int = 0
    busy_seconds: float = 0.0
    live: int = 0
    #: sequences in the decode batch / prefilling to join it (batched route)
    decoding: int = 0
    prefilling: int = 0
    #: decode steps by batch size (batched route: rows in the step's forward pass)
    batch_sizes: dict[int, int] = dataclasses.field(default_factory=dict)
    #: memory of the live sequences' KV caches (batched route; bytes)
    kv_bytes: int = 0
    #: requests with media stepping beside the batch, and their steps (batched route on a
    #: vision-language model: `media_lane`)
    media: int = 0
    media_steps: int = 0
    #: requests with media that joined the decode batch after their prefill (`multimodal.joining`)
    media_joined: int = 0
    #: requests with media started on mlx-vlm's drafted route (`multimodal.drafted`; either
    #: route, with `EngineConfig.mllm_draft_model`)
    media_drafted: int = 0
    #: the batched route's last `RECENT_STEPS` steps, for `slowest_recent_step`
    recent_steps: deque[StepRecord] = dataclasses.field(
        default_factory=lambda: deque(maxlen=RECENT_STEPS)
    )

    def note_step(self, step: StepRecord) -> None:
        """A batched step ended (`StepRecord`)."""
        self.recent_steps.append(step)

    def slowest_recent_step(self) -> dict[str, Any] | None:
        """The slowest of the recent steps, by phase, with its rows and prompt tokens (None: no
        step yet). Any thread."""
        recent = list(self.recent_steps)  # one C-level copy under the GIL
        if not recent:
            return None
        step = max(recent, key=lambda s: s.seconds)
        return {
            "seconds": step.seconds,
            "decode_s": step.decode,
            "prefill_s": step.prefill,
            "steps_after_join": step.since_join,
            "rows": step.rows,
            "prompt_tokens": step.prompt_tokens,
            "mixed_tokens": step.mixed_tokens,
        }
