"""The run store across real processes: reading while a writer writes, SIGKILL, retries, two runs.

The writer is tests/store_worker.py in its own interpreter; it prints `committed U` once update U
is durable. Compaction in the worker runs every few updates, so readers and kills meet
generation swaps, not only appends.
"""

import os
import signal
import subprocess
import sys
import time

import duckdb
import pytest

from dew_lib.store import Store

WORKER = os.path.join(os.path.dirname(__file__), "store_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_UPDATE = 64


def start_worker(path, run, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, WORKER, str(path), run, "grpo", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process, timeout=180):
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return out


def per_update(store, run="r"):
    return dict(store.rows("SELECT update, count(*) FROM sessions WHERE run = ? GROUP BY update", [run])[1])


@pytest.mark.slow
def test_another_process_queries_while_a_run_writes(tmp_path):
    store = Store(tmp_path)
    writer = start_worker(tmp_path, "r", "--steps", 20, "--pause", 0.05)
    seen, totals, cli_checked, client_checked = [], [], False, False
    deadline = time.monotonic() + 180
    while writer.poll() is None:
        assert time.monotonic() < deadline, "the writer did not finish in time"
        if not store.exists():
            time.sleep(0.05)
            continue
        sessions = per_update(store)
        calls = dict(store.rows("SELECT update, count(*) FROM calls GROUP BY update")[1])
        # A step is visible whole or not at all, never twice, also across compactions.
        assert set(sessions.values()) <= {PER_UPDATE}, sessions
        latest = max(sessions, default=-1)
        assert all(calls.get(u) == PER_UPDATE for u in sessions if u < latest), calls
        totals.append(sum(sessions.values()))
        seen.append(len(sessions))
        if 0 < len(sessions) < 20 and not cli_checked:  # the `dew` command, a third process
            out = subprocess.run([sys.executable, "-m", "dew_lib.cli", "sql", "SELECT count(*) AS n FROM sessions",
                                  "--store", str(tmp_path), "--csv"], capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=ROOT), check=True).stdout
            assert int(out.split()[1]) % PER_UPDATE == 0
            cli_checked = True
        if 0 < len(sessions) < 20 and not client_checked:  # the duckdb client on dew.duckdb
            database = duckdb.connect(str(tmp_path / "dew.duckdb"), read_only=True)
            (n,), = database.sql("SELECT count(*) FROM sessions").fetchall()
            database.close()
            assert n % PER_UPDATE == 0
            client_checked = True
    finish(writer)
    print(f"{len(totals)} queries while writing, {store.retries} rerun after a compaction")
    assert totals == sorted(totals), "a query saw fewer rows than an earlier one"
    assert any(0 < s < 20 for s in seen), "no query ran while the writer was writing"
    assert cli_checked and client_checked
    assert per_update(store) == {u: PER_UPDATE for u in range(20)}


@pytest.mark.slow
def test_sigkill_loses_no_committed_rows_and_the_retry_writes_no_duplicates(tmp_path):
    store = Store(tmp_path)
    writer = start_worker(tmp_path, "r", "--steps", 24, "--pause", 0.02)
    committed = -1
    for line in writer.stdout:
        if line.startswith("committed"):
            committed = int(line.split()[1])
        if committed >= 8:
            break
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert writer.returncode == -signal.SIGKILL
    found = per_update(store)  # the store opens, and holds every committed update whole
    assert all(found.get(u) == PER_UPDATE for u in range(committed + 1)), found
    assert set(found.values()) == {PER_UPDATE}  # an update past the last printed one is whole too
    database = duckdb.connect(str(tmp_path / "dew.duckdb"), read_only=True)
    assert database.sql("SELECT count(*) FROM calls").fetchall()[0][0] >= (committed + 1) * PER_UPDATE
    database.close()
    assert store.runs()[1][0][1] == "interrupted"

    # The retry resumes from an earlier checkpoint and rewrites the steps after it.
    finish(start_worker(tmp_path, "r", "--steps", 24, "--start", max(committed - 5, 0)))
    assert per_update(store) == {u: PER_UPDATE for u in range(24)}
    (total, distinct), = store.rows("SELECT count(*), count(DISTINCT (update, task, group_id, sample, attempt)) "
                                    "FROM sessions")[1]
    assert total == distinct == 24 * PER_UPDATE
    assert store.rows("SELECT count(*), count(DISTINCT step) FROM metrics WHERE name = 'loss'")[1] == [(24, 24)]
    assert store.rows("SELECT status, attempt FROM stages")[1] == [("completed", 2)]
    assert store.rows("SELECT status, attempts FROM runs")[1] == [("completed", 2)]


@pytest.mark.slow
def test_two_runs_write_one_project_directory_at_once(tmp_path):
    store = Store(tmp_path)
    first = start_worker(tmp_path, "first", "--steps", 10)
    second = start_worker(tmp_path, "second", "--steps", 10)
    finish(first)
    finish(second)
    for run in ("first", "second"):
        assert per_update(store, run) == {u: PER_UPDATE for u in range(10)}
    assert store.rows("SELECT run, status FROM runs ORDER BY run")[1] == [("first", "completed"),
                                                                          ("second", "completed")]
    assert store.rows("SELECT count(*) FROM calls")[1] == [(2 * 10 * PER_UPDATE,)]
