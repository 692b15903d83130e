"""SandboxLimits: the resource limits every sandboxed program (and tool worker) runs under.

One frozen set of numbers shared by the runners of `SandboxFleet` and by the later
`SubprocessEnvironment`. Where each limit is enforced:

| field | enforced by | runners |
| --- | --- | --- |
| `wall_seconds` | the parent's clock: the process group (or container) is killed at the deadline | all |
| `cpu_seconds` | RLIMIT_CPU in the program (SIGXCPU at the limit, SIGKILL one second later) | all |
| `memory_bytes` | RLIMIT_AS in the program; the container's memory (and swap) limit | all |
| `max_output_bytes` | the parent stops reading and kills the program past it | all |
| `max_file_bytes` | RLIMIT_FSIZE: no single file written grows past it | all |
| `max_processes` | RLIMIT_NPROC in the sandbox's user namespace; the container's pids limit | namespace, container |

`ProcessRunner` cannot limit the process count: RLIMIT_NPROC counts every process of the user
(and is ignored for root), so a storm there is only stopped by the wall deadline.

Not here: the runners that apply these (`process.py`, `namespace.py`, `container.py`).
"""

from __future__ import annotations

import dataclasses

from dew_lib.options import integer, number


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Resource limits of one program run (see the module docstring for who enforces which).

    wall_seconds: deadline from launch to exit, measured by the parent (default 10 s).
    cpu_seconds: CPU time per process, whole seconds (RLIMIT_CPU; default 10).
    memory_bytes: address space per process (RLIMIT_AS) or the container's memory (default 1 GiB).
    max_output_bytes: stdout and stderr together that the parent reads before it kills the
        program; a tool worker applies it to each message (default 1 MiB).
    max_file_bytes: the largest file the program may write (RLIMIT_FSIZE; default 64 MiB).
    max_processes: processes and threads at once inside a namespace or container (default 64).
    """

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30
    max_output_bytes: int = 1 << 20
    max_file_bytes: int = 64 << 20
    max_processes: int = 64

    def __post_init__(self):
        object.__setattr__(self, "wall_seconds", number("SandboxLimits.wall_seconds", self.wall_seconds,
                                                        above=0, accepts="a positive number of seconds"))
        minimum = {"cpu_seconds": 1, "memory_bytes": 1 << 20, "max_output_bytes": 1,
                   "max_file_bytes": 1, "max_processes": 1}
        for name, least in minimum.items():
            value = integer(f"SandboxLimits.{name}", getattr(self, name), at_least=least,
                            accepts=f"an integer >= {least}")
            object.__setattr__(self, name, value)
