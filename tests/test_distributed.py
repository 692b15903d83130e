"""Multi-process training: `dew launch`, two CPU processes against one on the same devices,
checkpoints across process counts, a killed process ending the job, and episode journals (one
per process) that resume a killed job's collection.

Two processes with two host devices each and one process with four train on the same four
global devices and the same global batches (tests/distributed_worker.py). Their parameters agree
to float32 rounding, not bit for bit: the gradient's sum over devices runs inside one XLA
program in one process and over gloo between processes, and the two add the four partial sums in
another order. Runs on the same topology are bit for bit equal.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import WORKER
from conftest import npz_leaves as leaves
from conftest import worker_job as run_job

from dew_lib.train.launch import launch
from dew_lib.train.topology import Topology

# The shared fixture trains every recipe twice in subprocesses (2 minutes on a loaded 2-core
# machine, each job allowed 10): more room than the suite's 600 s per test.
pytestmark = pytest.mark.timeout(900)

ROUNDING = dict(rtol=1e-5, atol=1e-5)  # what the order of the cross-device sum moves (as test_sharding)
RECIPES = ("sft", "dpo", "grpo", "flow", "async", "episodes", "ppo")


def assert_close(a, b, exact=False):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if exact:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, **ROUNDING)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Three steps of SFT, DPO, GRPO, Flow-GRPO, scheduled GRPO (one RolloutScheduler per
    process), tool episodes and PPO over them, in one process on 4 devices and in 2 processes
    on 2 each."""
    where = tmp_path_factory.mktemp("jobs")
    one = run_job(1, 4, ",".join(RECIPES), where / "one")
    two = run_job(2, 2, ",".join(RECIPES), where / "two")
    return where, one.stdout, two.stdout


@pytest.mark.slow
def test_two_processes_train_every_recipe_like_one_process_on_the_same_four_devices(finished):
    """Scheduled GRPO too: each process's scheduler draws its own tasks on its own server, under
    the group ids (and so the seeds) one process gives the same tasks. And episodes: process 0's
    take one turn and process 1's three, and every turn draws the job's whole cohort. And PPO:
    its advantages are whitened over the job's batch (each process's own batch would not do)."""
    where, one, two = finished
    for recipe in RECIPES:
        assert f"[0] {recipe} process 0 of 1 devices 4 step 3" in one
        assert f"[1] {recipe} process 1 of 2 devices 4 step 3" in two
        first, second = leaves(where / f"one-{recipe}.npz"), leaves(where / f"two-{recipe}.npz")
        assert_close(first, second)
    # Only process 0 writes metrics: each step's line comes once, from it.
    assert two.count("step 3/3") == len(RECIPES) and "[1] step" not in two


@pytest.mark.slow
def test_rollouts_that_fail_on_one_process_raise_on_every_process(tmp_path):
    failed = run_job(2, 2, "async-fail", tmp_path / "failed", "--steps", "1", check=False)
    assert failed.returncode == 3, failed.stdout[-3000:]
    assert ("[1] async-fail process 1 raised: no group of the batch at position 0 could be admitted "
            "(2 abandoned after max_attempts=2") in failed.stdout
    assert ("[0] async-fail process 0 raised: the rollouts of the batch at position 0 failed on process 1 "
            "of 2") in failed.stdout


@pytest.mark.slow
def test_a_checkpoint_written_by_two_processes_resumes_in_one_and_the_other_way(finished, tmp_path):
    where, _, _ = finished
    run_job(2, 2, "sft", tmp_path / "a", "--steps", "2", "--directory", str(tmp_path / "two-then-one"))
    resumed = run_job(1, 4, "sft", tmp_path / "a", "--steps", "3", "--directory", str(tmp_path / "two-then-one"))
    assert "resuming from the checkpoint" in resumed.stdout and "step 3/3" in resumed.stdout
    assert_close(leaves(tmp_path / "a-sft.npz"), leaves(where / "one-sft.npz"))

    run_job(1, 4, "sft", tmp_path / "b", "--steps", "2", "--directory", str(tmp_path / "one-then-two"))
    resumed = run_job(2, 2, "sft", tmp_path / "b", "--steps", "3", "--directory", str(tmp_path / "one-then-two"))
    assert "[0] resuming from the checkpoint" in resumed.stdout
    assert_close(leaves(tmp_path / "b-sft.npz"), leaves(where / "two-sft.npz"))


