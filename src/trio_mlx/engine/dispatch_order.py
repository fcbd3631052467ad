"""When a built decode step goes to the device: at once, or after the previous step's tokens
have been handed to Trio. Runner thread only.

Why: the runner and the Trio thread share one GIL. A pipelined decode step (`batch_step`) builds
step k + 1's graph in Python (holding the GIL), queues it (`mx.async_eval`: MLX's C++ dispatch,
which releases the GIL), then reads step k's tokens, and the loop hands them to Trio, which
turns each into its stream's output (detokenizing, the SSE event, the socket write) while the
runner goes on to build step k + 2. So the Trio thread's work on every token falls on the runner's
next build, the one phase of a step that needs the GIL: where the host is the bottleneck (a small
model on a fast GPU, batch 1), each token's Trio work lengthens the step. Handed over between
building step k + 1 and queuing it, the tokens of step k are processed while the runner is inside
`mx.async_eval`, without the GIL. Reading step k before queuing step k + 1 costs nothing where the
device is ahead of the host (step k finished while the host built step k + 1), but where the
device is the bottleneck it would leave the device idle while the host reads, hands over and
dispatches: there the step is queued at once, as before.

Measured so far only off the GPU: a toy of the two threads (a 440 µs Python build, a 1 ms
dispatch without the GIL, 0-370 µs of Trio work a token, switch interval 0.5 ms) lost 35-180 µs
a token in the old order against the new. On MLX's CPU backend, pipelined by force (the tiny
model, a lone row), `on` decoded at 244 tok/s against 296 for `off`: there `mx.async_eval`
computes the step, so the device is the bottleneck (and the CPU does not pipeline by default).
On an H100 (1B bf16, 2026-12-07, docs/benchmarks "Experimental switches on a GPU"): through the
server `auto` streamed 4% more tokens a second at 1 and 8 streams, with a longer ITL p99 (5.6
against 4.6 ms at one stream) and a TTFT p50 at 8 streams of 244 against 104 ms; the bare lone
row lost 6-9% (no Trio work to overlap). So it stays off.

What: `DispatchOrder.defer()` says whether the step just built waits to be queued until the
loop has handed over the tokens just read (`BatchDecoder.dispatch_pending`); `observe(wait)`
takes how long each read waited for the device. `TRIO_MLX_DEFER_DISPATCH`:
- `auto`: defer while the reads find their tokens ready (the device ahead of the host: a moving
  average of the reads' waits under `READY_SECONDS`);
- `on`: always; `off` (the default: no clear win on an H100, above): never.
Only where steps are pipelined (`batch_step.pipelining_pays`); a step with constrained rows is
queued at once (its masks are computed while it runs).
"""

from __future__ import annotations

import os

__all__ = ["DEFER_DISPATCH_ENV", "READY_SECONDS", "DispatchOrder"]

#: Environment switch: `auto`, `on` or `off` (module docstring).
DEFER_DISPATCH_ENV = "TRIO_MLX_DEFER_DISPATCH"

#: A read that waited less than this found its step done: the device is ahead of the host.
READY_SECONDS = 0.0002

#: Weight of the newest read in the moving average of the waits.
_NEWEST = 0.25


class DispatchOrder:
    """One decoder's choice, step by step (module docstring)."""

    def __init__(self, mode: str | None = None) -> None:
        if mode is None:
            mode = os.environ.get(DEFER_DISPATCH_ENV, "").strip().lower() or "off"
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"{DEFER_DISPATCH_ENV} must be auto, on or off, not {mode!r}")
        self.mode = mode
        #: moving average of the reads' waits for the device (seconds)
        self.wait = 0.0
        #: steps queued after their predecessor's tokens were handed over
        self.deferred = 0

    @property
    def watches(self) -> bool:
        """Whether `defer` goes by the reads' waits (`auto`): the decoder times them only then."""
        return self.mode == "auto"

    def observe(self, wait: float) -> None:
        """A read waited `wait` seconds for its step's tokens."""
        self.wait += _NEWEST * (wait - self.wait)

    def defer(self) -> bool:
        """Whether the step just built waits for the hand-over of the tokens just read."""
        if self.mode == "off" or (self.mode == "auto" and self.wait >= READY_SECONDS):
            return False
        self.deferred += 1
        return True
