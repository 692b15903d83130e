"""ContainerRunner: the exact container it asks Docker for, its handling of the attach stream
against a fake engine, and real containers where `docker info` answers.
"""

import os
import shutil
import socket
import subprocess
import threading

import pytest
from docker.types import LogConfig, Ulimit

from dew_lib.sandbox import ContainerRunner, Program, SandboxLimits, Verdict
from dew_lib.sandbox.container import WORKDIR

LIMITS = SandboxLimits(wall_seconds=1, cpu_seconds=3, memory_bytes=128 << 20, max_output_bytes=1000,
                       max_file_bytes=1 << 20, max_processes=32)


class FakeContainer:
    """Speaks Docker's multiplexed attach stream over a socketpair, as `behave` says."""

    def __init__(self, engine, kwargs):
        self.engine, self.kwargs, self.name = engine, kwargs, kwargs["name"]
        self.status = None
        self.done = threading.Event()
        self.attrs = {"State": {"OOMKilled": False}}

    def attach_socket(self, params):
        assert params == {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        self.engine_side, runner_side = socket.socketpair()
        return runner_side

    def start(self):
        threading.Thread(target=self.engine.behave, args=(self,), daemon=True).start()

    def send(self, stream, payload):
        self.engine_side.sendall(bytes([stream, 0, 0, 0]) + len(payload).to_bytes(4, "big") + payload)

    def finish(self, status):
        self.status = status
        self.engine_side.close()
        self.done.set()

    def wait(self, timeout):
        assert self.done.wait(timeout)
        return {"StatusCode": self.status, "Error": None}

    def reload(self):
        pass

    def remove(self, force):
        assert force
        self.engine.removed.append(self.name)


class FakeEngine:
    def __init__(self, behave):
        self.behave = behave
        self.created, self.killed, self.removed = [], [], []
        self.containers = self
        self.api = self

    def create(self, **kwargs):
        container = FakeContainer(self, kwargs)
        self.created.append(container)
        return container

    def kill(self, name):
        self.killed.append(name)
        container = next(c for c in self.created if c.name == name)
        if not container.done.is_set():
            container.finish(137)


def read_stdin(container):
    data = b""
    while chunk := container.engine_side.recv(65536):
        data += chunk
    return data


def run(behave, program=Program(argv=("python3", "main.py")), limits=LIMITS):
    engine = FakeEngine(behave)
    outcome = ContainerRunner("python:3.12-slim", client=engine).run(program, limits)
    return outcome, engine


def test_container_configuration_is_exactly_the_isolated_one():
    engine = FakeEngine(lambda c: c.finish(0))
    runner = ContainerRunner("python:3.12-slim", client=engine, cpu_shares=256, tmp_bytes=8 << 20)
    runner.run(Program(files={"main.py": "print(1)"}, argv=("python3", "main.py")), LIMITS)
    (container,) = engine.created
    config = dict(container.kwargs)
    name, volumes = config.pop("name"), config.pop("volumes")
    assert name.startswith("dew-sandbox-") and engine.removed == [name]
    (job,) = volumes
    assert volumes[job] == {"bind": WORKDIR, "mode": "ro"}
    assert config == dict(
        image="python:3.12-slim", command=["python3", "main.py"], user="65534:65534", working_dir="/work",
        environment={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
                     "LC_ALL": "C.UTF-8"},
        network_mode="none", read_only=True, tmpfs={"/tmp": f"rw,nosuid,nodev,size={8 << 20}"},
        cap_drop=["ALL"], security_opt=["no-new-privileges"], mem_limit=128 << 20,
        memswap_limit=128 << 20, cpu_shares=256, pids_limit=32,
        ulimits=[Ulimit(name="cpu", soft=3, hard=4), Ulimit(name="core", soft=0, hard=0),
                 Ulimit(name="fsize", soft=1 << 20, hard=1 << 20)],
        stdin_open=True, tty=False, init=True, log_config=LogConfig(type="none"), labels={"dew.sandbox": "1"})


def test_other_runtime_is_passed_to_docker():
    engine = FakeEngine(lambda c: c.finish(0))
    ContainerRunner("img", runtime="runsc", client=engine).run(Program(argv=("true",)), LIMITS)
    assert engine.created[0].kwargs["runtime"] == "runsc"
    engine = FakeEngine(lambda c: c.finish(0))
    ContainerRunner("img", client=engine).run(Program(argv=("true",)), LIMITS)
    assert "runtime" not in engine.created[0].kwargs


def test_stdin_goes_in_and_both_streams_come_out():
    def echo(container):
        data = read_stdin(container)
        container.send(1, data.upper())
        container.send(2, b"note\n")
        container.finish(0)

    big = SandboxLimits(**{**LIMITS.__dict__, "max_output_bytes": 1 << 20})
    out, engine = run(echo, Program(argv=("cat",), stdin="abc" * 50_000), big)
    assert (out.verdict, out.exit_code, out.stdout, out.stderr) == (Verdict.COMPLETED, 0, "ABC" * 50_000, "note\n")
    assert engine.killed == [] and len(engine.removed) == 1


@pytest.mark.parametrize("status, verdict, code, detail", [
    (3, Verdict.FAILED, 3, "exit 3"),
    (139, Verdict.CRASHED, -11, "killed by SIGSEGV"),
    (128 + 24, Verdict.TIMEOUT, -24, "stopped by its CPU-time limit (SIGXCPU)"),
])
def test_exit_status_becomes_the_verdict(status, verdict, code, detail):
    out, _ = run(lambda c: c.finish(status))
    assert (out.verdict, out.exit_code, out.detail) == (verdict, code, detail)


def test_out_of_memory_kill_says_so():
    def oom(container):
        container.attrs["State"]["OOMKilled"] = True
        container.finish(137)

    out, _ = run(oom)
    assert (out.verdict, out.detail) == (Verdict.CRASHED, "killed by SIGKILL (out of memory)")


def test_deadline_kills_the_container_by_name():
    def hang(container):
        container.send(1, b"started\n")

    out, engine = run(hang)
    assert (out.verdict, out.exit_code, out.stdout) == (Verdict.TIMEOUT, -9, "started\n")
    assert engine.killed == [engine.created[0].name] == engine.removed
    assert 1 <= out.seconds < 3


def test_output_flood_is_cut_and_killed():
    def flood(container):
        try:
            while not container.done.is_set():
                container.send(1, b"x" * 300)
        except OSError:
            pass

    out, engine = run(flood)
    assert (out.verdict, out.stdout) == (Verdict.OUTPUT_LIMIT, "x" * 1000)
    assert engine.killed == [engine.created[0].name]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="image must name an image"):
        ContainerRunner("", client=FakeEngine(None))
    with pytest.raises(ValueError, match="cpu_shares must be an integer >= 2"):
        ContainerRunner("img", client=FakeEngine(None), cpu_shares=0)


