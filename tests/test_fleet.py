"""SandboxFleet with real programs: every verdict, each limit, cleanup, and the namespace runner's
isolation claims, each shown by a program that tries to break it.

NamespaceRunner tests skip (with the reason) where bubblewrap cannot run; `make test` installs it.
"""

import ast
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from dew_lib.sandbox import (
    NamespaceRunner,
    ProcessRunner,
    Program,
    SandboxFleet,
    SandboxLimits,
    SandboxUnavailable,
    Verdict,
    launcher,
    namespace,
)

PARENT = os.path.join(os.path.dirname(__file__), "sandbox_parent.py")
FAST = SandboxLimits(wall_seconds=5, cpu_seconds=5, memory_bytes=256 << 20, max_output_bytes=4096,
                     max_processes=16)


@pytest.fixture(scope="module")
def namespace_runner():
    try:
        return NamespaceRunner()
    except SandboxUnavailable as error:
        pytest.skip(f"NamespaceRunner cannot run here: {error}")


@pytest.fixture(params=["process", "namespace"])
def runner(request):
    if request.param == "process":
        return ProcessRunner()
    return request.getfixturevalue("namespace_runner")


def python(source, *args, stdin=""):
    return Program(files={"main.py": source}, argv=("python3", "main.py", *args), stdin=stdin)


def run(runner, program, **limits):
    return runner.run(program, SandboxLimits(**{**FAST.__dict__, **limits}))


