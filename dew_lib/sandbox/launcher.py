"""Start a process the way every local sandbox does, and watch it to the end.

`start` runs an argv in its own session and process group, with a minimal environment, under
`setpriv --pdeathsig KILL` so the kernel SIGKILLs it when the thread that started it dies (the
whole parent process, SIGKILL included). `rlimit_argv` is the `prlimit` prefix that sets
RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, a zero RLIMIT_CORE and, where asked, RLIMIT_NPROC in the
program before it runs. `supervise` feeds stdin, reads stdout and stderr, and kills the whole
process group at the wall deadline, on excess output, and as soon as the leader exits (so no
background child outlives it). `kill_group` is that kill, for callers with their own loop.

Why helper binaries instead of a Python `preexec_fn`: the fleet launches from many threads,
where code run between fork and exec can deadlock, and a `preexec_fn` forces a full fork of a
parent that may map gigabytes; with none, `subprocess` uses vfork and launching stays cheap.
`prlimit` and `setpriv` come with util-linux, which every Debian-like system has.

Two things to know: the parent-death signal belongs to the starting *thread*, so start and
wait on the same long-lived thread; and a process that calls setsid() leaves the group, so
only a pid namespace (the namespace runner) or a container catches every descendant.

Not here: filesystem or network isolation (namespace.py, container.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from dew_lib.sandbox.limits import SandboxLimits

PATH = "/usr/local/bin:/usr/bin:/bin"
_READ = 1 << 16
# After the leader exits and its group is killed, what is still in the pipes is read for at
# most this long; only a process that escaped the group (setsid) can hold them open longer.
DRAIN_SECONDS = 0.5


class SandboxUnavailable(RuntimeError):
    """The sandbox itself cannot run here (a missing tool, namespaces not allowed, no engine)."""


def tool(name: str, package: str) -> str:
    """The absolute path of a helper binary, or SandboxUnavailable naming the package to install."""
    path = shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + PATH + ":/usr/sbin:/sbin")
    if path is None:
        raise SandboxUnavailable(
            f"{name} was not found on PATH; install the {package} package (Debian: apt-get install {package})")
    return path


def minimal_env(home: str, **extra: str) -> dict[str, str]:
    """The whole environment a program sees: PATH, HOME, a UTF-8 locale, and `extra`."""
    return {"PATH": PATH, "HOME": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", **extra}


def rlimit_argv(limits: SandboxLimits, *, processes: bool = False, prlimit: str | None = None) -> list[str]:
    """`prlimit ... --`: the program's rlimits, set in it before it runs.

    The CPU limit's hard value is one second above the soft one, so the program first gets
    SIGXCPU (reported as TIMEOUT) and SIGKILL only if it ignores that.
    """
    cpu = limits.cpu_seconds
    argv = [prlimit or tool("prlimit", "util-linux"), f"--cpu={cpu}:{cpu + 1}",
            f"--as={limits.memory_bytes}:{limits.memory_bytes}", "--core=0:0",
            f"--fsize={limits.max_file_bytes}:{limits.max_file_bytes}"]
    if processes:
        argv.append(f"--nproc={limits.max_processes}:{limits.max_processes}")
    return [*argv, "--"]


def start(argv: Sequence[str], *, cwd: str, env: Mapping[str, str], user: int | None = None,
          pass_fds: Sequence[int] = (), setpriv: str | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session with pipes on stdin, stdout and stderr.

    user: run as this uid and gid with no supplementary groups (only root may ask). The
    parent-death signal is set after the switch, since changing credentials clears it.
    """
    prefix = [setpriv or tool("setpriv", "util-linux")]
    if user is not None:
        prefix += [f"--reuid={user}", f"--regid={user}", "--clear-groups"]
    prefix += ["--pdeathsig", "KILL", "--"]
    return subprocess.Popen([*prefix, *argv], cwd=cwd, env=dict(env), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            close_fds=True, pass_fds=tuple(pass_fds))


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group `process` leads.

    Call it before the leader is reaped (while it runs or is a zombie): its pid, which names
    the group, cannot be reused until then.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


@dataclasses.dataclass(frozen=True)
class Finished:
    """What `supervise` saw: the exit status (minus the signal), why it ended, and the output."""

    returncode: int
    cause: str  # "exit", "deadline" or "output"
    stdout: bytes
    stderr: bytes
    seconds: float


def supervise(process: subprocess.Popen[bytes], stdin: bytes, *, started: float, wall_seconds: float,
              max_output_bytes: int) -> Finished:
    """Run `process` to its end: feed stdin, collect output, enforce the deadline and the cap.

    started: `time.monotonic()` taken just before the launch; the deadline counts from it.
    The process group is killed in every case before the leader is reaped.
    """
    if process.stdin is None or process.stdout is None or process.stderr is None:
        kill_group(process)
        raise ValueError("supervise needs a process started with stdin, stdout and stderr piped (see `start`)")
    stdin_pipe, stdout_pipe, stderr_pipe = process.stdin, process.stdout, process.stderr
    deadline = started + wall_seconds
    streams = {stdout_pipe.fileno(): bytearray(), stderr_pipe.fileno(): bytearray()}
    total = 0
    cause = None
    ended_at = None
    pidfd = os.pidfd_open(process.pid)
    selector = selectors.DefaultSelector()
    try:
        selector.register(pidfd, selectors.EVENT_READ)
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        pending = memoryview(stdin)
        stdin_fd = stdin_pipe.fileno()
        if pending:
            os.set_blocking(stdin_fd, False)
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            stdin_pipe.close()
        while cause is None:
            now = time.monotonic()
            if ended_at is None and now >= deadline:
                cause = "deadline"
                break
            limit = deadline if ended_at is None else min(deadline, ended_at + DRAIN_SECONDS)
            if ended_at is not None and (not _open_reads(selector, streams) or now >= limit):
                cause = "exit"
                break
            for key, _ in selector.select(max(0.0, limit - now)):
                fd = key.fd
                if fd == pidfd:
                    ended_at = time.monotonic()
                    selector.unregister(pidfd)
                    kill_group(process)  # background children die with the leader
                elif fd == stdin_fd:
                    try:
                        written = os.write(fd, pending[:_READ])
                    except BlockingIOError:
                        continue
                    except (BrokenPipeError, ConnectionResetError):
                        written = len(pending)  # it stopped reading; the rest is dropped
                    pending = pending[written:]
                    if not pending:
                        selector.unregister(fd)
                        stdin_pipe.close()
                else:
                    data = os.read(fd, _READ)
                    if not data:
                        selector.unregister(fd)
                        continue
                    room = max_output_bytes - total
                    streams[fd] += data[:room]
                    total += len(data)
                    if total > max_output_bytes:
                        cause = "output"
                        break
    finally:
        selector.close()
        os.close(pidfd)
        kill_group(process)
        process.wait()
        seconds = (ended_at or time.monotonic()) - started
        for pipe in (stdin_pipe, stdout_pipe, stderr_pipe):
            with contextlib.suppress(OSError):
                pipe.close()
    out, err = streams.values()
    return Finished(process.returncode, cause, bytes(out), bytes(err), seconds)


def _open_reads(selector: selectors.BaseSelector, streams: dict[int, bytearray]) -> bool:
    return any(fd in streams for fd in selector.get_map())
