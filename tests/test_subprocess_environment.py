"""SubprocessEnvironment with real worker processes: round trips, snapshots, each failure the
parent must turn into a ToolFailure, cleanup after a hang, a parent's death and a cohort, and
the namespace isolation claims next to the process worker as a control.

Every environment here is entered on the test's own (main) thread, as the factory's docstring
asks: the worker's parent-death signal belongs to the thread that started it.
"""

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from dew_lib import tool_worker
from dew_lib.records import Action, EpisodeId, EpisodeStatus, Task
from dew_lib.rollouts import SubprocessEnvironment, ToolFailure
from dew_lib.sandbox import SandboxLimits, SandboxUnavailable

WORKERS = Path(__file__).resolve().parent / "tool_workers"
SQUARE, RAW, PARENT = (str(WORKERS / name) for name in ("square.py", "raw.py", "dying_parent.py"))
LIMITS = SandboxLimits(wall_seconds=30, cpu_seconds=10, memory_bytes=512 << 20, max_output_bytes=1 << 16)
IDENTITY = EpisodeId(task="t1", group=2, sample=1, attempt=0, seed=77)
EXIT_LIMITS = "(limits: 536870912 bytes of address space, RLIMIT_AS; 10 s of CPU, RLIMIT_CPU)"


@pytest.fixture(scope="module")
def namespace_files():
    try:
        SubprocessEnvironment(("true",), isolation="namespace")
    except SandboxUnavailable as error:
        pytest.skip(f"bubblewrap cannot run here: {error}")
    return {"square.py": Path(SQUARE).read_text(), "tool_worker.py": Path(tool_worker.__file__).read_text()}


def square(isolation="process", *extra, limits=LIMITS, request=None):
    """The square worker's factory, run by this interpreter or (namespace) the system python3."""
    if isolation == "process":
        return SubprocessEnvironment((sys.executable, SQUARE, *extra), limits)
    files = request.getfixturevalue("namespace_files")
    return SubprocessEnvironment(("python3", "square.py", *extra), limits, isolation="namespace", files=files)


def raw(reply, *, repeat=1, once=False, alloc=False, limits=LIMITS):
    """An environment whose worker answers every request with the text `reply`."""
    factory = SubprocessEnvironment((sys.executable, RAW, *(("alloc",) if alloc else ())), limits)
    return factory(Task("raw", {"reply": reply, "repeat": repeat, "once": once}), IDENTITY)


def task(**data):
    return Task("t1", {"prompt": np.array([5, 6], np.int32), "turns": 3, **data})


def act(observation, tokens, step, *, terminated=True, policy_step=0):
    return Action(observation.context, np.asarray(tokens, np.int32), terminated, step, policy_step=policy_step)


def alive(pid):
    """Whether `pid` runs (a zombie, which nobody here reaps, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked(marker):
    """Live processes with `marker` as an argument."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") and alive(pid):
                found.append(int(pid))
    return found


def wait_dead(pids, seconds=5.0):
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("isolation", ["process", "namespace"])
def test_an_episode_round_trips(isolation, request):
    with square(isolation, request=request)(task(), IDENTITY) as env:
        workspace, pid = env.workspace, env.pid
        assert os.path.isdir(workspace) and alive(pid)
        first = env.reset()
        assert first.context.tolist() == [5, 6, 1] and first.status is EpisodeStatus.RUNNING
        assert json.loads(first.detail) == {"episode": dataclasses.asdict(IDENTITY),
                                            "task": {"id": "t1", "data": {"prompt": [5, 6], "turns": 3}}}
        second = env.step(act(first, [2, 3], 0, policy_step=4))
        assert second.context.tolist() == [5, 6, 1, 2, 3, 25]
        assert (second.status, second.detail) == (EpisodeStatus.RUNNING, "total 5 policy 4 terminated True")
        third = env.step(act(second, [4], 1, policy_step=4))
        assert third.context.tolist() == [5, 6, 1, 2, 3, 25, 4, 16] and third.status is EpisodeStatus.RUNNING
        last = env.step(act(third, [1, 1], 2, terminated=False, policy_step=5))
        assert last.context.tolist() == [5, 6, 1, 2, 3, 25, 4, 16, 1, 1, 4]
        assert (last.status, last.detail) == (EpisodeStatus.COMPLETED, "total 11 policy 5 terminated False")
    assert not os.path.exists(workspace) and wait_dead([pid]) == []
    assert env.pid is None and env.workspace is None