@pytest.mark.slow
def test_a_tool_that_fails_on_one_process_ends_every_process_and_releases_every_environment(tmp_path):
    failed = run_job(2, 2, "episodes-fail", tmp_path / "failed", "--steps", "1", check=False)
    assert failed.returncode == 3, failed.stdout[-3000:]
    assert "[1] episodes-fail process 1 raised: the episode of task" in failed.stdout
    assert "step raised ConnectionError: the tool's sandbox went away on process 1" in failed.stdout
    assert "[0] episodes-fail process 0 raised: turn 0 of the episodes failed on process 1 of 2" in failed.stdout
    for process in (0, 1):
        log = (tmp_path / f"failed-environments-{process}.log").read_text().split()
        assert log.count("enter") == log.count("exit") == 4  # 2 tasks x 2 samples, all released


@pytest.mark.slow
def test_processes_whose_episode_cohorts_differ_are_refused_on_every_process(tmp_path):
    refused = run_job(2, 2, "episodes-mismatch", tmp_path / "refused", "--steps", "1", check=False)
    assert refused.returncode == 3, refused.stdout[-3000:]
    for process in (0, 1):
        assert (f"[{process}] episodes-mismatch process {process} raised: the processes' EpisodeRollouts "
                "differ in max_turns (3, 2), by process") in refused.stdout


def saved_rounds(directory, rank):
    """(trainer step, finished, rounds with saved draws) of each collection in a rank's journal."""
    path = directory / "journal" / f"rank-{rank}.sqlite"
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return db.execute("SELECT step, finished, (SELECT count(DISTINCT turn) FROM draws d WHERE d.collection = c.id) "
                          "FROM collections c ORDER BY id").fetchall()


