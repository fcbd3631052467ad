"""The runner's hand-over to Trio in isolation: steps a second with `run_sync_soon` against our
GIL-keeping wake-up (`trio_mlx.actors.handoff`), on a loop shaped like a GPU decode step.

    python -m bench.handoff --steps 1500 --repeats 3 --json /tmp/handoff.json
    python -m bench.handoff --build-ms 0.44 --dispatch-ms 1.2 --trio-us 0,100,200

Why: on a GPU a lone stream's decode step is host-bound: the runner thread builds the next
step's graph in Python (the GIL held), then MLX dispatches it (the GIL released), and the Trio
thread turns each step's tokens into output (the GIL held). The Trio work costs the stream
nothing only if it runs while the runner is inside the dispatch. This measures whether each
hand-over achieves that, with no model and no device, so that it runs on any machine.

How: a thread loops `--steps` times: `--build-ms` of Python spinning (GIL held), then
`--dispatch-ms` in `time.sleep` (GIL released, as MLX's `async_eval`), then a post of the step to
Trio, whose callback spins `--trio-us` (GIL held). Per Trio cost, `--repeats` rounds of each mode
in turn (`trio`: `TrioToken.run_sync_soon`; `hold`: the `Handoff`), steps a second each, with the
interpreter's switch interval at the server's (`SERVER_PROCESS_SETTINGS`). `ceiling` is one step
of build and dispatch with nothing else (time.sleep's own overshoot included: the median of the
bare loop's rounds, one before each round of the modes). Bounded: every round stops at `--steps`
or `--round-s`, whichever comes first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from trio_mlx.actors.handoff import Handoff
from trio_mlx.config import SERVER_PROCESS_SETTINGS


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _steps(
    steps: int, build: float, dispatch: float, limit: float, after: Callable[[], None] | None = None
) -> int:
    """The loop: up to `steps` steps of `build` (GIL held) then `dispatch` (GIL released), each
    followed by `after()` if given, for at most `limit` seconds; how many steps it made."""
    began = time.perf_counter()
    done = 0
    while done < steps and time.perf_counter() - began < limit:
        _spin(build)
        time.sleep(dispatch)
        if after is not None:
            after()
        done += 1
    return done


def _bare_round(steps: int, build: float, dispatch: float, limit: float) -> float:
    """Steps a second of the loop alone (no hand-over)."""
    began = time.perf_counter()
    done = _steps(steps, build, dispatch, limit)
    return done / (time.perf_counter() - began)


async def _round(
    mode: str, steps: int, build: float, dispatch: float, work: float, limit: float
) -> float:
    """Steps a second of one round: the runner-like thread posting each step to Trio."""
    handoff = Handoff(mode)
    finished = trio.Event()
    delivered = [0]

    def deliver() -> None:
        _spin(work)
        delivered[0] += 1

    def loop() -> None:
        _steps(steps, build, dispatch, limit, after=lambda: handoff.post(deliver))
        handoff.post(finished.set)

    began = time.perf_counter()
    thread = threading.Thread(target=loop, name="bench-runner")
    thread.start()
    try:
        await handoff.serve_until(finished)
    finally:
        await trio.to_thread.run_sync(thread.join)
        handoff.close()
    return delivered[0] / (time.perf_counter() - began)


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build-ms", type=float, default=0.5)
    parser.add_argument("--dispatch-ms", type=float, default=1.2)
    parser.add_argument("--trio-us", default="0,150", help="comma-separated Trio costs a token")
    parser.add_argument("--round-s", type=float, default=10.0, help="most seconds a round")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    build, dispatch = args.build_ms / 1000, args.dispatch_ms / 1000
    previous = sys.getswitchinterval()
    sys.setswitchinterval(float(SERVER_PROCESS_SETTINGS["gil_switch_interval"]))
    rows: list[dict[str, Any]] = []
    try:
        bare: list[float] = []
        for work_us in (float(w) for w in args.trio_us.split(",")):
            rates: dict[str, list[float]] = {"trio": [], "hold": []}
            for _ in range(args.repeats):
                bare.append(_bare_round(args.steps, build, dispatch, args.round_s))
                for mode in rates:
                    rates[mode].append(
                        trio.run(
                            _round, mode, args.steps, build, dispatch, work_us / 1e6, args.round_s
                        )
                    )
            row: dict[str, Any] = {"trio_us": work_us} | {
                m: statistics.median(r) for m, r in rates.items()
            }
            row["hold_over_trio"] = row["hold"] / row["trio"]
            row["rounds"] = rates
            rows.append(row)
    finally:
        sys.setswitchinterval(previous)
    ceiling = statistics.median(bare)
    report = {
        "build_ms": args.build_ms,
        "dispatch_ms": args.dispatch_ms,
        "steps": args.steps,
        "repeats": args.repeats,
        "ceiling": ceiling,
        "rows": rows,
    }
    print(f"ceiling (build + dispatch alone): {ceiling:.0f} steps/s")
    print("| Trio µs a token | run_sync_soon | Handoff | Handoff / run_sync_soon |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['trio_us']:.0f} | {row['trio']:.0f} | {row['hold']:.0f} "
            f"| {row['hold_over_trio']:.3f} |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
