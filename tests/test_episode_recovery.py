"""A training process killed while a tool call is pending resumes to the same parameters.

tests/episode_worker.py trains GRPO on tool episodes on two host devices with an EpisodeJournal
and a checkpoint every step. A tool worker sleeps in a chosen call of the second collection; the
test SIGKILLs the training process's group while that call is pending and runs the same command
again. The restarted process resumes from the checkpoint; the journal gives back the killed
collection's answered turns, environment snapshots and saved draws. Every collection's sampled
actions and likelihoods and the final parameters must equal, bit for bit, those of a run that
was never killed, and the tool's audit log must show each answered call once.
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import xla_flags
from test_tool_episodes import trained_policy

HERE = Path(__file__).resolve().parent
STEPS, KILLED_STEP, KILLED_TURN = 3, 1, 1


def start(policy, run, **env):
    """The training process, in a session of its own: (Popen, its output file)."""
    variables = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2"),
                 "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(HERE.parent), **{k: str(v) for k, v in env.items()}}
    output = open(run.parent / f"{run.name}.log", "ab")
    command = [sys.executable, str(HERE / "episode_worker.py"), str(policy), str(run), str(STEPS)]
    return subprocess.Popen(command, env=variables, stdout=output, stderr=subprocess.STDOUT,
                            start_new_session=True), output


def finish(process, output, run):
    try:
        code = process.wait(timeout=300)
    finally:
        _kill_group(process)
        output.close()
    assert code == 0, (run.parent / f"{run.name}.log").read_text()[-3000:]


def _kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def collections(run):
    """{step: the last record of that step's collection} from RUN/collections.jsonl."""
    return {record["step"]: record for record in map(json.loads, (run / "collections.jsonl").read_text().splitlines())}


def wait_for(path, process, seconds):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, "the training process ended before the tool call hung"
        assert time.monotonic() < deadline, f"no tool call hung within {seconds} s ({path} never appeared)"
        time.sleep(0.05)


def gone(pid, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ")[1][0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_a_killed_training_process_resumes_its_pending_collection_exactly(tmp_path):
    policy = tmp_path / "policy.pkl"
    policy.write_bytes(pickle.dumps(jax.device_get(trained_policy())))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    finish(*start(policy, straight, AUDIT=straight / "audit"), straight)

    marker = killed / "sleep"
    marker.write_text(f"{KILLED_STEP} {KILLED_TURN} 1")
    process, output = start(policy, killed, AUDIT=killed / "audit", SLEEP=marker)
    try:
        wait_for(Path(f"{marker}.sleeping"), process, 240)
        sleeper = int(Path(f"{marker}.sleeping").read_text().split()[0])
        os.killpg(process.pid, signal.SIGKILL)  # while the call is pending
    finally:
        _kill_group(process)
        output.close()
    assert gone(sleeper)  # the hung worker died with its parent, before writing its audit line
    before = collections(killed)
    assert sorted(before) == list(range(KILLED_STEP))  # the killed collection never finished
    finish(*start(policy, killed, AUDIT=killed / "audit", SLEEP=marker), killed)

    expected, resumed = collections(straight), collections(killed)
    assert sorted(resumed) == list(range(STEPS))
    for step in range(STEPS):  # every action and likelihood, bit for bit
        assert resumed[step]["episodes"] == expected[step]["episodes"], f"collection {step} differs"
    # the killed collection's rounds 0 and 1 came back from the journal instead of the policy
    assert resumed[KILLED_STEP]["policy_calls"] == expected[KILLED_STEP]["policy_calls"] - (KILLED_TURN + 1)
    with open(straight / "params.pkl", "rb") as a, open(killed / "params.pkl", "rb") as b:
        for x, y in zip(jax.tree.leaves(pickle.load(a)), jax.tree.leaves(pickle.load(b)), strict=True):
            np.testing.assert_array_equal(x, y)
    audit = (killed / "audit").read_text().splitlines()
    calls = [line for line in audit if line.startswith("step ")]
    assert len(calls) == len(set(calls))  # no answered call ran twice
    assert sorted(calls) == sorted((straight / "audit").read_text().splitlines())
    assert any(line.startswith("restore ") for line in audit)  # answered slots got their snapshots back