def test_a_request_larger_than_a_pipe_and_extra_variables():
    limits = dataclasses.replace(LIMITS, max_output_bytes=1 << 20)
    factory = SubprocessEnvironment((sys.executable, SQUARE), limits, env={"TMPDIR": "/nowhere", "TOOL": "1"})
    context = np.arange(1, 50_001, dtype=np.int32)  # about 290 KB of JSON, over a 64 KiB pipe
    with factory(task(), IDENTITY) as env:
        env.reset()
        observation = env.step(Action(context, np.array([7]), True, 0))
        assert os.environ.get("TOOL") is None and _environ(env.pid)[b"TMPDIR"] == b"/nowhere"
    assert observation.context.tolist() == [*range(1, 50_001), 7, 49]


def _environ(pid):
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.split(b"=", 1) for pair in pairs if pair)


def test_a_snapshot_restores_into_a_fresh_worker():
    factory = square()
    with factory(task(), IDENTITY) as first:
        observation = first.step(act(first.reset(), [2, 3], 0))
        state = first.get_state()
        assert json.loads(state) == {"data": {"prompt": [5, 6], "turns": 3}, "total": 5}
        expected = first.step(act(observation, [4], 1))
    other = dataclasses.replace(IDENTITY, sample=0)
    with factory(Task("t1", {"prompt": [9], "turns": 1}), other) as second:
        assert second.reset().context.tolist() == [9, 0]
        assert second.set_state(state) is None
        restored = second.step(act(observation, [4], 1))
    assert restored.context.tolist() == expected.context.tolist() == [5, 6, 1, 2, 3, 25, 4, 16]
    assert (restored.status, restored.detail) == (expected.status, "total 9 policy 0 terminated True")


def test_a_hang_meets_the_session_deadline_and_its_group_dies():
    limits = dataclasses.replace(LIMITS, wall_seconds=2.0)
    with square(limits=limits)(task(mode="hang"), IDENTITY) as env:
        entered = time.monotonic()
        pid = env.pid
        observation = env.step(act(env.reset(), [2], 0))
        with pytest.raises(ToolFailure, match=r"no reply to step 1 within the session's 2 s wall deadline "
                                              r"\(SandboxLimits.wall_seconds, counted from entering"):
            env.step(act(observation, [3], 1))
        assert 1.9 < time.monotonic() - entered < 3.5
        child = int(env._channel.stderr_tail().split("child ")[1].split()[0])
        assert wait_dead([pid, child], 2.0) == []  # killed at the failure, before the exit
        with pytest.raises(ToolFailure, match="the tool worker already failed .* step 2 was not sent"):
            env.step(act(observation, [3], 2))
    assert wait_dead([pid, child]) == []


def test_a_worker_that_passes_its_memory_limit_fails_the_step():
    limits = dataclasses.replace(LIMITS, memory_bytes=256 << 20)
    with square(limits=limits)(task(mode="alloc"), IDENTITY) as env:
        observation = env.step(act(env.reset(), [2], 0))
        with pytest.raises(ToolFailure, match="the tool worker answered step 1 with an error: MemoryError") as info:
            env.step(act(observation, [3], 1))
    assert "bytearray(1 << 30)" in info.value.stderr  # the worker's traceback


def test_a_worker_killed_by_its_memory_limit_names_the_limit():
    with raw("", alloc=True) as env, pytest.raises(ToolFailure) as info:
        env.reset()
    assert str(info.value).startswith(f"the tool worker exited with status 1 {EXIT_LIMITS} before replying to reset")
    assert info.value.stderr.rstrip().endswith("MemoryError")


def test_a_worker_out_of_cpu_time_is_named():
    limits = dataclasses.replace(LIMITS, cpu_seconds=1)
    with square(limits=limits)(task(mode="spin"), IDENTITY) as env:
        observation = env.step(act(env.reset(), [2], 0))
        with pytest.raises(ToolFailure, match=r"the tool worker was killed by SIGXCPU: it used its 1 s "
                                              r"CPU-time limit \(RLIMIT_CPU\) before replying to step 1"):
            env.step(act(observation, [3], 1))


