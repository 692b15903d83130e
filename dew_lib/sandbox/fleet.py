"""SandboxFleet: many programs at once, each in its own process, on a pool of threads.

Each worker thread launches one program through the runner and waits on it, so the parent-death
signal the launcher sets stays tied to a live thread. A program's failure of any kind is an
Outcome; an exception from `submit`'s future means the sandbox itself failed (a missing tool,
a container engine error) and the program's result is unknown.

Not here: how a program is isolated (the runners), scoring (dew_lib.rewards).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from dew_lib.options import integer
from dew_lib.sandbox.limits import SandboxLimits
from dew_lib.sandbox.program import Outcome, Program


class Runner(Protocol):
    """Anything that runs one Program under limits and returns its Outcome (thread-safe)."""

    def run(self, program: Program, limits: SandboxLimits) -> Outcome: ...


class SandboxFleet:
    """Run Programs on `workers` threads through `runner`, each under `limits`.

    workers: programs running at once (default: the machine's CPU count).
    Use as a context manager, or call `close()`, to wait for running programs and stop.
    """

    def __init__(self, runner: Runner, limits: SandboxLimits = SandboxLimits(), workers: int | None = None):
        if not callable(getattr(runner, "run", None)):
            raise ValueError(f"SandboxFleet.runner must have a run(program, limits) method, got {runner!r}")
        if not isinstance(limits, SandboxLimits):
            raise ValueError(f"SandboxFleet.limits must be a SandboxLimits, got {type(limits).__name__}")
        workers = integer("SandboxFleet.workers", (os.cpu_count() or 1) if workers is None else workers)
        self.runner = runner
        self.limits = limits
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dew-sandbox")
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, program: Program) -> Future[Outcome]:
        if not isinstance(program, Program):
            raise ValueError(f"SandboxFleet.submit takes a Program, got {type(program).__name__}")
        with self._lock:
            if self._closed:
                raise RuntimeError("SandboxFleet is closed; make a new one")
            return self._pool.submit(self.runner.run, program, self.limits)

    def run(self, program: Program) -> Outcome:
        """Run one program and wait for its Outcome."""
        return self.submit(program).result()

    def map(self, programs: Iterable[Program]) -> list[Outcome]:
        """Run programs concurrently; Outcomes in the order given."""
        futures = [self.submit(p) for p in programs]
        return [f.result() for f in futures]

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)

    def __enter__(self) -> SandboxFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self):
        return f"SandboxFleet({self.runner!r}, limits={self.limits!r}, workers={self.workers})"
