"""One process's compiled programs, reused when the same program is compiled again.

Tests build many Trainers, samplers and models whose programs are identical (the same tiny model,
objective, shapes and devices): each new `jax.jit` compiles its own copy, and on this CPU
compiling is most of a test's time. This keeps every executable a process compiled in memory,
under JAX's own compilation-cache key (the program without its debug info, the compile options
with the device assignment, the XLA flags, jaxlib's version), and hands it to the next compile of
the same key. Nothing is written to disk or read from another process: a persistent cache shared
between processes crashed workers while loading executables (conftest.py). Programs with host
callbacks are compiled each time (their callbacks are baked into the executable).

JAX's compiler module is private; where a release moves what this wraps, `install` leaves it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Stats:
    compiled: int = 0
    reused: int = 0
    seconds_compiling: float = 0.0
    seconds_saved: float = 0.0
    executables: dict[str, tuple[Any, float]] = field(default_factory=dict)


STATS = Stats()


def install() -> bool:
    """Route JAX's compiles through the in-memory cache; False where JAX's internals moved."""
    try:
        from jax._src import cache_key, compiler
    except ImportError:
        return False
    original = getattr(compiler, "backend_compile_and_load", None)
    if original is None or not hasattr(cache_key, "get"):
        return False
    if getattr(original, "program_cache", False):  # installed already
        return True

    def backend_compile_and_load(backend, module, executable_devices, options, host_callbacks, *args, **kwargs):
        if host_callbacks or args or kwargs:
            return original(backend, module, executable_devices, options, host_callbacks, *args, **kwargs)
        devices = list(executable_devices)
        key = cache_key.get(module, np.asarray(devices, dtype=object), options, backend) + repr(
            [device.id for device in devices])
        hit = STATS.executables.get(key)
        if hit is not None:
            STATS.reused += 1
            STATS.seconds_saved += hit[1]
            return hit[0]
        start = time.monotonic()
        executable = original(backend, module, executable_devices, options, host_callbacks)
        seconds = time.monotonic() - start
        STATS.compiled += 1
        STATS.seconds_compiling += seconds
        STATS.executables[key] = (executable, seconds)
        return executable

    backend_compile_and_load.program_cache = True
    compiler.backend_compile_and_load = backend_compile_and_load
    return True


def clear(module: str, log: str | None = None) -> None:
    """Forget every kept executable (at each test module's end: a worker's memory stays bounded),
    first appending to `log` what `module` compiled and reused."""
    global STATS
    if log:
        with open(log, "a") as handle:
            handle.write(f"{module} compiled {STATS.compiled} in {STATS.seconds_compiling:.1f} s, reused "
                         f"{STATS.reused} saving {STATS.seconds_saved:.1f} s\n")
    STATS = Stats()
