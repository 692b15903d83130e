"""NativeRolloutServer: Dew's own `Server` behind the `RolloutServer` interface, on a thread.

`submit` checks the request, queues it and returns a future at once. One background thread
drives the server: each turn of its loop swaps in weights a `load` handed over, moves queued
requests into free slots (first come, first served), frees the slots of cancelled futures, and
runs one decode call; the draws that call finishes resolve their futures. A future stays pending
until its draw is done, so `future.cancel()` succeeds any time before that and the request's slot
is free by the next call. A request submitted with `on_ids` also hears of its ids as they come:
after each call that sampled ids for it without finishing it, the loop hands the new ones to
`on_ids`. The engine reads every call's ids back anyway, so this adds no device sync; a request
without `on_ids` costs nothing more.

Futures resolve on the server's thread, so their done-callbacks (and `on_ids`) run there: keep
them short and hand long work such as scoring to a pool.

`load` prepares the copy on the calling thread (checked, cast to the served dtypes, placed on
the served devices) and hands it over without waiting for the decode call in flight; the loop
swaps it in before it takes any request submitted after `load` returned, so those are drawn from
that version or a later one. An exception in the loop fails every pending future with it and
closes the server; `close` fails them with `ServerClosed`.

Not here: the continuous-batching engine itself (`dew_lib.inference.server`), remote engines.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from dew_lib.inference.base import ServerClosed
from dew_lib.inference.server import Server
from dew_lib.records.draw import Draw

OnIds = Callable[[list[int], list[float], list[float]], Any]  # (ids, raw log-probs, behavior log-probs)


class NativeRolloutServer:
    """A `RolloutServer` that drives `server` on a background thread until `close`.

    seed: the seed of the generator that picks a request's seed when `submit` gets none.
    Use it as a context manager, or call `close` when done.
    """

    def __init__(self, server: Server, *, seed: int = 0):
        if not isinstance(server, Server):
            raise ValueError(f"NativeRolloutServer needs a dew_lib.inference.Server, got {type(server).__name__}")
        self.server = server
        self._seeds = np.random.default_rng(seed)
        self._names = itertools.count()
        self._lock = threading.Condition()
        self._queue: deque[tuple[int, np.ndarray, int, int, OnIds | None, Future]] = deque()
        self._running: dict[int, Future] = {}  # requests in a slot, by name
        self._watched: dict[int, list] = {}  # [on_ids, ids reported] of running requests that have one
        self._load: tuple[Any, int] | None = None  # handed over, not yet swapped in
        self._closing = False
        self._error: BaseException | None = None
        self._version = server.version
        self._thread = threading.Thread(target=self._loop, name="dew-rollout-server", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        """The version of the weights new requests are drawn from."""
        return self._version

    @property
    def sampling(self):
        return self.server.sampling

    def submit(self, prompt_ids, max_new_tokens: int, *, seed: int | None = None,
               on_ids: OnIds | None = None) -> Future[Draw]:
        """Queue one request; the future resolves to its `Draw`.

        Refuses (ValueError, here and now) a prompt that does not fit the server's capacity with
        its budget, ids outside the vocabulary, and bad budgets or seeds. seed None draws one
        from this server's own generator. on_ids(ids, raw_log_probs, behavior_log_probs), three
        lists, is called on the server's thread after each engine call that sampled ids for this
        request and did not finish it, with those new ids only; the call that finishes it
        resolves the future instead, whose `Draw` holds every id. An exception in on_ids fails
        this request with it.
        """
        prompt = self.server.check(prompt_ids, max_new_tokens, seed)
        future: Future[Draw] = Future()
        with self._lock:
            self._raise_if_closed()
            if seed is None:
                seed = int(self._seeds.integers(0, 2**32))
            self._queue.append((next(self._names), prompt, int(max_new_tokens), int(seed), on_ids, future))
            self._lock.notify()
        return future

    def load(self, variables: Any, version: int) -> None:
        """Serve `variables` as `version`: every request submitted after this returns is drawn
        from them (or newer ones), and requests generating now continue on them at the loop's
        next call, reporting their older version.

        Checks and copies the tree on the calling thread (floating leaves cast to the served
        dtypes: train float32, serve bfloat16; another structure or shape is refused) and hands
        it to the loop without waiting for the decode call in flight. A newer load handed over
        before the loop took this one replaces it. A failed swap fails the pending draws.
        """
        if isinstance(version, bool) or not isinstance(version, int | np.integer):
            raise ValueError(f"load version must be an int, got {version!r}")
        prepared = self.server.prepare(variables)
        with self._lock:
            self._raise_if_closed()
            self._load = (prepared, int(version))
            self._version = int(version)
            self._lock.notify()

    def close(self) -> None:
        """Stop the loop and fail every request not yet finished with `ServerClosed`."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> NativeRolloutServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _raise_if_closed(self):
        if self._error is not None:
            raise ServerClosed(f"the rollout server's loop failed: {self._error!r}") from self._error
        if self._closing:
            raise ServerClosed("the rollout server is closed")

    # ---- the loop -----------------------------------------------------------------------------

    def _loop(self):
        server = self.server
        try:
            while True:
                with self._lock:
                    while not (self._closing or self._load or self._queue or server.busy):
                        self._lock.wait()
                    if self._closing:
                        break
                    load, self._load = self._load, None  # taken with the queue: see `load`
                    joining = []
                    while self._queue and len(joining) < server.free:
                        request = self._queue.popleft()
                        if not request[-1].cancelled():
                            joining.append(request)
                            self._running[request[0]] = request[-1]  # a failure reaches it
                if load is not None:
                    server.reload(*load, prepared=True)
                for name, prompt, budget, seed, on_ids, _ in joining:
                    server.add(name, prompt, budget, seed=seed)
                    if on_ids is not None:
                        self._watched[name] = [on_ids, 0]
                for name in [n for n, f in self._running.items() if f.cancelled()]:
                    server.cancel(name)
                    del self._running[name]
                    self._watched.pop(name, None)
                for name, draw in server.step():
                    future = self._running.pop(name)
                    self._watched.pop(name, None)
                    if future.set_running_or_notify_cancel():
                        future.set_result(draw)
                if self._watched:
                    self._report()
        except BaseException as error:  # noqa: BLE001 - every failure goes to the futures
            with self._lock:
                self._error = error
                self._fail(error)
            return
        for name in list(self._running):  # leave the engine empty for whoever holds it next
            server.cancel(name)
        with self._lock:
            self._fail(ServerClosed("the rollout server was closed before this draw finished"))

    def _report(self):
        """Hand each watched request the ids the last call sampled for it."""
        for name, watch in list(self._watched.items()):
            ids, raw, behavior = self.server.sampled(name, watch[1])
            if not ids:
                continue
            watch[1] += len(ids)
            try:
                watch[0](ids, raw, behavior)
            except Exception as error:  # noqa: BLE001 - it belongs to that request
                self.server.cancel(name)
                del self._watched[name]
                future = self._running.pop(name)
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)

    def _fail(self, error: BaseException):
        """Fail every request not yet finished (called with the lock held)."""
        pending = [f for *_, f in self._queue] + list(self._running.values())
        self._queue.clear()
        self._running.clear()
        self._watched.clear()
        for future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._load = None
        self._lock.notify_all()
