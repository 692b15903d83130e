"""What a runner is given (Program) and what it returns (Outcome with its Verdict).

A Program is files written into a fresh temporary directory, an argv run there without a shell,
and the bytes sent to its stdin. An Outcome is the Verdict, the exit code, the captured stdout
and stderr, the seconds from launch to exit and a one-line detail. A program that fails, hangs,
crashes or floods its output is an Outcome like any other; runners raise only when the sandbox
itself cannot run (a missing tool, a broken container engine).

Not here: running anything (the runners), the thread pool (`fleet.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import posixpath
import shutil
import signal
import tempfile
from collections.abc import Iterator, Mapping, Sequence


class Verdict(enum.Enum):
    """How a program ended.

    COMPLETED: exit status 0. FAILED: any other exit status. TIMEOUT: killed at the wall
    deadline, or stopped by its CPU-time limit. CRASHED: killed by a signal it did not ask for
    from us (SIGSEGV, SIGABRT, an out-of-memory kill, ...). OUTPUT_LIMIT: killed because its
    stdout and stderr together passed `SandboxLimits.max_output_bytes`.
    """

    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    OUTPUT_LIMIT = "output_limit"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """Files (relative path -> text or bytes), the argv to run among them, and its stdin.

    `argv[0]` is looked up on the sandbox's PATH (/usr/local/bin, /usr/bin, /bin), so
    `("python3", "main.py")` runs the system Python on `main.py` in the job directory.
    """

    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    argv: Sequence[str] = ()
    stdin: str | bytes = b""

    def __post_init__(self):
        argv = self.argv
        if isinstance(argv, (str, bytes)) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"Program.argv must be a non-empty sequence of strings (no shell), got {argv!r}")
        if any("\0" in a for a in argv):
            raise ValueError(f"Program.argv must not contain NUL characters, got {argv!r}")
        object.__setattr__(self, "argv", tuple(argv))
        if not isinstance(self.files, Mapping):
            raise ValueError(f"Program.files must map relative paths to str or bytes, got {type(self.files).__name__}")
        files = {}
        for name, content in self.files.items():
            clean = posixpath.normpath(name) if isinstance(name, str) else ""
            if (not clean or clean.startswith(("/", "../")) or clean in (".", "..") or "\0" in clean):
                raise ValueError(f"Program.files key {name!r} must be a relative path inside the job directory")
            if not isinstance(content, (str, bytes)):
                raise ValueError(f"Program.files[{name!r}] must be str or bytes, got {type(content).__name__}")
            files[clean] = content
        object.__setattr__(self, "files", files)
        if not isinstance(self.stdin, (str, bytes)):
            raise ValueError(f"Program.stdin must be str or bytes, got {type(self.stdin).__name__}")

    @property
    def stdin_bytes(self) -> bytes:
        return self.stdin.encode() if isinstance(self.stdin, str) else self.stdin


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The result of one program run.

    exit_code: the exit status, or minus the signal number that ended it (as `subprocess` does;
    -9 when the runner killed it). stdout, stderr: what was read, decoded as UTF-8 with
    replacement, cut at the output limit. seconds: wall time from launch to the end.
    detail: one line saying why, e.g. "exit 1" or "killed at the 10.0 s wall deadline".
    """

    verdict: Verdict
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    detail: str = ""


def verdict_of(exit_code: int, *, cause: str, limits_text: str = "") -> tuple[Verdict, str]:
    """The Verdict and detail of a program that ended with `exit_code` for `cause`.

    cause: "exit" (it ended by itself), "deadline" or "output" (the runner killed it).
    """
    if cause == "deadline":
        return Verdict.TIMEOUT, f"killed at the {limits_text} wall deadline"
    if cause == "output":
        return Verdict.OUTPUT_LIMIT, f"killed after more than {limits_text} bytes of output"
    if exit_code == 0:
        return Verdict.COMPLETED, "exit 0"
    if exit_code > 0:
        return Verdict.FAILED, f"exit {exit_code}"
    name = _signal_name(-exit_code)
    if -exit_code == signal.SIGXCPU:
        return Verdict.TIMEOUT, f"stopped by its CPU-time limit ({name})"
    return Verdict.CRASHED, f"killed by {name}"


def signal_status(code: int) -> int:
    """Map a wrapper's `128 + n` exit status (bwrap, Docker) back to `-n` for signal n."""
    if 128 < code < 128 + signal.NSIG:
        return -(code - 128)
    return code


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@contextlib.contextmanager
def job_directory(program: Program, *, root: str | None = None, mode: int = 0o700,
                  owner: int | None = None) -> Iterator[str]:
    """A fresh directory holding `program.files`, removed with everything in it afterwards.

    mode: the directory's permissions (0o755 when an unprivileged container user must read it).
    owner: uid and gid to give the directory itself (the namespace runner's sandbox user), so
    the program can write there; the files stay the caller's and read-only to others.
    """
    path = tempfile.mkdtemp(prefix="dew-job-", dir=root)
    try:
        for name, content in program.files.items():
            target = os.path.join(path, name)
            parent = os.path.dirname(target)
            os.makedirs(parent, mode=0o755, exist_ok=True)
            data = content.encode() if isinstance(content, str) else content
            with open(target, "wb") as f:
                f.write(data)
            os.chmod(target, 0o644)
        os.chmod(path, mode)
        if owner is not None:
            for directory, _, _ in os.walk(path):
                os.chown(directory, owner, owner)
        yield path
    finally:
        remove_tree(path)


def remove_tree(path: str) -> None:
    """Remove a job directory even where the program took away its own permissions."""
    try:
        shutil.rmtree(path)
    except OSError:
        # A program may leave directories it made unreadable (chmod 000): open them up
        # again, never following a symlink it planted, then remove.
        for directory, subdirs, _ in os.walk(path):
            for sub in subdirs:
                full = os.path.join(directory, sub)
                if not os.path.islink(full):
                    with contextlib.suppress(OSError):
                        os.chmod(full, 0o700)
        shutil.rmtree(path, ignore_errors=True)
