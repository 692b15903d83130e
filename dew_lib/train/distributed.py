"""Multi-process jobs: join one from the environment a launcher sets, and the few host-side
collectives training needs beside the compiled step.

A job is N processes (several on one host, or one per host), each with its own local devices;
together their devices form one global mesh, which the Trainer is data parallel over. Every
process runs the same script: it calls `initialize()` before anything touches JAX, reads its own
share of the data (`Partition.current()`), and calls `fit` like a single-process run. The
compiled step's metrics are the same on every process; sinks write on the primary process
(process 0) only, so one process owns the metrics and the run store. Checkpoints are written by
every process together (orbax) and restore under any process count.

`initialize()` reads DEW_COORDINATOR (host:port of process 0's coordination service),
DEW_PROCESSES, DEW_PROCESS_ID and, on CPU, DEW_LOCAL_DEVICES (host devices per process), which
`dew launch` sets for each process it starts (launch.py); on several hosts, set them yourself.
With none of them set it does nothing, so a script runs alone unchanged. On CPU the processes
talk over gloo.

Why these helpers exist: a host-side decision (an admission that failed, a stream position, a
push that failed) must be the same on every process, or the next collective waits forever.

Not here: the environment's names and `Topology` (topology.py), starting the processes
(launch.py), what each component does under several processes (the Trainer, the data
partitions, SampledRollout).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import jax
import numpy as np

from dew_lib.train.topology import Topology


def initialize(topology: Topology | None = None, *, timeout_seconds: int = 300) -> Topology | None:
    """Join the job `topology` describes (default: the environment's); returns it, or None
    when this is a single-process run. Call it before anything else uses JAX.

    timeout_seconds: how long to wait for every process to join.
    """
    topology = Topology.from_environment() if topology is None else topology
    if topology is None:
        return None
    if topology.local_devices is not None:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={topology.local_devices}")
        os.environ["XLA_FLAGS"] = " ".join(flags)
    if topology.processes == 1:  # a job of one: nothing to join
        return topology
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU only; GPUs use NCCL
    try:
        jax.distributed.initialize(topology.coordinator, topology.processes, topology.process_id,
                                   initialization_timeout=timeout_seconds,
                                   heartbeat_timeout_seconds=topology.heartbeat_seconds)
    except RuntimeError as error:
        if "before" in str(error):  # JAX already computed: its backend cannot join a job any more
            raise RuntimeError(
                "distributed.initialize() must run before anything uses JAX (an array, a jit, "
                "jax.devices()); call it first thing in the script") from error
        raise
    return topology


def is_primary() -> bool:
    """Whether this is process 0, the one that writes metrics, stores and files."""
    return jax.process_index() == 0


def every_process(value: Any) -> list:
    """A picklable value from every process, in process order (the same list on each); every
    process must call it. Pickle, not JSON: sessions hold numpy arrays, and the processes are
    one job of the same code."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size]))).reshape(-1)
    # a power-of-two width: each width compiles its own gather, and the pickles' sizes all differ
    padded = np.zeros(1 << max(10, (int(sizes.max()) - 1).bit_length()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [pickle.loads(bytes(row[:size])) for row, size in zip(rows, sizes, strict=True)]


def gather_rows(array: np.ndarray) -> np.ndarray:
    """Every process's `array` concatenated on the first axis, in process order (the global
    batch the processes' local rows make, as the Trainer's mesh lays them out). The shapes must
    agree on every process."""
    if jax.process_count() == 1:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(array), tiled=True))


def own_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """This process's `rows` of a global first axis `gather_rows` built."""
    start = jax.process_index() * rows
    return array[start:start + rows]


def local_copy(tree: Any) -> Any:
    """`tree` with every array this process holds only part of the addressing for replaced by a
    whole copy on this process: a replicated array by its copy on this process's first device
    (no collective), an array split across processes (a sharded mesh over several hosts) by its
    gathered value on the host, which every process must then ask for together. What a
    per-process engine serves, or a host write saves."""

    def local(leaf):
        if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
            return leaf
        if leaf.is_fully_replicated:
            return leaf.addressable_data(0)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))

    return jax.tree.map(local, tree)


def raise_together(error: BaseException | None, what: str) -> None:
    """Raise on every process when any process has an error: its own `error`, or a
    RuntimeError naming the processes that failed `what`. Every process must call it."""
    failed = [i for i, bad in enumerate(every_process(error is not None)) if bad]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on process{'es' if len(failed) > 1 else ''} "
                           f"{', '.join(map(str, failed))} of {jax.process_count()}; see that process's log")


__all__ = ["Topology", "every_process", "gather_rows", "initialize", "is_primary", "local_copy",
           "own_rows", "raise_together"]