# Real containers, where an engine answers. DEW_SANDBOX_IMAGE names another image with python3.
IMAGE = os.environ.get("DEW_SANDBOX_IMAGE", "python:3.12-slim")


def _docker_reason():
    if shutil.which("docker") is None:
        return "no docker command"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return f"docker info failed: {lines[-1] if lines else f'exit {info.returncode}'}"
    image = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=30)
    if image.returncode != 0:
        return f"image {IMAGE} is not present (nothing is pulled; DEW_SANDBOX_IMAGE names another)"
    return None


@pytest.fixture(scope="module")
def docker_runner():
    reason = _docker_reason()
    if reason:
        pytest.skip(reason)
    return ContainerRunner(IMAGE)


def test_real_container_has_no_network_and_a_read_only_mount(docker_runner):
    source = ("import socket\n"
              "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2); print('network')\n"
              "except OSError:\n    print('no network')\n"
              "for path in ('/work/x', '/x', '/tmp/x'):\n"
              "    try:\n        open(path, 'w').write('x'); print('wrote', path)\n"
              "    except OSError:\n        print('denied', path)\n")
    out = docker_runner.run(Program(files={"main.py": source}, argv=("python3", "main.py")), SandboxLimits())
    assert out.verdict is Verdict.COMPLETED, out
    assert out.stdout.splitlines() == ["no network", "denied /work/x", "denied /x", "wrote /tmp/x"]


def test_real_container_is_killed_at_the_deadline(docker_runner):
    out = docker_runner.run(Program(argv=("sleep", "60")), SandboxLimits(wall_seconds=2))
    assert out.verdict is Verdict.TIMEOUT


@pytest.mark.parametrize("source, verdict, detail", [
    ("import sys; print('partial'); sys.exit(3)", Verdict.FAILED, "exit 3"),
    ("while True: pass", Verdict.TIMEOUT, "stopped by its CPU-time limit (SIGXCPU)"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", Verdict.CRASHED, "killed by SIGSEGV"),
    ("import sys\nwhile True: sys.stdout.write('x' * 1000)", Verdict.OUTPUT_LIMIT,
     "killed after more than 10000 bytes of output"),
    ("chunks = []\nwhile True: chunks.append(bytearray(32 << 20))", Verdict.CRASHED,
     "killed by SIGKILL (out of memory)"),
], ids=["failed", "cpu", "crashed", "flood", "memory"])
def test_real_container_verdicts(docker_runner, source, verdict, detail):
    limits = SandboxLimits(wall_seconds=20, cpu_seconds=1, memory_bytes=128 << 20, max_output_bytes=10_000)
    out = docker_runner.run(Program(files={"main.py": source}, argv=("python3", "main.py")), limits)
    assert (out.verdict, out.detail) == (verdict, detail), out


def test_real_container_contains_a_fork_storm_and_reads_stdin(docker_runner):
    source = ("import os, sys, time\ncount = 0\n"
              "for _ in range(300):\n"
              "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
              "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
              "    count += 1\n"
              "print(count, sys.stdin.read().upper())\n")
    out = docker_runner.run(Program(files={"main.py": source}, argv=("python3", "main.py"), stdin="abc"),
                            SandboxLimits(max_processes=16))
    count, text = out.stdout.split()
    assert out.verdict is Verdict.COMPLETED and 0 < int(count) < 16 and text == "ABC"