def marked(marker):
    """Live (non-zombie) processes whose command line has `marker` as an argument."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in args and state not in "ZX":
            found.append(int(pid))
    return found


def gone(marker, seconds=2.0):
    """Wait until no process carries `marker`; True when none is left."""
    deadline = time.monotonic() + seconds
    while marked(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


# Each verdict, through both local runners.

def test_completed_reads_stdin_and_writes_both_streams(runner):
    out = run(runner, python("import sys\nx = sys.stdin.read()\nprint(x.upper())\nprint('note', file=sys.stderr)",
                             stdin="abc"))
    assert (out.verdict, out.exit_code, out.stdout, out.stderr) == (Verdict.COMPLETED, 0, "ABC\n", "note\n")
    assert out.detail == "exit 0" and 0 < out.seconds < 5


def test_failed_keeps_the_exit_code(runner):
    out = run(runner, python("import sys; print('partial'); sys.exit(3)"))
    assert (out.verdict, out.exit_code, out.stdout, out.detail) == (Verdict.FAILED, 3, "partial\n", "exit 3")


def test_missing_command_is_a_failed_program(runner):
    out = run(runner, Program(argv=("no-such-command-here",)))
    assert out.verdict is Verdict.FAILED and "no-such-command-here" in out.stderr


def test_timeout_kills_at_the_wall_deadline(runner):
    out = run(runner, python("import time\nprint('started', flush=True)\ntime.sleep(60)"), wall_seconds=1)
    assert (out.verdict, out.exit_code, out.stdout) == (Verdict.TIMEOUT, -9, "started\n")
    assert out.detail == "killed at the 1 s wall deadline"
    assert 1 <= out.seconds < 3


def test_cpu_time_limit_is_a_timeout(runner):
    out = run(runner, python("while True: pass"), cpu_seconds=1, wall_seconds=10)
    assert (out.verdict, out.exit_code) == (Verdict.TIMEOUT, -signal.SIGXCPU)
    assert "CPU-time limit" in out.detail and out.seconds < 5


def test_crashed_on_a_signal(runner):
    out = run(runner, python("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"))
    assert (out.verdict, out.exit_code, out.detail) == (Verdict.CRASHED, -signal.SIGSEGV, "killed by SIGSEGV")


def test_output_flood_is_cut_at_the_limit(runner):
    out = run(runner, python("import sys\nwhile True: sys.stdout.write('x' * 1000)"), max_output_bytes=10_000)
    assert (out.verdict, out.exit_code) == (Verdict.OUTPUT_LIMIT, -9)
    assert out.stdout == "x" * 10_000 and out.stderr == ""
    assert out.seconds < 3


def test_output_limit_counts_both_streams(runner):
    source = "import sys\nsys.stdout.write('o' * 600); sys.stdout.flush()\nsys.stderr.write('e' * 600)"
    out = run(runner, python(source), max_output_bytes=1000)
    assert out.verdict is Verdict.OUTPUT_LIMIT
    assert out.stdout == "o" * 600 and out.stderr == "e" * 400


def test_memory_hog_is_stopped(runner):
    source = "chunks = []\nwhile True: chunks.append(bytearray(32 << 20))"
    out = run(runner, python(source), memory_bytes=256 << 20)
    assert (out.verdict, out.exit_code) == (Verdict.FAILED, 1)
    assert "MemoryError" in out.stderr and out.seconds < 3


def test_large_stdin_and_output_do_not_deadlock(runner):
    data = "y" * 3_000_000  # far beyond a pipe's buffer, both ways
    out = run(runner, python("import sys\nsys.stdout.write(sys.stdin.read())", stdin=data),
              max_output_bytes=4_000_000)
    assert out.verdict is Verdict.COMPLETED and out.stdout == data


def test_environment_is_minimal(runner):
    out = run(runner, python("import os; print(sorted(os.environ))"))
    extra = ["TMPDIR"] if isinstance(runner, ProcessRunner) else ["PWD"]  # bwrap's --chdir sets PWD
    expected = sorted(["HOME", "LANG", "LC_ALL", "PATH", *extra])
    assert out.stdout == f"{expected}\n"


def test_files_are_written_into_the_job_directory(runner):
    program = Program(files={"main.py": "print(open('data/input.txt').read())", "data/input.txt": b"42"},
                      argv=("python3", "main.py"))
    assert run(runner, program).stdout == "42\n"


# Nothing outlives a run.

def test_forked_child_dies_at_the_timeout_process_runner():
    source = "import os, time\npid = os.fork()\nif pid: print(pid, flush=True)\ntime.sleep(60)"
    out = run(ProcessRunner(), python(source), wall_seconds=1)
    child = int(out.stdout)
    assert out.verdict is Verdict.TIMEOUT
    deadline = time.monotonic() + 2
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(child), f"forked child {child} outlived the deadline"


def test_background_child_dies_when_the_program_exits_process_runner():
    source = "import os, time\npid = os.fork()\nif pid: print(pid)\nelse: time.sleep(60)"
    out = run(ProcessRunner(), python(source))
    child = int(out.stdout)
    assert out.verdict is Verdict.COMPLETED and out.seconds < 3
    deadline = time.monotonic() + 2
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(child)


@pytest.mark.parametrize("main_waits", [True, False], ids=["hang", "exit"])
def test_namespace_program_cannot_outlive_its_deadline(namespace_runner, main_waits):
    # A double-forked, setsid daemon: out of the process group, reparented, still caught.
    marker = f"dew-marker-{uuid.uuid4().hex}"
    source = ("import os, time\n"
              "if os.fork() == 0:\n"
              "    os.setsid()\n"
              "    if os.fork() == 0:\n"
              "        time.sleep(60)\n"
              "    os._exit(0)\n"
              f"time.sleep({60 if main_waits else 0.2})\n")
    out = run(namespace_runner, python(source, marker), wall_seconds=1.5)
    assert out.verdict is (Verdict.TIMEOUT if main_waits else Verdict.COMPLETED)
    assert gone(marker), f"processes {marked(marker)} outlived the sandbox"


def test_namespace_fork_storm_is_contained(namespace_runner):
    marker = f"dew-marker-{uuid.uuid4().hex}"
    # At most 300 attempts, so a broken limit cannot take the machine down.
    source = ("import os, time\ncount = 0\n"
              "for _ in range(300):\n"
              "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
              "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
              "    count += 1\n"
              "print(count)\n")
    out = run(namespace_runner, python(source, marker), max_processes=16)
    assert out.verdict is Verdict.COMPLETED
    assert 0 < int(out.stdout) < 16
    assert gone(marker)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["process", "namespace"])
def test_programs_die_when_the_parent_is_sigkilled(kind, request):
    # The process runner's promise is the program itself (its forked children survive, which
    # docs/sandbox.md says); in a namespace every process of the program dies.
    if kind == "namespace":
        request.getfixturevalue("namespace_runner")
    marker = f"dew-marker-{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    parent = subprocess.Popen([sys.executable, PARENT, kind, marker], stdout=subprocess.PIPE, env=env, text=True)

    def sandboxed():
        return [p for p in marked(marker) if p != parent.pid]

    try:
        assert parent.stdout.readline().strip() == "submitted"
        deadline = time.monotonic() + 30
        while len(sandboxed()) < 4:  # two programs and their two children, at least
            assert time.monotonic() < deadline, "the programs never started"
            time.sleep(0.05)
        leaders = [p for p in sandboxed() if _parent_of(p) == parent.pid]
        assert len(leaders) == 2
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 2
        while any(alive(p) for p in leaders) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p in leaders if alive(p)], "a program outlived its parent"
        if kind == "namespace":  # the kernel ends the namespace's processes; on a busy machine
            # their exits can take seconds to be scheduled, while a leak would last for ever
            assert gone(marker, seconds=15), f"{marked(marker)} survived the parent"
    finally:
        parent.kill()
        parent.wait()
        for pid in marked(marker):  # the process runner's forked children, left by design
            os.kill(pid, signal.SIGKILL)


def _parent_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


# The namespace runner's isolation claims, each next to the process runner as a control that
# shows the program really tries.

@pytest.fixture
def server():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    yield listener
    listener.close()


CONNECT = ("import socket, sys\n"
           "try:\n    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2)\n"
           "    print('connected')\n"
           "except OSError as e:\n    print('refused', e.errno)\n")


def test_namespace_cannot_reach_a_server_on_localhost(namespace_runner, server):
    port = server.getsockname()[1]
    assert run(ProcessRunner(), python(CONNECT, str(port))).stdout == "connected\n"
    server.accept()[0].close()
    out = run(namespace_runner, python(CONNECT, str(port)))
    assert out.stdout.startswith("refused")
    with pytest.raises(BlockingIOError):
        server.accept()


def test_namespace_cannot_write_outside_its_directory(namespace_runner, tmp_path):
    targets = [str(tmp_path / "escape.txt"), "/usr/escape.txt", "/etc/escape.txt", "/escape.txt",
               "/dev/escape.txt"]
    source = ("import sys\n"
              "for path in sys.argv[1:] + ['/work/ok.txt', '/tmp/ok.txt']:\n"
              "    try:\n        open(path, 'w').write('x'); print('wrote', path)\n"
              "    except OSError as e:\n        print('denied', path)\n")
    out = run(namespace_runner, python(source, *targets))
    assert out.stdout.splitlines() == [f"denied {t}" for t in targets] + ["wrote /work/ok.txt", "wrote /tmp/ok.txt"]
    for target in targets:
        assert not os.path.exists(target)
    assert run(ProcessRunner(), python(source, targets[0])).stdout.startswith(f"wrote {targets[0]}")
    assert os.path.exists(targets[0])  # the control could


def test_namespace_cannot_read_the_parents_files(namespace_runner, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    paths = [str(secret), os.path.abspath(__file__), os.path.expanduser("~/.bash_history"), "/etc/shadow"]
    source = ("import sys\n"
              "for path in sys.argv[1:]:\n"
              "    try:\n        print('read', path, open(path).read()[:20])\n"
              "    except OSError as e:\n        print('denied', path)\n")
    out = run(namespace_runner, python(source, *paths))
    assert out.stdout.splitlines() == [f"denied {p}" for p in paths]
    assert "hunter2" in run(ProcessRunner(), python(source, str(secret))).stdout  # the control could


def test_namespace_sees_only_its_own_processes(namespace_runner):
    out = run(namespace_runner, python("import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"))
    assert len(ast.literal_eval(out.stdout)) <= 3  # bwrap's init, the program, nothing of the host


# Fleet behaviour.

def test_fleet_runs_programs_at_once_and_keeps_order(tmp_path):
    # Each program waits for the other's file: only two at once can finish.
    source = ("import os, sys, time\nmine, other = sys.argv[1:]\nopen(mine, 'w').close()\n"
              "while not os.path.exists(other): time.sleep(0.01)\nprint(os.path.basename(mine))")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with SandboxFleet(ProcessRunner(), limits=SandboxLimits(wall_seconds=5), workers=2) as fleet:
        outcomes = fleet.map([python(source, a, b), python(source, b, a)])
    assert [o.stdout for o in outcomes] == ["a\n", "b\n"]
    os.remove(a), os.remove(b)
    with SandboxFleet(ProcessRunner(), limits=SandboxLimits(wall_seconds=1), workers=1) as fleet:
        outcomes = fleet.map([python(source, a, b), python(source, b, a)])
    assert outcomes[0].verdict is Verdict.TIMEOUT  # one worker: the first waits alone


def test_fleet_refuses_after_close_and_bad_arguments():
    fleet = SandboxFleet(ProcessRunner(), workers=1)
    assert fleet.run(python("print(1)")).stdout == "1\n"
    fleet.close()
    with pytest.raises(RuntimeError, match="closed"):
        fleet.submit(python("print(1)"))
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        SandboxFleet(ProcessRunner(), workers=0)
    with pytest.raises(ValueError, match="run\\(program, limits\\)"):
        SandboxFleet(object())
    assert SandboxFleet(ProcessRunner()).workers == (os.cpu_count() or 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(wall_seconds=0), "wall_seconds must be a positive number"),
    (dict(wall_seconds=float("inf")), "wall_seconds must be a positive number"),
    (dict(cpu_seconds=1.5), "cpu_seconds must be an integer >= 1, got 1.5"),
    (dict(memory_bytes=1000), "memory_bytes must be an integer >= 1048576"),
    (dict(max_processes=0), "max_processes must be an integer >= 1, got 0"),
    (dict(max_output_bytes=True), "max_output_bytes must be an integer"),
])
def test_limits_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SandboxLimits(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(argv=()), "argv must be a non-empty sequence"),
    (dict(argv="python3 main.py"), "argv must be a non-empty sequence of strings \\(no shell\\)"),
    (dict(argv=("true",), files={"/etc/passwd": "x"}), "must be a relative path"),
    (dict(argv=("true",), files={"../up.py": "x"}), "must be a relative path"),
    (dict(argv=("true",), files={"a.py": 3}), "must be str or bytes"),
])
def test_program_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Program(**kwargs)


def test_missing_bubblewrap_is_reported(monkeypatch):
    real = launcher.shutil.which

    def which(name, path=None):
        return None if name == "bwrap" else real(name, path=path)

    monkeypatch.setattr(launcher.shutil, "which", which)
    with pytest.raises(SandboxUnavailable, match="bwrap was not found on PATH; install the bubblewrap package"):
        NamespaceRunner()


def test_namespace_refuses_a_read_only_path_over_the_job_directory():
    with pytest.raises(ValueError, match="would cover the job directory /work"):
        NamespaceRunner(read_only=["/work/venv"])
    with pytest.raises(ValueError, match="does not exist"):
        NamespaceRunner(read_only=["/no/such/path"])


def test_namespace_bwrap_command_line(namespace_runner):
    argv = namespace_runner.bwrap_argv("/tmp/job")
    for flag in ("--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"):
        assert flag in argv
    assert argv[argv.index("--bind") + 1:argv.index("--bind") + 3] == ["/tmp/job", namespace.WORKDIR]
    assert argv[-2:] == ["--remount-ro", "/"]
