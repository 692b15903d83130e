"""One JSON request, one JSON reply: the parent's end of a tool worker's pipes, under limits.

`WorkerChannel` wraps a started worker process (`dew_lib.sandbox.launcher.start`). `request`
writes a request line to its stdin and reads one reply line from its stdout, while draining
stderr into a bounded tail (so a chatty worker never blocks on a full pipe) and watching the
process through a pidfd. It raises `ToolFailure` when the session's wall deadline passes, a
reply line grows past the size cap, a reply is not a JSON object, the worker exits, or the
worker answers `{"error": ...}`. Every failure but the last leaves the stream out of step, so
the channel kills the worker's process group at once and refuses later requests; after an
`{"error": ...}` reply the worker is still in step and may be asked again.

Nothing here runs on a thread of its own: the deadline is checked while the parent waits for a
reply, and the worker is killed, at the latest, by `close`.

Not here: what requests and replies mean (`subprocess_environment.py`), the worker's loop
(`dew_lib.tool_worker`).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time
from typing import IO, NoReturn

from dew_lib.sandbox import launcher
from dew_lib.sandbox.limits import SandboxLimits
from dew_lib.sandbox.program import signal_status

STDERR_TAIL = 4096  # bytes of the worker's stderr kept for error messages
_READ = 1 << 16


class ToolFailure(RuntimeError):
    """A tool worker failed: no reply in time, an oversized or malformed reply, an exit, or an
    `{"error": ...}` reply. `stderr` holds the tail of what the worker wrote to stderr."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(f"{message}; stderr tail: {stderr!r}" if stderr else f"{message}; no stderr")
        self.stderr = stderr


