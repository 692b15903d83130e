"""The writer's thread: runs a writer's jobs in order and publishes snapshots for what they changed.

Jobs run on a thread (or inline) in the order they were submitted; the first failure is kept and
raised by the caller's next call, and nothing queued after it is written out of order. Streams
report changes readers' snapshots must follow with `changed()`; the thread publishes one after a
job when its queue is empty or the last one is `snapshot.PUBLISH_EVERY` seconds old, before it
marks the job done, so `flush()` returns once readers can see what it waited for.

Not here: what the jobs write (writer.py, parts.py), snapshots (snapshot.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dew_lib.store import snapshot
from dew_lib.store.parts import StoreError


class Worker:
    """Runs jobs in order, on a thread or inline; keeps the first failure for the caller.

    publish: makes readers' snapshot follow the changes jobs reported with `changed()`; run after
    a job when the queue is empty or the last one is PUBLISH_EVERY seconds old.
    """

    def __init__(self, background: bool, depth: int, publish: Callable[[], Any] | None = None):
        self.error: BaseException | None = None
        self.seconds = self.cpu_seconds = 0.0  # wall and CPU time spent running jobs
        self.publish, self.dirty, self.published = publish, False, time.monotonic()
        self.queue: queue.Queue | None = None
        if background:
            self.queue = queue.Queue(maxsize=depth)
            self.thread = threading.Thread(target=self._loop, name="dew-store-writer", daemon=True)
            self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                if self.error is None:  # after a failure nothing later is written out of order
                    self._timed(job)
            except BaseException as error:  # noqa: BLE001 - handed to the caller by check()
                self.error = error
            finally:
                try:  # before task_done: flush() returns once readers can see what it waited for
                    if self.queue.qsize() == 0 or time.monotonic() - self.published > snapshot.PUBLISH_EVERY:
                        self._timed(self._publish)
                except BaseException as error:  # noqa: BLE001 - handed to the caller by check()
                    self.error = self.error or error
                self.queue.task_done()

    def changed(self) -> None:
        """A job made a change readers' snapshot must follow (see snapshot.py)."""
        self.dirty = True

    def _publish(self) -> None:
        if self.dirty and self.publish is not None:
            self.dirty = False
            self.publish()
            self.published = time.monotonic()

    def _timed(self, job) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            job()
        finally:
            self.seconds += time.perf_counter() - wall
            self.cpu_seconds += time.thread_time() - cpu

    def check(self) -> None:
        if self.error is not None:
            raise StoreError(f"writing to the run store failed: {self.error!r}") from self.error

    def submit(self, job: Callable[[], None]) -> None:
        self.check()
        if self.queue is None:
            try:
                self._timed(job)
                self._timed(self._publish)
            except BaseException as error:
                self.error = error
                raise
        else:
            self.queue.put(job)

    def flush(self) -> None:
        if self.queue is not None:
            self.queue.join()
        self.check()

    def stop(self) -> None:
        if self.queue is not None and self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