@pytest.mark.slow
def test_journals_of_two_processes_resume_a_collection_together_as_if_it_never_stopped(finished, tmp_path):
    """Each process keeps its own EpisodeJournal, and process 1 is killed twice where the two
    disagree: leaving its environments at step 2, after process 0 finished that collection (the
    rerun draws it afresh on both), and in its verifier at step 3, when its journal holds two
    rounds and process 0's one, whose episodes all ended in round 0 (the rerun restores both
    and draws nothing). The job ends where the uninterrupted one without journals does."""
    where, _, _ = finished
    directory, out = tmp_path / "run", tmp_path / "killed"
    args = ("episodes-journal", out, "--steps", "3", "--directory", str(directory))
    killed = run_job(2, 2, *args, check=False, env={"DEW_TEST_KILL": f"{tmp_path}/first:1:release"})
    assert killed.returncode == 128 + signal.SIGKILL, killed.stdout[-3000:]
    assert saved_rounds(directory, 0)[-1][:2] == (1, 1) and saved_rounds(directory, 1)[-1] == (1, 0, 1)
    killed = run_job(2, 2, *args, check=False, env={"DEW_TEST_KILL": f"{tmp_path}/second:2:verify"})
    assert killed.returncode == 128 + signal.SIGKILL, killed.stdout[-3000:]
    assert "[0] resuming from the checkpoint" in killed.stdout
    assert saved_rounds(directory, 0)[-1] == (2, 0, 1) and saved_rounds(directory, 1)[-1] == (2, 0, 2)
    resumed = run_job(2, 2, *args)
    assert "[0] episodes-journal process 0 of 2 devices 4 step 3" in resumed.stdout
    assert_close(leaves(f"{out}-episodes-journal.npz"), leaves(where / "two-episodes.npz"), exact=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split()[2] != "Z"


@pytest.mark.slow
def test_a_killed_process_ends_the_whole_job_and_a_rerun_resumes_it(finished, tmp_path):
    where, _, _ = finished
    directory = str(tmp_path / "checkpoints")
    command = [sys.executable, "-m", "dew_lib.cli", "launch", "--processes", "2", "--local-devices", "2", "--",
               sys.executable, WORKER, "sft", str(tmp_path / "killed"), "--steps", "3", "--pause", "2",
               "--directory", directory]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids, seen = {}, []
    for line in job.stdout:
        seen.append(line)
        if line.split()[1:2] == ["pid"]:
            pids[line.split()[0]] = int(line.split()[2])
        if "[0] step 2/3" in line:  # its metrics are read after step 1's checkpoint is written
            break
    assert set(pids) == {"[0]", "[1]"}, "".join(seen)
    os.kill(pids["[1]"], signal.SIGKILL)
    killed = time.monotonic()
    rest = job.stdout.read()
    job.wait(timeout=60)
    assert job.returncode == 128 + signal.SIGKILL, rest
    assert "process 1 exited with signal SIGKILL; ended the other 1" in rest
    assert time.monotonic() - killed < 30  # ended, not left waiting in a collective
    assert not _alive(pids["[0]"])

    rerun = run_job(2, 2, "sft", tmp_path / "rerun", "--steps", "3", "--directory", directory)
    assert "[0] resuming from the checkpoint" in rerun.stdout
    assert_close(leaves(tmp_path / "rerun-sft.npz"), leaves(where / "two-sft.npz"), exact=True)


def _script(tmp_path, body):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_launch_gives_each_process_its_place_and_prefixes_its_lines(tmp_path, capsys):
    command = _script(tmp_path, """
        import os
        print(os.environ["DEW_PROCESS_ID"], os.environ["DEW_PROCESSES"], os.environ["DEW_LOCAL_DEVICES"],
              os.environ["DEW_COORDINATOR"].startswith("127.0.0.1:"))
    """)
    assert launch(command, 3, local_devices=2) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == ["[0] 0 3 2 True", "[1] 1 3 2 True", "[2] 2 3 2 True"]


def test_a_failing_process_ends_the_others_at_once_with_its_exit_code(tmp_path, capsys):
    command = _script(tmp_path, """
        import os, sys, time
        if os.environ["DEW_PROCESS_ID"] == "1":
            sys.exit(3)
        time.sleep(120)
    """)
    started = time.monotonic()
    assert launch(command, 2, grace=2) == 3
    assert time.monotonic() - started < 20
    assert "dew launch: process 1 exited with code 3; ended the other 1" in capsys.readouterr().out


def test_killing_the_launcher_ends_every_process(tmp_path):
    pids = tmp_path / "pids"
    job = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from dew_lib.train.launch import launch
        child = "import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\\\n'); time.sleep(120)"
        sys.exit(launch([sys.executable, "-c", child], 2))
    """)])
    deadline = time.monotonic() + 60
    while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [int(p) for p in pids.read_text().split()]
    job.send_signal(signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in children)


def test_the_environment_names_the_job_or_says_what_is_missing():
    assert Topology.from_environment({}) is None
    topology = Topology.from_environment({"DEW_COORDINATOR": "10.0.0.1:1234", "DEW_PROCESSES": "4",
                                          "DEW_PROCESS_ID": "3"})
    assert topology == Topology("10.0.0.1:1234", 4, 3)
    with pytest.raises(ValueError, match="DEW_PROCESSES is set without DEW_COORDINATOR and DEW_PROCESS_ID"):
        Topology.from_environment({"DEW_PROCESSES": "2"})
    with pytest.raises(ValueError, match="DEW_PROCESS_ID must be an integer, got 'x'"):
        Topology.from_environment({"DEW_COORDINATOR": "h:1", "DEW_PROCESSES": "2", "DEW_PROCESS_ID": "x"})
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\), got 2"):
        Topology("h:1", 2, 2)
    with pytest.raises(ValueError, match="host:port"):
        Topology("h", 2, 0)