class WorkerChannel:
    """The parent's end of one worker's stdin, stdout and stderr.

    started: `time.monotonic()` taken just before the launch; the deadline counts from it.
    wrapped: the worker runs under bubblewrap, which reports death by signal n as 128 + n.
    """

    def __init__(self, process: subprocess.Popen[bytes], limits: SandboxLimits, *, started: float,
                 wrapped: bool = False):
        if process.stdin is None or process.stdout is None or process.stderr is None:
            raise ValueError("a WorkerChannel needs a process started with stdin, stdout and stderr piped")
        self.process, self.limits, self.wrapped = process, limits, wrapped
        self.deadline = started + limits.wall_seconds
        self.failure: str | None = None
        self._stdout, self._stderr = bytearray(), bytearray()
        self._pipes: tuple[IO[bytes], IO[bytes], IO[bytes]] = (process.stdin, process.stdout, process.stderr)
        self._stdin_fd, self._stdout_fd = process.stdin.fileno(), process.stdout.fileno()
        self._stderr_fd = process.stderr.fileno()
        os.set_blocking(self._stdin_fd, False)
        self._pidfd = os.pidfd_open(process.pid)
        self._selector = selectors.DefaultSelector()
        for fd in (self._pidfd, self._stdout_fd, self._stderr_fd):
            self._selector.register(fd, selectors.EVENT_READ)
        self._returncode: int | None = None  # set once the leader is reaped
        self._pending = memoryview(b"")  # the part of the current request not yet written
        self._exited_at: float | None = None  # when the worker exited
        self._closed_at: float | None = None  # when its stdout ended

    def request(self, message: dict, what: str) -> dict:
        """Send `message`, return the reply object. `what` names the request in errors."""
        if self.failure is not None:
            raise ToolFailure(f"the tool worker already failed ({self.failure}); {what} was not sent",
                              self.stderr_tail())
        if self._stdout:
            self.fail(f"the tool worker wrote output nobody asked for before {what}: "
                      f"{bytes(self._stdout[:200])!r}")
        if self._exited_at is not None:
            self.fail(f"the tool worker {self._exit_text()} before {what} was sent")
        payload = json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"
        line = self._exchange(memoryview(payload), what)
        try:
            reply = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            self.fail(f"the tool worker's reply to {what} is not JSON ({error}): {line[:200]!r}")
        if not isinstance(reply, dict):
            self.fail(f"the tool worker's reply to {what} is not a JSON object: {line[:200]!r}")
        if "error" in reply:
            raise ToolFailure(f"the tool worker answered {what} with an error: {reply['error']}",
                              self.stderr_tail())
        return reply

    def fail(self, message: str) -> NoReturn:
        """Kill the worker (its stream is out of step) and raise ToolFailure with `message`."""
        self.failure = message
        self._kill()
        raise ToolFailure(message, self.stderr_tail())

    def stderr_tail(self) -> str:
        return bytes(self._stderr).decode("utf-8", "replace")

    def close(self) -> None:
        """Kill the worker's process group, reap the worker and close every descriptor."""
        try:
            self._kill()
            self._reap()
        finally:
            self._selector.close()
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            for pipe in self._pipes:
                with contextlib.suppress(OSError):
                    pipe.close()

    def _exchange(self, pending: memoryview, what: str) -> bytes:
        """Write `pending`, then wait for one complete reply line and return it (no newline)."""
        cap = self.limits.max_output_bytes
        writing = self._start_writing(pending)
        while True:
            end = self._stdout.find(b"\n")
            if end > cap or (end < 0 and len(self._stdout) > cap):
                self.fail(f"the tool worker's reply to {what} is longer than the "
                          f"{cap}-byte cap (SandboxLimits.max_output_bytes)")
            if end >= 0:
                if writing:
                    self.fail(f"the tool worker replied to {what} before reading the whole request")
                line = bytes(self._stdout[:end])
                del self._stdout[:end + 1]
                return line
            now = time.monotonic()
            exited_at, closed_at = self._exited_at, self._closed_at
            if exited_at is not None and (closed_at is not None or now >= exited_at + launcher.DRAIN_SECONDS):
                self.fail(f"the tool worker {self._exit_text()} before replying to {what}")
            if closed_at is not None and now >= closed_at + launcher.DRAIN_SECONDS:
                self.fail(f"the tool worker closed its stdout before replying to {what}")
            if now >= self.deadline:
                self.fail(f"no reply to {what} within the session's {self.limits.wall_seconds:g} s "
                          "wall deadline (SandboxLimits.wall_seconds, counted from entering the "
                          "environment)")
            # An exit and the end of stdout arrive in either order; each waits briefly for the other.
            limit = min(t for t in (self.deadline, exited_at and exited_at + launcher.DRAIN_SECONDS,
                                    closed_at and closed_at + launcher.DRAIN_SECONDS) if t)
            for key, _ in self._selector.select(max(0.0, limit - now)):
                if key.fd == self._pidfd:
                    self._exited_at = time.monotonic()
                    self._selector.unregister(self._pidfd)
                    self._kill()  # its children go with it, and the pipes close
                    self._reap()
                elif key.fd == self._stdin_fd:
                    writing = self._write()
                elif not self._read(key.fd) and key.fd == self._stdout_fd:
                    self._closed_at = time.monotonic()

    def _start_writing(self, payload: memoryview) -> bool:
        """Write what the pipe takes now, leave the rest to the select loop; True while pending."""
        self._pending = payload
        if self._write():
            self._selector.register(self._stdin_fd, selectors.EVENT_WRITE)
            return True
        return False

    def _write(self) -> bool:
        """Write more of the pending request; True while some of it is left."""
        try:
            written = os.write(self._stdin_fd, self._pending[:_READ])
        except BlockingIOError:
            written = 0
        except (BrokenPipeError, ConnectionResetError):
            written = len(self._pending)  # it stopped reading; its exit shows through the pidfd
        self._pending = self._pending[written:]
        if not self._pending and self._stdin_fd in self._selector.get_map():
            self._selector.unregister(self._stdin_fd)
        return bool(self._pending)

    def _read(self, fd: int) -> bool:
        """Read what `fd` has; False (and stop watching it) at end of file."""
        data = os.read(fd, _READ)
        if not data:
            self._selector.unregister(fd)
            return False
        if fd == self._stdout_fd:
            self._stdout += data
        else:
            self._stderr += data
            del self._stderr[:-STDERR_TAIL]
        return True

    def _kill(self) -> None:
        # Only before the leader is reaped: until then its pid, the group's id, cannot be reused.
        if self._returncode is None:
            launcher.kill_group(self.process)

    def _reap(self) -> None:
        if self._returncode is None:
            self._returncode = self.process.wait()

    def _exit_text(self) -> str:
        """How the worker ended, in words, with the limit that likely did it."""
        code = self._returncode
        if code is None:
            raise RuntimeError("the tool worker's exit status was asked for before it was reaped")
        if self.wrapped:
            code = signal_status(code)
        if code >= 0:
            return (f"exited with status {code} (limits: {self.limits.memory_bytes} bytes of address "
                    f"space, RLIMIT_AS; {self.limits.cpu_seconds} s of CPU, RLIMIT_CPU)")
        number = -code
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        if number == signal.SIGXCPU:
            return f"was killed by {name}: it used its {self.limits.cpu_seconds} s CPU-time limit (RLIMIT_CPU)"
        return (f"was killed by {name} (a crash, the CPU limit's hard kill, the kernel's "
                f"out-of-memory killer, or another process)")
