"""Worker processes for the loaders: plain Python subprocesses fed over pipes.

Why not multiprocessing: its spawn and forkserver start methods re-run the user's main script in
every worker, which breaks scripts without an `if __name__ == "__main__"` guard (the spec's
examples have none), and fork is unsafe once JAX has started its threads. A plain subprocess
imports only what the pickled task needs. It also ends by itself when its owner dies: a killed
trainer closes the pipes, and the worker reads end-of-file and exits instead of lingering.

Protocol: each message is an 8-byte little-endian length and a pickle. The parent sends
`(function, argument)`; the worker answers `(True, result)` or `(False, exception)`.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any

_DATA = Path(__file__).resolve().parent
# The worker registers dew_lib and dew_lib.data as bare namespace packages, so that importing an
# encoder runs only the modules it needs and not the package __init__ files, which import JAX and
# the models (a second of start-up per worker for nothing it uses).
_BOOT = f"""
import sys, types
for name, path in (("dew_lib", {str(_DATA.parent)!r}), ("dew_lib.data", {str(_DATA)!r})):
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
from dew_lib.data.worker import main
main()
"""


def _send(stream: IO[bytes], value: Any) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    size = int.from_bytes(header, "little")
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def _pipes(process: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    """The worker's stdin and stdout: the pool starts every worker with both piped."""
    if process.stdin is None or process.stdout is None:
        raise RuntimeError("a data worker process was started without its stdin and stdout pipes")
    return process.stdin, process.stdout


class WorkerPool:
    """`workers` subprocesses; `submit(function, argument)` returns a Future, one task per worker.

    setup: called once (on the first worker thread that needs it) to give `(function, argument)`
    calls that every worker runs before its first task, such as receiving the tokenizer.
    """

    def __init__(self, workers: int, setup: Callable[[], list] | None = None):
        self._setup, self._setup_lock = setup, threading.Lock()
        self._setup_calls: list | None = None
        env = dict(os.environ)
        # The pool is the parallelism; one tokenizer thread per worker keeps it to `workers` cores.
        env["TOKENIZERS_PARALLELISM"] = "false"
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._tasks: queue.Queue = queue.Queue()
        self._processes: list[subprocess.Popen[bytes]] = []
        self._threads: list[threading.Thread] = []
        for index in range(workers):
            process = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env)
            thread = threading.Thread(target=self._serve, args=(process,), name=f"dew-worker-{index}",
                                      daemon=True)
            thread.start()
            self._processes.append(process)
            self._threads.append(thread)

    def _prepare(self, process: subprocess.Popen[bytes]) -> BaseException | None:
        try:
            stdin, stdout = _pipes(process)
            with self._setup_lock:
                if self._setup_calls is None:
                    self._setup_calls = self._setup() if self._setup is not None else []
                setup_calls = self._setup_calls
            for function, argument in setup_calls:
                _send(stdin, (function, argument))
                ok, value = _receive(stdout)
                if not ok:
                    return value
        except (EOFError, OSError, ValueError) as error:
            return RuntimeError(f"a data worker process exited while starting: {error!r}")
        except Exception as error:  # the setup itself failed in this process
            return error
        return None

    def _serve(self, process: subprocess.Popen[bytes]) -> None:
        failed = self._prepare(process)
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, function, argument = task
            if not future.set_running_or_notify_cancel():
                continue
            if failed is not None:
                future.set_exception(failed)
                continue
            try:
                stdin, stdout = _pipes(process)
                _send(stdin, (function, argument))
                ok, value = _receive(stdout)
            except (EOFError, OSError, ValueError) as error:  # ValueError: the pool was shut down
                # The process is gone: fail this task and every later one this thread takes.
                failed = RuntimeError(
                    f"a data worker process exited unexpectedly (exit code {process.poll()}): {error!r}")
                future.set_exception(failed)
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    def submit(self, function, argument) -> Future:
        future: Future = Future()
        self._tasks.put((future, function, argument))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for process in self._processes:
            if process.stdin:
                try:
                    process.stdin.close()  # the worker reads end-of-file and exits
                except OSError:
                    pass
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> None:
    from dew_lib.quiet import drop_torch_notice

    drop_torch_notice()  # unpickling the tokenizer imports transformers in this process
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the answer channel
    while True:
        try:
            function, argument = _receive(requests)
        except EOFError:
            return  # the owner closed the pipe or died
        try:
            answer = (True, function(argument))
        except BaseException as error:  # handed back to the caller
            answer = (False, error)
        try:
            _send(answers, answer)
        except (pickle.PicklingError, TypeError, AttributeError):
            _send(answers, (False, RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))
        except BrokenPipeError:
            return