def test_a_crash_mid_episode_names_the_exit_status():
    with square()(task(mode="crash"), IDENTITY) as env:
        observation = env.step(act(env.reset(), [2], 0))
        with pytest.raises(ToolFailure) as info:
            env.step(act(observation, [3], 1))
    assert str(info.value).startswith(f"the tool worker exited with status 3 {EXIT_LIMITS} before replying to step 1")
    assert info.value.stderr == "stdout is stderr while serving\ncrashing on purpose\n"


def test_an_error_reply_raises_and_the_worker_stays_in_step():
    with square()(task(mode="refuse"), IDENTITY) as env:
        observation = env.step(act(env.reset(), [2], 0))
        with pytest.raises(ToolFailure, match="the tool worker answered step 1 with an error: "
                                              "ValueError: no tool named 'rm'; stderr tail: .*Traceback"):
            env.step(act(observation, [3], 1))
        again = env.step(act(observation, [3], 1))
    assert again.context.tolist() == [5, 6, 1, 2, 4, 3, 9] and again.detail.startswith("total 5 ")


@pytest.mark.parametrize("reply, message", [
    ("hello\n",
     "the tool worker's reply to reset is not JSON (Expecting value: line 1 column 1 (char 0)): b'hello'"),
    ("[1, 2]\n", "the tool worker's reply to reset is not a JSON object: b'[1, 2]'"),
    ('{"context": [1], "status": "running"}\n',
     "the tool worker's reply to reset is not an observation (missing detail)"),
    ('{"context": [1, true], "status": "running", "detail": ""}\n',
     "the tool worker's reply to reset is not an observation (context must be a list of token ids"),
    ('{"context": [1], "status": "done", "detail": ""}\n',
     "the tool worker's reply to reset is not an observation (status must be one of ('running', "),
    ('{"context": [], "status": "running", "detail": ""}\n',
     "the tool worker's reply to reset is not an observation (Observation.context is empty while"),
    ('{"error": "boom"}\n', "the tool worker answered reset with an error: boom; no stderr"),
], ids=["text", "array", "missing", "bool-id", "status", "empty", "error"])
def test_a_malformed_reply_is_refused(reply, message):
    with raw(reply) as env, pytest.raises(ToolFailure) as info:
        env.reset()
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("reply", ["x" * 100_000 + "\n", "x" * 5000], ids=["long-line", "no-newline"])
def test_a_flood_is_cut_at_the_size_cap(reply):
    limits = dataclasses.replace(LIMITS, max_output_bytes=1000)
    with raw(reply, limits=limits) as env:
        with pytest.raises(ToolFailure, match=r"the tool worker's reply to reset is longer than the "
                                              r"1000-byte cap \(SandboxLimits.max_output_bytes\); no stderr"):
            env.reset()
        pid = env.pid
        assert wait_dead([pid], 2.0) == []  # killed at once: the stream is out of step


def test_an_unrequested_line_and_an_error_status():
    line = '{"context": [7], "status": "error", "detail": "tool broke"}\n'
    with raw(line, repeat=2) as env:
        first = env.reset()
        assert (first.context.tolist(), first.status, first.detail) == ([7], EpisodeStatus.ERROR, "tool broke")
        with pytest.raises(ToolFailure, match="the tool worker wrote output nobody asked for before step 0: "
                                              r"b'\{\"context\": \[7\], \"status\": \"error\""):
            env.step(act(first, [1], 0))


def test_a_worker_that_exits_after_a_reply_fails_the_next_request():
    with raw('{"context": [7], "status": "running", "detail": ""}\n', once=True) as env:
        first = env.reset()
        with pytest.raises(ToolFailure, match=r"^the tool worker exited with status 0 \(limits: .*\) before "
                                              r"(replying to step 0|step 0 was sent); no stderr$"):
            env.step(act(first, [1], 0))


def test_a_cohort_on_one_thread_leaves_no_worker_behind():
    marker = f"dew-cohort-{uuid.uuid4().hex}"
    factory = square("process", marker)
    with contextlib.ExitStack() as stack:
        envs = [stack.enter_context(factory(task(turns=1), dataclasses.replace(IDENTITY, sample=i)))
                for i in range(16)]
        firsts = [env.reset() for env in envs]
        lasts = [env.step(act(first, [i], 0)) for i, (env, first) in enumerate(zip(envs, firsts))]
        assert sorted(marked(marker)) == sorted(env.pid for env in envs)
    assert [last.context.tolist() for last in lasts] == [[5, 6, i, i, i * i] for i in range(16)]
    assert {last.status for last in lasts} == {EpisodeStatus.COMPLETED}
    assert marked(marker) == []


