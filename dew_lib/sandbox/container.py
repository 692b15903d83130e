"""ContainerRunner: each program in a fresh, network-less container through the Docker SDK.

Per program it creates a container from `image` with: no network (`network_mode="none"`), a
read-only root filesystem, the job directory bind-mounted read-only at /work as the working
directory, a private size-capped tmpfs at /tmp (the only writable place), all capabilities
dropped, no-new-privileges, an unprivileged user (65534:65534), Docker's init as PID 1, no
log driver, and memory (swap included), CPU-share, process-count (pids), CPU-time, file-size
and no-core-dump limits. Stdin goes in and stdout and stderr come out over the attach socket, which the parent
reads against the wall deadline and the output cap; past either, the container is killed by
name. It is removed afterwards in every case.

`runtime` names the OCI runtime: "docker" keeps the engine's default (runc); any other value,
such as "runsc" (gVisor) or "kata-runtime", is passed to Docker as the container's runtime.

What it does not isolate: with the default runtime the kernel is shared with the host, as with
any container; the image's own files are readable; CPU is shared by weight, not capped. If the
parent is SIGKILLed, nothing stops a running container but its own end or its CPU-time limit (a
sleeping program runs on), and it is left for `docker rm` (label `dew.sandbox=1`). The engine
must see the job directory at the same path (a local engine, or `root=` on a shared mount), and
the image must already be present (nothing is pulled).

Not here: the launcher of the local runners (launcher.py).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
import uuid
from typing import Any

from dew_lib.options import integer
from dew_lib.sandbox.launcher import PATH, Finished, SandboxUnavailable
from dew_lib.sandbox.limits import SandboxLimits
from dew_lib.sandbox.process import outcome_of
from dew_lib.sandbox.program import Outcome, Program, job_directory, signal_status

WORKDIR = "/work"
USER = "65534:65534"
# How long the engine may take to report the exit status once the stream has ended.
WAIT_SECONDS = 30


class ContainerRunner:
    """Run a Program in a fresh container of `image` (see the module docstring).

    runtime: "docker" for the engine's default OCI runtime, or a runtime name to pass on.
    client: a `docker.DockerClient` (default `docker.from_env()`).
    cpu_shares: the container's CPU weight (Docker's default is 1024).
    tmp_bytes: the size of the writable tmpfs at /tmp (default 64 MiB).
    root: where job directories are made on the host (default: the system temporary directory).
    """

    def __init__(self, image: str, runtime: str = "docker", *, client: Any = None,
                 cpu_shares: int = 512, tmp_bytes: int = 64 << 20, root: str | None = None):
        if not isinstance(image, str) or not image:
            raise ValueError(f"ContainerRunner.image must name an image such as 'python:3.12-slim', got {image!r}")
        if not isinstance(runtime, str) or not runtime:
            raise ValueError(f"ContainerRunner.runtime must be 'docker' or an OCI runtime name, got {runtime!r}")
        cpu_shares = integer("ContainerRunner.cpu_shares", cpu_shares, at_least=2)
        tmp_bytes = integer("ContainerRunner.tmp_bytes", tmp_bytes, at_least=1 << 20,
                            accepts="an integer >= 1 MiB")
        if client is None:
            import docker

            try:
                client = docker.from_env()
            except docker.errors.DockerException as error:
                raise SandboxUnavailable(f"no Docker engine to talk to: {error}") from error
        self.image = image
        self.runtime = runtime
        self.client = client
        self.cpu_shares = cpu_shares
        self.tmp_bytes = tmp_bytes
        self.root = root

    def config(self, job: str, name: str, program: Program, limits: SandboxLimits) -> dict[str, Any]:
        """The keyword arguments given to `client.containers.create` for one program."""
        from docker.types import LogConfig, Ulimit

        cpu = limits.cpu_seconds
        config = dict(
            image=self.image,
            command=list(program.argv),
            name=name,
            user=USER,
            working_dir=WORKDIR,
            environment={"PATH": PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
            network_mode="none",
            read_only=True,
            volumes={job: {"bind": WORKDIR, "mode": "ro"}},
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={self.tmp_bytes}"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mem_limit=limits.memory_bytes,
            memswap_limit=limits.memory_bytes,
            cpu_shares=self.cpu_shares,
            pids_limit=limits.max_processes,
            ulimits=[Ulimit(name="cpu", soft=cpu, hard=cpu + 1), Ulimit(name="core", soft=0, hard=0),
                     Ulimit(name="fsize", soft=limits.max_file_bytes, hard=limits.max_file_bytes)],
            stdin_open=True,
            tty=False,
            # A small init (docker-init) as PID 1, so the program is an ordinary process: PID 1
            # ignores signals it has no handler for (SIGXCPU at the CPU limit, a self-sent SIGSEGV).
            init=True,
            # Output comes over the attach socket; no log driver keeps (and writes to disk) a flood.
            log_config=LogConfig(type="none"),
            labels={"dew.sandbox": "1"},
        )
        if self.runtime != "docker":
            config["runtime"] = self.runtime
        return config

    def run(self, program: Program, limits: SandboxLimits) -> Outcome:
        name = f"dew-sandbox-{uuid.uuid4().hex}"
        with job_directory(program, root=self.root, mode=0o755) as job:
            container = self.client.containers.create(**self.config(job, name, program, limits))
            try:
                attached = container.attach_socket(params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
                sock = getattr(attached, "_sock", attached)
                started = time.monotonic()
                container.start()
                cause, out, err, ended = _pump(sock, program.stdin_bytes, deadline=started + limits.wall_seconds,
                                              max_output_bytes=limits.max_output_bytes)
                # End the stream before the kill: the engine finishes a container only once its
                # output is delivered, and nobody would read the rest. shutdown, because close
                # alone leaves the connection open while the SDK's file object holds it.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                for stream in (attached, sock):
                    with contextlib.suppress(OSError):
                        stream.close()
                if cause != "exit":
                    self.client.api.kill(name)  # by name: the deadline or the cap is past
                status = container.wait(timeout=WAIT_SECONDS)
                code = signal_status(int(status["StatusCode"])) if cause == "exit" else -9
                oom = False
                if cause == "exit" and code < 0:
                    container.reload()
                    oom = bool(container.attrs.get("State", {}).get("OOMKilled"))
            finally:
                container.remove(force=True)
        outcome = outcome_of(Finished(code, cause, out, err, (ended or time.monotonic()) - started), limits)
        if oom:
            outcome = Outcome(outcome.verdict, outcome.exit_code, outcome.stdout, outcome.stderr,
                              outcome.seconds, outcome.detail + " (out of memory)")
        return outcome

    def __repr__(self):
        return f"ContainerRunner({self.image!r}, runtime={self.runtime!r})"


def _pump(sock: socket.socket, stdin: bytes, *, deadline: float,
          max_output_bytes: int) -> tuple[str, bytes, bytes, float | None]:
    """Send stdin and demultiplex Docker's attach stream until it ends, the deadline or the cap.

    Frames are an 8-byte header (stream 1 = stdout, 2 = stderr; a big-endian uint32 length) and
    the payload. Returns the cause ("exit", "deadline", "output"), stdout, stderr and the time
    the stream ended.
    """
    sock.setblocking(False)
    output = {1: bytearray(), 2: bytearray()}
    total = 0
    buffer = bytearray()
    pending = memoryview(stdin)
    selector = selectors.DefaultSelector()
    events = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
    if not pending:
        _close_stdin(sock)
    selector.register(sock, events)
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                return "deadline", bytes(output[1]), bytes(output[2]), None
            for _, mask in selector.select(deadline - now):
                if mask & selectors.EVENT_WRITE and pending:
                    try:
                        pending = pending[sock.send(pending[:1 << 16]):]
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        pending = pending[:0]
                    if not pending:
                        _close_stdin(sock)
                        selector.modify(sock, selectors.EVENT_READ)
                if mask & selectors.EVENT_READ:
                    try:
                        data = sock.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    except ConnectionResetError:
                        data = b""
                    if not data:
                        return "exit", bytes(output[1]), bytes(output[2]), time.monotonic()
                    buffer += data
                    while len(buffer) >= 8:
                        size = int.from_bytes(buffer[4:8], "big")
                        if len(buffer) < 8 + size:
                            break
                        stream, payload = buffer[0], bytes(buffer[8:8 + size])
                        del buffer[:8 + size]
                        room = max_output_bytes - total
                        output[2 if stream == 2 else 1] += payload[:max(0, room)]
                        total += len(payload)
                        if total > max_output_bytes:
                            return "output", bytes(output[1]), bytes(output[2]), None
    finally:
        selector.close()


def _close_stdin(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
