"""Nothing the project starts outlives its parent (tasks/lifetimes.py), checked with real
processes and real signals: the helper itself, `python -m flows` killed with SIGKILL once its
Prefect server runs, and `make ui` (deployments/ui.py) stopped with SIGTERM, killed with SIGKILL,
or losing its server. The processes each test starts are recorded from /proc before the signal
(pid and start time, so a reused pid is not mistaken for one of them), and whatever is still
alive at the end is killed.
"""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


def stat(pid: int):
    """(ppid, state, start time) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], int(fields[19])


def command_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def environment_of(pid: int) -> dict:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        pairs = [item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def descendants(pid: int) -> list[tuple[int, int, str]]:
    """(pid, start time, command) of every living descendant of `pid`."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (info := stat(int(name))) is not None and info[1] != "Z":
            parents[int(name)] = info
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _, started) in parents.items():
            if ppid == parent:
                found.append((child, started, command_of(child)))
                frontier.append(child)
    return found


def alive(process: tuple[int, int, str]) -> bool:
    info = stat(process[0])
    return info is not None and info[1] != "Z" and info[2] == process[1]


def kill_left(processes) -> None:
    for process in processes:
        if alive(process):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process[0], signal.SIGKILL)


def wait_for(predicate, seconds: float, what: str, log_path=None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    tail = open(log_path).read()[-4000:] if log_path else ""
    raise AssertionError(f"{what} did not happen within {seconds} s\n{tail}")


def gone_within(processes, seconds: float, what: str, log_path=None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(map(alive, processes)):
        time.sleep(0.25)
    left = [p for p in processes if alive(p)]
    tail = open(log_path).read()[-4000:] if log_path else ""
    assert not left, f"{what}: still alive after {seconds} s: {left}\n{tail}"


def clean_env(**changes) -> dict:
    """This environment without Prefect's settings (the test harness's API must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DO_NOT_TRACK"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **changes)
    return env


def started(command, env, log):
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def end(process) -> None:
    if process is not None and process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


# -- the helper ---------------------------------------------------------------------------------

PARENT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from tasks.lifetimes import bound_child
    child = bound_child([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
""")

WATCHED = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from tasks.lifetimes import EXIT_WITH, exit_with_marked_parent
    armed = exit_with_marked_parent() is not None
    print("watching" if armed and EXIT_WITH not in os.environ else "not watching", flush=True)
    time.sleep(600)
""")
MARKING = ("import subprocess, sys; sys.path.insert(0, sys.argv[2]); "
           "from tasks.lifetimes import children_exit_with_me; children_exit_with_me(); "
           "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], stdout=sys.stdout); "
           "print(p.pid, flush=True); p.wait()")


def test_a_bound_child_dies_with_its_parent_killed_by_sigkill():
    parent = subprocess.Popen([PYTHON, "-c", PARENT, ROOT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child_pid = int(parent.stdout.readline())
        child = (child_pid, stat(child_pid)[2], command_of(child_pid))
        assert stat(child_pid)[0] == parent.pid and os.getpgid(child_pid) == child_pid  # its own group
        parent.kill()
        parent.wait(timeout=30)
        gone_within([child], 10, "the child of a killed parent")
    finally:
        parent.kill()
        parent.wait(timeout=30)
        kill_left([child] if child else [])


def test_a_child_of_a_marking_parent_exits_when_the_parent_is_killed():
    """children_exit_with_me / exit_with_marked_parent: how serve.py's flow runs (started by
    Prefect's runner) end with it, and serve.py with `make ui`."""
    middle = subprocess.Popen([PYTHON, "-c", MARKING, WATCHED, ROOT], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child_pid = int(middle.stdout.readline())
        child = (child_pid, stat(child_pid)[2], command_of(child_pid))
        assert middle.stdout.readline().strip() == "watching"
        middle.kill()
        middle.wait(timeout=30)
        gone_within([child], 10, "a watched process whose parent was killed")
    finally:
        middle.kill()
        middle.wait(timeout=30)
        kill_left([child] if child else [])


# -- python -m flows ---------------------------------------------------------------------------

@pytest.mark.slow
def test_python_m_flows_killed_with_sigkill_leaves_no_process_behind(tmp_path):
    log_path = tmp_path / "flows.log"
    env = clean_env(PREFECT_HOME=str(tmp_path / "prefect"))
    process, recorded = None, []
    with open(log_path, "w") as log:
        try:
            process = started([PYTHON, "-m", "flows", "--root", str(tmp_path / "runs"), "--name", "killed"],
                              env, log)
            # the flow run begins once its (temporary) server answers
            wait_for(lambda: "Beginning flow run" in log_path.read_text() or process.poll() is not None,
                     300, "the pipeline's flow run beginning", log_path)
            assert process.poll() is None, log_path.read_text()[-4000:]
            recorded = descendants(process.pid)
            servers = [p for p in recorded if "uvicorn" in p[2] or "prefect" in p[2]]
            assert servers, f"no Prefect server among {recorded}"
            server_env = environment_of(servers[0][0])
            assert server_env.get("PREFECT_SERVER_ANALYTICS_ENABLED", "").lower() == "false"  # no heartbeat
            assert server_env.get("DO_NOT_TRACK") == "1"
            process.kill()
            process.wait(timeout=30)
            gone_within(recorded, 20, "what a SIGKILLed `python -m flows` started", log_path)
        finally:
            end(process)
            kill_left(recorded)


# -- make ui: deployments/ui.py ----------------------------------------------------------------

@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory):
    """One database for the module's servers: the first start migrates it, the others reuse it."""
    return tmp_path_factory.mktemp("prefect")


def start_ui(tmp_path, prefect_home, log):
    from tasks.lifetimes import free_port

    env = clean_env(PREFECT_HOME=str(prefect_home), DEW_UI_PORT=str(free_port()),
                    DEW_RETRAIN_CRON="0 3 1 1 *")
    return started([PYTHON, os.path.join(ROOT, "deployments", "ui.py")], env, log)


def serving(ui, log_path):
    """Wait until ui.py's server answers and serve.py has registered the deployments; return
    what ui.py started by then."""
    wait_for(lambda: "deployments are being served" in log_path.read_text() or ui.poll() is not None,
             420, "the deployments being served", log_path)
    assert ui.poll() is None, log_path.read_text()[-4000:]
    recorded = descendants(ui.pid)
    commands = " | ".join(p[2] for p in recorded)
    assert "server start" in commands and "serve.py" in commands, commands
    return recorded


@pytest.mark.slow
def test_make_ui_stopped_with_sigterm_stops_its_server_and_deployments(tmp_path, prefect_home):
    log_path = tmp_path / "ui.log"
    ui, recorded = None, []
    with open(log_path, "w") as log:
        try:
            ui = start_ui(tmp_path, prefect_home, log)
            recorded = serving(ui, log_path)
            served = next(p for p in recorded if "serve.py" in p[2])
            assert environment_of(served[0]).get("DO_NOT_TRACK") == "1"
            assert environment_of(served[0]).get("PREFECT_SERVER_ANALYTICS_ENABLED") == "false"
            ui.send_signal(signal.SIGTERM)
            ui.wait(timeout=60)
            gone_within(recorded, 10, "what ui.py started, once it exited on SIGTERM", log_path)
        finally:
            end(ui)
            kill_left(recorded)


@pytest.mark.slow
def test_make_ui_killed_with_sigkill_leaves_no_process_behind(tmp_path, prefect_home):
    log_path = tmp_path / "ui.log"
    ui, recorded = None, []
    with open(log_path, "w") as log:
        try:
            ui = start_ui(tmp_path, prefect_home, log)
            recorded = serving(ui, log_path)
            ui.kill()
            ui.wait(timeout=30)
            gone_within(recorded, 45, "what a SIGKILLed ui.py started", log_path)
        finally:
            end(ui)
            kill_left(recorded)


@pytest.mark.slow
def test_make_ui_exits_when_its_server_dies(tmp_path, prefect_home):
    log_path = tmp_path / "ui.log"
    ui, recorded = None, []
    with open(log_path, "w") as log:
        try:
            ui = start_ui(tmp_path, prefect_home, log)
            recorded = serving(ui, log_path)
            server = next(p for p in recorded if "server start" in p[2])
            os.kill(server[0], signal.SIGKILL)
            assert ui.wait(timeout=60) != 0
            gone_within(recorded, 10, "what ui.py started, once its server died", log_path)
            assert "the Prefect server exited" in log_path.read_text()
        finally:
            end(ui)
            kill_left(recorded)


# -- the Makefile ------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["run", "ui"])
def test_the_make_targets_turn_prefect_telemetry_off(tmp_path, target):
    """`make run` and `make ui` with a stand-in python that records its environment."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(f"#!/bin/sh\nenv > {tmp_path / 'env'}\n")
    (fake / "python").chmod(0o755)
    stamp = tmp_path / "stamp"
    stamp.touch()
    env = clean_env()
    subprocess.run(["make", "-s", "-C", ROOT, target, f"BIN={fake}", f"STAMP={stamp}"], env=env, check=True,
                   capture_output=True, timeout=60)
    recorded = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert recorded.get("PREFECT_SERVER_ANALYTICS_ENABLED") == "false"
    assert recorded.get("DO_NOT_TRACK") == "1"