@pytest.mark.parametrize("isolation", ["process", "namespace"])
def test_the_worker_dies_with_its_parent(isolation, request):
    if isolation == "namespace":
        request.getfixturevalue("namespace_files")
    marker = f"dew-parent-{uuid.uuid4().hex}"
    parent = subprocess.run([sys.executable, PARENT, isolation, marker], capture_output=True, text=True,
                            timeout=60, check=False)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    worker = int(parent.stdout)
    assert wait_dead([worker]) == [] and wait_dead(marked(marker)) == []


@pytest.mark.parametrize("isolation, expected", [("process", " | ok"),
                                                  ("namespace", " | ConnectionRefusedError errno 111")])
def test_only_the_namespace_worker_is_cut_off_from_the_network(isolation, expected, request):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with square(isolation, request=request)(task(turns=1, mode="connect", port=port), IDENTITY) as env:
            last = env.step(act(env.reset(), [2], 0))
    assert last.detail == "total 2 policy 0 terminated True" + expected


def test_the_namespace_worker_writes_only_its_workspace(tmp_path, request):
    outside = tmp_path / "outside.txt"
    paths = [str(outside), "/usr/dew-probe", "note.txt"]
    with square("namespace", request=request)(task(turns=1, mode="write", paths=paths), IDENTITY) as env:
        last = env.step(act(env.reset(), [2], 0))
        assert (Path(env.workspace) / "note.txt").read_text() == "x"
    assert last.detail.split(" | ")[1:] == ["FileNotFoundError errno 2", "OSError errno 30", "ok"]
    assert not outside.exists() and not os.path.exists("/usr/dew-probe")


def test_the_process_worker_writes_wherever_you_can(tmp_path):
    outside = tmp_path / "outside.txt"
    with square()(task(turns=1, mode="write", paths=[str(outside), "note.txt"]), IDENTITY) as env:
        last = env.step(act(env.reset(), [2], 0))
    assert last.detail.split(" | ")[1:] == ["ok", "ok"] and outside.read_text() == "x"


def test_an_environment_must_be_entered_once():
    env = square()(task(), IDENTITY)
    with pytest.raises(RuntimeError, match=r"reset needs an entered environment: use `with factory"):
        env.reset()
    with env, pytest.raises(RuntimeError, match="already entered"):
        env.__enter__()


@pytest.mark.parametrize("kwargs, message", [
    ({"command": "python3 worker.py"}, "SubprocessEnvironment.command must be a non-empty sequence of strings"),
    ({"isolation": "docker"},
     r"SubprocessEnvironment.isolation must be one of \('process', 'namespace'\), got 'docker'"),
    ({"read_only": ("/opt",)}, "SubprocessEnvironment.read_only applies only to isolation='namespace'"),
    ({"read_only": "/opt"}, "SubprocessEnvironment.read_only must be a sequence of paths, not the string '/opt'"),
    ({"files": {"../x.py": ""}}, r"SubprocessEnvironment.files key '../x.py' must be a relative"),
    ({"env": {"A=B": "1"}}, "SubprocessEnvironment.env must map variable names"),
    ({"limits": {"wall_seconds": 1}}, "SubprocessEnvironment.limits must be a SandboxLimits"),
], ids=["shell-string", "isolation", "read-only", "read-only-string", "files", "env", "limits"])
def test_options_are_checked(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SubprocessEnvironment(**{"command": ("python3",), **kwargs})


def test_task_data_that_json_cannot_carry_is_refused():
    env = square()(Task("t1", {"prompt": b"\x00"}), IDENTITY)
    with env, pytest.raises(TypeError, match="task 't1' data holds a bytes, which JSON cannot carry"):
        env.reset()


def test_the_worker_helper_loads_no_numpy_and_starts_fast():
    probe = "import sys, dew_lib.tool_worker; print(sorted(m for m in ('numpy', 'jax') if m in sys.modules))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert time.monotonic() - started < 2.0
