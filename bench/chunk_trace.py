"""Which prefill chunks a runner step carried, and whether their attention shape was new to the
process: for reading a slow step (a cuDNN graph built on MLX's CUDA backend costs 35-135 ms,
`engine/prefill_shapes.py`). Used by `bench.long_arrival --trace-chunks`.

`install()` wraps `BatchSequence.chunk_done` (every chunk, apart or in the decode pass, once its
pass is built) and `RunnerCounters.note_step` (every batched step) to log them with the time;
`slow_steps` gives, for each step over a threshold, its record and the chunks built during it
and during the step before (pipelined, a step's wait is mostly the pass queued a step before).
A chunk is `(tokens with padding, key width bucket or 0 for a prompt's first chunk, in the
decode pass, first of its shape in the process)`. Bench code: nothing here runs in the engine.
"""

from __future__ import annotations

import time
from typing import Any

from trio_mlx.actors.runner_protocol import RunnerCounters, StepRecord
from trio_mlx.engine.batch_sequence import BatchSequence
from trio_mlx.engine.prefill_shapes import key_width

Chunk = tuple[int, int, bool, bool]

#: (time the chunk's pass was built, the chunk)
CHUNKS: list[tuple[float, Chunk]] = []
#: (time the step ended, its record)
STEPS: list[tuple[float, StepRecord]] = []
_SEEN: set[tuple[int, int, bool]] = set()


def install() -> None:
    """Log every chunk and step from now on (once per process)."""
    if getattr(BatchSequence.chunk_done, "traced", False):
        return
    chunk_done = BatchSequence.chunk_done
    note_step = RunnerCounters.note_step

    def traced_chunk_done(
        self: BatchSequence, n: int, padding: int, *, evaluate: bool = True
    ) -> tuple[int, ...]:
        done = self.prompt_done
        width = key_width(done + n + padding) if done else 0
        shape = (n + padding, width, not evaluate)
        CHUNKS.append((time.perf_counter(), (*shape, shape not in _SEEN)))
        _SEEN.add(shape)
        return chunk_done(self, n, padding, evaluate=evaluate)

    def traced_note_step(self: RunnerCounters, step: StepRecord) -> None:
        STEPS.append((time.perf_counter(), step))
        note_step(self, step)

    traced_chunk_done.traced = True  # type: ignore[attr-defined]
    BatchSequence.chunk_done = traced_chunk_done  # type: ignore[method-assign]
    RunnerCounters.note_step = traced_note_step  # type: ignore[method-assign]


def slow_steps(since: float, until: float, threshold_s: float) -> list[dict[str, Any]]:
    """The steps that ended in [since, until) and took over `threshold_s`, each with the chunks
    built during it and during the step before."""
    found = []
    previous_start = since
    for ended, step in STEPS:
        start = ended - step.seconds
        if since <= ended < until and step.seconds > threshold_s:
            found.append(
                {
                    "ms": round(1e3 * step.seconds, 1),
                    "rows": step.rows,
                    "since_join": step.since_join,
                    "chunks": [c for t, c in CHUNKS if start <= t <= ended],
                    "chunks_before": [c for t, c in CHUNKS if previous_start <= t < start],
                }
            )
        previous_start = start
    return found
