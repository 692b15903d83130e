"""ProcessRunner: each program in a plain child process with rlimits and a hard deadline.

It limits and cleans up; it does not isolate. The program runs as your user, sees your whole
filesystem (it can read what you can read and write where you can write), reaches any network
you can, may start as many processes as your user may, and a child that calls setsid() leaves
the process group that is killed at the end. Use it for code you trust (tests, your own tools)
and the namespace or container runner for code a model wrote.

Not here: namespaces (namespace.py), containers (container.py).
"""

from __future__ import annotations

import time

from dew_lib.sandbox import launcher
from dew_lib.sandbox.limits import SandboxLimits
from dew_lib.sandbox.program import Outcome, Program, job_directory, verdict_of


class ProcessRunner:
    """Run a Program through the shared launcher, in its own temporary directory.

    Applies RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE and no core dumps, a new session, SIGKILL on
    parent death and a minimal environment (HOME and TMPDIR are the job directory); kills the
    process group at the wall deadline, on excess output and after exit.
    Does NOT isolate: same user, same filesystem, same network, no process-count limit.

    root: where job directories are made (default: the system temporary directory).
    """

    def __init__(self, *, root: str | None = None):
        self.root = root
        self._setpriv = launcher.tool("setpriv", "util-linux")
        self._prlimit = launcher.tool("prlimit", "util-linux")

    def run(self, program: Program, limits: SandboxLimits) -> Outcome:
        with job_directory(program, root=self.root) as job:
            argv = [*launcher.rlimit_argv(limits, prlimit=self._prlimit), *program.argv]
            started = time.monotonic()
            process = launcher.start(argv, cwd=job, env=launcher.minimal_env(job, TMPDIR=job),
                                     setpriv=self._setpriv)
            done = launcher.supervise(process, program.stdin_bytes, started=started,
                                      wall_seconds=limits.wall_seconds,
                                      max_output_bytes=limits.max_output_bytes)
        return outcome_of(done, limits)

    def __repr__(self):
        return "ProcessRunner()"


def outcome_of(done: launcher.Finished, limits: SandboxLimits, returncode: int | None = None) -> Outcome:
    """The Outcome of a supervised run (`returncode` overrides the raw one, e.g. decoded 128+n)."""
    code = done.returncode if returncode is None else returncode
    text = {"deadline": f"{limits.wall_seconds:g} s", "output": str(limits.max_output_bytes)}
    verdict, detail = verdict_of(code, cause=done.cause, limits_text=text.get(done.cause, ""))
    return Outcome(verdict, code, done.stdout.decode("utf-8", "replace"),
                   done.stderr.decode("utf-8", "replace"), done.seconds, detail)
