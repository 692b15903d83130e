"""Child processes that end with the process that started them, and a free local port for one.

`die_with_parent` arms Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`) in a child, so the
kernel signals it when its parent dies, even by SIGKILL. It is light on purpose (no JAX, no
Prefect): the pipeline's entry points use it before anything heavy is imported.

Not here: starting and stopping children (tasks/lifetimes.py, dew_lib/train/launch.py), sandboxed
programs (dew_lib/sandbox/launcher.py, which uses `setpriv` instead of a preexec function).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def die_with_parent(signal_number: int = signal.SIGTERM):
    """A `preexec_fn` that gives the child the parent-death signal. The kernel sends it when the
    thread that started the child exits, so start children from a thread that lives as long as
    they should (the main thread)."""
    parent = os.getpid()

    def preexec() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, int(signal_number), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal_number)

    return preexec


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


__all__ = ["die_with_parent", "free_port"]
