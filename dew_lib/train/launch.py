"""`dew launch`: run one command as an N-process JAX job on this host, and end it as one job.

Each process gets DEW_COORDINATOR (a free local port), DEW_PROCESSES, DEW_PROCESS_ID and, when
given, DEW_LOCAL_DEVICES, which `distributed.initialize()` reads. Every line a process prints
comes out prefixed with `[i] `. The launcher returns 0 when every process exits 0; as soon as one
fails (an exit code, a signal such as SIGKILL) it ends the others and returns that process's code
(128 + the signal for a signal), so a dead process never leaves the rest waiting in a collective.
Each process runs in its own process group with the parent-death signal, so killing the launcher,
even with SIGKILL, ends the job; SIGTERM and SIGINT to the launcher are passed on.

On several hosts, start the same command on each host with the variables set by hand (see
docs/distributed.md); a dead process is then noticed by the others' heartbeat timeout.

Not here: joining the job from inside a process (distributed.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from dew_lib.children import die_with_parent, free_port
from dew_lib.train import topology

GRACE_SECONDS = 10.0  # from SIGTERM to SIGKILL when the job ends early
# util-linux's setpriv arms the parent-death signal before it runs the command. Without a
# preexec function the child is started without fork(), which a parent that has JAX's threads
# running (a pipeline task) must avoid; where setpriv is missing, a preexec function arms it.
SETPRIV = shutil.which("setpriv")


def _bound(command: Sequence[str]) -> list[str]:
    return [SETPRIV, "--pdeathsig", "TERM", "--", *command] if SETPRIV else list(command)


def process_env(index: int, processes: int, coordinator: str, local_devices: int | None,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of process `index`: `base` (default: this one's) plus the job's variables."""
    env = dict(os.environ if base is None else base)
    env.update({topology.COORDINATOR: coordinator, topology.PROCESSES: str(processes),
                topology.PROCESS_ID: str(index)})
    if local_devices is not None:
        env[topology.LOCAL_DEVICES] = str(local_devices)
    else:
        env.pop(topology.LOCAL_DEVICES, None)
    return env


def _relay(stream, index: int, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(f"[{index}] {line.decode(errors='replace')}")
            out.flush()
    stream.close()


def _end(children: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live child's group, then SIGKILL what is left after `grace` seconds."""
    for signal_number, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for child in children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal_number)
        deadline = time.monotonic() + wait
        while any(c.poll() is None for c in children) and time.monotonic() < deadline:
            time.sleep(0.05)


def _code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def launch(command: Sequence[str], processes: int, *, local_devices: int | None = None,
           env: Mapping[str, str] | None = None, cwd: str | None = None, out: TextIO | None = None,
           grace: float = GRACE_SECONDS) -> int:
    """Run `command` as `processes` processes of one job; their exit code (see the module).

    local_devices: host devices per process on CPU (DEW_LOCAL_DEVICES). env: the processes'
    base environment (default: this one's). out: where prefixed lines go (default stdout).
    """
    if processes < 1:
        raise ValueError(f"launch needs processes >= 1, got {processes}")
    if not command:
        raise ValueError("launch needs a command, e.g. dew launch --processes 2 -- python train.py")
    out = sys.stdout if out is None else out
    coordinator = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()
    children: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    previous = {}

    def forward(signal_number, _frame):
        for child in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal_number)

    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for index in range(processes):
            environment = process_env(index, processes, coordinator, local_devices, env)
            armed = None if SETPRIV else die_with_parent()
            child = subprocess.Popen(_bound(command), env=environment, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=armed)
            children.append(child)
            relay = threading.Thread(target=_relay, args=(child.stdout, index, out, lock), daemon=True)
            relay.start()
            relays.append(relay)
        failed = None
        while failed is None and any(c.poll() is None for c in children):
            failed = next((c for c in children if c.poll() not in (None, 0)), None)
            time.sleep(0.05)
        failed = failed or next((c for c in children if c.returncode != 0), None)
        if failed is not None:
            index = children.index(failed)
            _end(children, grace)
            with lock:
                out.write(f"dew launch: process {index} exited with {_describe(failed.returncode)}; "
                          f"ended the other {processes - 1}\n")
                out.flush()
        for relay in relays:
            relay.join(timeout=5)
        return 0 if failed is None else _code(failed.returncode)
    finally:
        _end(children, 0.0 if sys.exc_info()[0] is not None else grace)
        for signal_number, handler in previous.items():
            signal.signal(signal_number, handler)


def _describe(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
        return f"signal {-returncode}"
    return f"code {returncode}"


__all__ = ["launch", "process_env"]
