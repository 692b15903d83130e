"""Where a process stands in a multi-process job, read from the environment `dew launch` sets.

Kept apart from distributed.py, which joins the job through JAX: the launcher (launch.py) only
writes these variables for the processes it starts. Importing JAX there made each `dew launch`
take 1.35 s of CPU before the job's own processes started; without it, 0.07 s.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

COORDINATOR = "DEW_COORDINATOR"
PROCESSES = "DEW_PROCESSES"
PROCESS_ID = "DEW_PROCESS_ID"
LOCAL_DEVICES = "DEW_LOCAL_DEVICES"


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process stands in its job.

    coordinator: `host:port` of the coordination service process 0 runs.
    processes: processes in the job. process_id: this one, in [0, processes).
    local_devices: host devices per process on CPU (XLA's forced host device count); None keeps
    the platform's own (one CPU device; every GPU of the host).
    heartbeat_seconds: after this long without a heartbeat a process counts as dead and the
    others stop with an error instead of waiting (what ends a job on several hosts when one
    dies; `dew launch` ends a one-host job at once).
    """

    coordinator: str
    processes: int
    process_id: int
    local_devices: int | None = None
    heartbeat_seconds: int = 100

    def __post_init__(self):
        if ":" not in self.coordinator:
            raise ValueError(f"Topology.coordinator must be host:port, got {self.coordinator!r}")
        if self.processes < 1:
            raise ValueError(f"Topology.processes must be >= 1, got {self.processes}")
        if not 0 <= self.process_id < self.processes:
            raise ValueError(f"Topology.process_id must be in [0, {self.processes}), got {self.process_id}")
        if self.local_devices is not None and self.local_devices < 1:
            raise ValueError(f"Topology.local_devices must be >= 1 or None, got {self.local_devices}")

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Topology | None:
        """The topology DEW_COORDINATOR, DEW_PROCESSES and DEW_PROCESS_ID describe; None when
        DEW_PROCESSES is unset (a single-process run)."""
        env = os.environ if env is None else env
        if PROCESSES not in env:
            return None
        missing = [name for name in (COORDINATOR, PROCESS_ID) if not env.get(name)]
        if missing:
            raise ValueError(f"{PROCESSES} is set without {' and '.join(missing)}; a multi-process job "
                             f"needs {COORDINATOR}=host:port, {PROCESSES}=N and {PROCESS_ID}=i in every "
                             "process (dew launch sets them)")
        number = {}
        for name in (PROCESSES, PROCESS_ID, LOCAL_DEVICES):
            if env.get(name):
                try:
                    number[name] = int(env[name])
                except ValueError:
                    raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None
        return cls(env[COORDINATOR], number[PROCESSES], number[PROCESS_ID], number.get(LOCAL_DEVICES))
