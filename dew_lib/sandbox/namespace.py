"""NamespaceRunner: each program in fresh Linux namespaces through bubblewrap, no daemon needed.

`bwrap` (Debian package `bubblewrap`) builds, per program: a new user, mount, pid, network,
IPC, UTS and cgroup namespace; a root that holds only read-only system directories (/usr and
its /bin, /lib, /sbin links, a few /etc files the dynamic loader and Python read, and any
`read_only` paths you add); a new /proc, a minimal /dev, private size-capped tmpfs at /tmp and
/dev/shm; and the job directory, bound read-write at /work as the working directory, as the
only writable place that outlives the run. The network namespace has only its own loopback,
so nothing on the host (127.0.0.1 included) or beyond is reachable. Inside, the program also
gets the launcher's rlimits plus RLIMIT_NPROC; that count is per sandbox, because each
sandbox is its own user namespace. When the pid namespace's first process ends, the kernel
kills every other process in it, so nothing outlives the program, however it forked.

Running as root: RLIMIT_NPROC is never enforced for uid 0, so the runner first drops to
`user` (default 65534, "nobody") and runs bwrap unprivileged; the job directory is handed to
that uid. Unprivileged user namespaces must therefore be allowed (they are on Debian 11+ and
most distributions; Ubuntu 24.04 allows them to bwrap through its AppArmor profile).

What it does not isolate: the kernel is shared (a kernel bug is an escape; a container runtime
like gVisor is the answer to that); CPU time and memory are limited per process, not per
sandbox (no cgroups), so a program may use up to `max_processes` times those; the read-only
system directories can be read; timing and /proc/cpuinfo-style host facts are visible.

Not here: the process launcher (launcher.py), containers (container.py).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence

from dew_lib.options import integer
from dew_lib.sandbox import launcher
from dew_lib.sandbox.limits import SandboxLimits
from dew_lib.sandbox.process import outcome_of
from dew_lib.sandbox.program import Outcome, Program, job_directory, signal_status

WORKDIR = "/work"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group",
             "nsswitch.conf", "alternatives")
NOBODY = 65534


class NamespaceRunner:
    """Run a Program inside bubblewrap namespaces (see the module docstring for what is isolated).

    read_only: extra host paths bound read-only at the same place (an interpreter outside
        /usr, a virtual environment); they must not lie under /work.
    tmp_bytes: the size of the private /tmp and /dev/shm tmpfs each (default 64 MiB).
    user: the uid and gid the sandbox runs as when the parent is root (default 65534).
    root: where job directories are made on the host (default: the system temporary directory).

    Construction checks that bwrap, prlimit and setpriv exist and runs `true` once in a
    sandbox built exactly as every later one, raising SandboxUnavailable with bwrap's reason
    when this machine cannot (no user namespaces, an unreadable `read_only` path). A bwrap
    failure after that (say, out of memory) shows as a FAILED outcome with bwrap's message.
    """

    def __init__(self, *, read_only: Sequence[str] = (), tmp_bytes: int = 64 << 20,
                 user: int = NOBODY, root: str | None = None):
        if isinstance(read_only, str):
            raise ValueError(f"NamespaceRunner.read_only must be a sequence of paths, got the string {read_only!r}")
        extra = tuple(os.path.abspath(p) for p in read_only)
        for path in extra:
            if path == WORKDIR or path.startswith(WORKDIR + "/") or path == "/":
                raise ValueError(f"NamespaceRunner.read_only path {path!r} would cover the job directory "
                                 f"{WORKDIR} or the whole host; bind something narrower")
            if not os.path.exists(path):
                raise ValueError(f"NamespaceRunner.read_only path {path!r} does not exist")
        self.read_only = extra
        self.tmp_bytes = integer("NamespaceRunner.tmp_bytes", tmp_bytes, at_least=1 << 20,
                                 accepts="an integer >= 1 MiB")
        self.root = root
        self.user = user if os.geteuid() == 0 else None
        self._bwrap = launcher.tool("bwrap", "bubblewrap")
        self._setpriv = launcher.tool("setpriv", "util-linux")
        self._prlimit = launcher.tool("prlimit", "util-linux")
        self._disable_userns = "--disable-userns" in subprocess.run(
            [self._bwrap, "--help"], capture_output=True, text=True, check=False).stdout
        probe = self.run(Program(argv=("true",)), SandboxLimits(wall_seconds=30))
        if probe.exit_code != 0:
            raise launcher.SandboxUnavailable(
                f"bwrap could not run a program here ({probe.detail}): {probe.stderr.strip()}")

    def bwrap_argv(self, job: str) -> list[str]:
        """The bwrap command line (up to its `--`) for a job directory on the host."""
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
                "--cap-drop", "ALL", "--hostname", "sandbox"]
        if self._disable_userns:
            argv.append("--disable-userns")  # no nested user namespaces (bwrap >= 0.8)
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        for name in ETC_FILES:
            path = os.path.join("/etc", name)
            if os.path.exists(path):
                argv += ["--ro-bind", path, path]
        for path in self.read_only:
            argv += ["--ro-bind", path, path]
        size = str(self.tmp_bytes)
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
                 "--remount-ro", "/dev", "--size", size, "--tmpfs", "/tmp",
                 "--bind", job, WORKDIR, "--chdir", WORKDIR, "--remount-ro", "/"]
        return argv

    def run(self, program: Program, limits: SandboxLimits) -> Outcome:
        with job_directory(program, root=self.root, owner=self.user) as job:
            argv = [*self.bwrap_argv(job), "--",
                    *launcher.rlimit_argv(limits, processes=True, prlimit=self._prlimit), *program.argv]
            started = time.monotonic()
            process = launcher.start(argv, cwd=job, env=launcher.minimal_env(WORKDIR), user=self.user,
                                     setpriv=self._setpriv)
            done = launcher.supervise(process, program.stdin_bytes, started=started,
                                      wall_seconds=limits.wall_seconds,
                                      max_output_bytes=limits.max_output_bytes)
        # bwrap reports a program killed by signal n as exit status 128 + n.
        code = signal_status(done.returncode) if done.cause == "exit" else done.returncode
        return outcome_of(done, limits, returncode=code)

    def __repr__(self):
        return f"NamespaceRunner(read_only={self.read_only!r}, tmp_bytes={self.tmp_bytes})"

