"""The threads runners run on: process-wide, parked between engines, never exiting.

MLX keeps per-thread state in C++ thread-locals (streams, the `mx.compile` cache). Those are
destroyed when their thread exits, and the compile cache's destructor takes the GIL to release
Python functions. If that happens while the interpreter is finalizing — after `Thread.join()`
returned, the native thread may still be running its thread-local destructors — CPython ends the
thread in the middle of a C++ destructor and the process aborts ("terminate called without an
active exception"). A thread that never exits never runs those destructors, so a runner's thread
is parked when its engine stops and handed to the next engine that starts (at most as many
threads as engines ever ran at once). At process exit the parked threads are daemons: the process
ends without unwinding them.

A job its engine gave up on while it ran (a model load cancelled midway: `Runner._run_thread`)
is `abandon()`ed: the process's exit waits for it to end (an `atexit` hook), because a daemon
thread still inside MLX's C++ when the interpreter finalizes is torn down there, and the process
dies of SIGABRT ("terminate called without an active exception"), e.g. `trio-mlx serve` stopped
by a signal while its model loads.

Each thread also keeps one MLX stream of its own (`runner_stream()`), so engines started one after
another in a process reuse it rather than adding a stream (and, on the CPU, a stream thread) each.
"""

from __future__ import annotations

import atexit
import ctypes
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

#: The name a thread carries while it runs a runner (tests and tools count them).
RUNNER_THREAD_NAME = "trio-mlx-runner"
#: The name of a parked thread, waiting for the next engine.
IDLE_THREAD_NAME = "trio-mlx-runner (idle)"

_lock = threading.Lock()
_idle: list[_ParkedThread] = []
_local = threading.local()
#: Jobs abandoned while they ran, not ended yet: the process's exit waits for them.
_abandoned: set[RunnerJob] = set()


class RunnerJob:
    """A job handed to a runner thread; `ended` is set once it has returned."""

    def __init__(self, job: Callable[[], None], done: Callable[[], None]) -> None:
        self.job = job
        self.done = done
        self.ended = threading.Event()

    def abandon(self) -> None:
        """Nobody waits for this job any more; the process's exit still does (see above)."""
        with _lock:
            if not self.ended.is_set():
                _abandoned.add(self)


class _ParkedThread:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[RunnerJob] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=IDLE_THREAD_NAME, daemon=True)
        self._thread.start()

    def run(self, job: RunnerJob) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        name_os_thread(RUNNER_THREAD_NAME)
        thread = threading.current_thread()
        while True:
            job = self._jobs.get()
            thread.name = RUNNER_THREAD_NAME
            try:
                job.job()
            finally:
                thread.name = IDLE_THREAD_NAME
                with _lock:
                    _idle.append(self)
                    job.ended.set()
                    _abandoned.discard(job)
                job.done()


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) where the OS shows it too (Linux:
    `top -H`, `ps -L`, `/proc/PID/task/TID/comm`, profilers), so that the runner's CPU time can
    be told from MLX's and the event loop's. Python names its threads only for itself."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def start_runner_thread(job: Callable[[], None], done: Callable[[], None]) -> RunnerJob:
    """Run `job` on a parked runner thread (a new one if none is idle), then `done` once the
    thread is parked again. Neither may raise: `job` reports its own outcome."""
    with _lock:
        parked = _idle.pop() if _idle else None
    if parked is None:
        parked = _ParkedThread()
    handle = RunnerJob(job, done)
    parked.run(handle)
    return handle


@atexit.register
def _wait_for_abandoned_jobs() -> None:
    """At exit (before daemon threads are torn down): let abandoned jobs end, saying so on
    stderr (a large model's load can take a while; a second Ctrl-C stops waiting, and the
    process may then abort as described above)."""
    said = False
    while True:
        with _lock:
            pending = next(iter(_abandoned), None)
        if pending is None:
            return
        if not said:
            print(
                "trio-mlx: waiting for the model load under way to end before exiting",
                file=sys.stderr,
                flush=True,
            )
            said = True
        pending.ended.wait()


def runner_stream() -> Any:
    """This thread's MLX stream on the default device (made on first use)."""
    import mlx.core as mx

    device = mx.default_device()
    streams: dict[Any, Any] = getattr(_local, "streams", None) or {}
    _local.streams = streams
    key = str(device)
    if key not in streams:
        streams[key] = mx.new_stream(device)
    return streams[key]
