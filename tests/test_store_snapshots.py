"""Snapshots: plain DuckDB clients on `dew.duckdb` read whole generations while a writer compacts.

The writer is tests/store_worker.py in its own process, compacting on every write; the readers
are plain `duckdb` in two more processes (no Dew code), one connecting anew every 10 queries (so
it moves from snapshot to snapshot), one every 100 (so it reads a superseded one for a while).
Neither may see an error, a part of a step, or a count smaller than one it saw before. Then: a
snapshot a client holds outlives its successors' grace, and a reader publishes what a killed
writer left unpublished.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from dew_lib.store import Store, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(os.path.dirname(__file__), "store_worker.py")
PROMPTS, SAMPLES = 4, 4  # sessions per update: 16, with 16 calls; 2 metrics

READER = r"""
import json, sys, time
import duckdb

path, seconds, reconnect = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
per_update = int(sys.argv[4])
# Each table is scanned once: two scans of one table in a query may differ by a part appended
# between them (docs/store.md). A part holds whole steps, so every count is a multiple of a step's.
query = "SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM calls), (SELECT count(*) FROM metrics)"
queries = errors = decreases = torn = 0
first_errors, last, connection = [], (0, 0, 0), None
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    try:
        if connection is None:
            connection = duckdb.connect(path, read_only=True)
        counts = connection.sql(query).fetchall()[0]
    except duckdb.Error as error:
        errors += 1
        first_errors.append(str(error)[:300])
        counts = None
    queries += 1
    if counts is not None:
        sessions, calls, metrics = counts
        if any(now < before for now, before in zip(counts, last)):
            decreases += 1
        if sessions % per_update or calls % per_update or metrics % 2:
            torn += 1
        last = counts
    if connection is not None and (counts is None or queries % reconnect == 0):
        connection.close()
        connection = None
print(json.dumps({"queries": queries, "errors": errors, "first_errors": first_errors[:3],
                  "decreases": decreases, "torn": torn, "last": last}))
"""


def start_writer(path, seconds):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, WORKER, str(path), "r", "grpo", "--steps", "100000",
                             "--seconds", str(seconds), "--prompts", str(PROMPTS), "--compact-after", "2",
                             "--keep-loose", "0", "--merge-after", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_reader(database, seconds, reconnect):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # plain duckdb, no Dew code
    return subprocess.Popen([sys.executable, "-c", READER, str(database), str(seconds), str(reconnect),
                             str(PROMPTS * SAMPLES)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")


@pytest.mark.slow
def test_raw_duckdb_readers_see_whole_growing_snapshots_while_a_writer_compacts(tmp_path):
    seconds = 30.0
    writer = start_writer(tmp_path, seconds + 5)
    for line in writer.stdout:  # the store, its first update and a snapshot exist
        if line.startswith("committed"):
            break
    began = time.monotonic()
    readers = [start_reader(tmp_path / "dew.duckdb", seconds, reconnect) for reconnect in (10, 100)]
    results = []
    for reader in readers:
        out, err = reader.communicate(timeout=seconds + 120)
        assert reader.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    took = time.monotonic() - began
    out, err = writer.communicate(timeout=180)
    assert writer.returncode == 0, err[-3000:]
    updates = sum(line.startswith("committed") for line in out.splitlines()) + 1
    swaps = len(os.listdir(tmp_path / "store" / ".snaps"))
    total = sum(r["queries"] for r in results)
    print(f"\n{total} queries by 2 plain duckdb readers in {took:.1f} s: {results}; "
          f"the writer wrote {updates} updates")
    for result in results:
        assert result["errors"] == 0, result["first_errors"]
        assert result["decreases"] == 0 and result["torn"] == 0, result
        assert result["last"][0] > 0, result  # it saw the writer's rows
    assert total >= 1000 and min(r["queries"] for r in results) >= 100, results  # thousands when idle
    assert updates >= 20 and swaps >= 1
    store = Store(tmp_path)  # everything arrived, once
    assert store.rows("SELECT count(*), count(DISTINCT update) FROM sessions")[1] == [
        (updates * PROMPTS * SAMPLES, updates)]


def test_a_superseded_snapshot_stays_while_a_client_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "GRACE_SECONDS", 0.0)
    store = Store(tmp_path)
    run = store.writer("r", background=False, compact_after=2, keep_loose=0)
    stage = run.stage("sft")
    stage.metrics(0, {"loss": 1.0})
    client = subprocess.Popen(  # a plain duckdb client that keeps its connection
        [sys.executable, "-c", ("import duckdb, sys\n"
                                "c = duckdb.connect(sys.argv[1], read_only=True)\n"
                                "print(c.sql('SELECT count(*) FROM metrics').fetchall()[0][0], flush=True)\n"
                                "sys.stdin.readline()\n"
                                "print(c.sql('SELECT count(*), sum(value) FROM metrics').fetchall()[0], flush=True)\n"),
         str(tmp_path / "dew.duckdb")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert client.stdout.readline().strip() == "1"
    held = snapshot.current(store.directory)
    for step in range(1, 6):  # every write compacts: five new generations, five new snapshots
        stage.metrics(step, {"loss": 1.0})
    assert snapshot.current(store.directory) != held and os.path.exists(held)
    out, _ = client.communicate("\n", timeout=60)
    assert out.strip() == "(2, 2.0)"  # its generation, whole: step 0, and step 1 added before it compacted
    stage.metrics(6, {"loss": 1.0})  # the next publish collects what nobody holds
    assert not os.path.exists(held)
    generations = os.listdir(os.path.dirname(stage.streams["metrics"].gen))
    assert sorted(generations) == [os.path.basename(stage.streams["metrics"].gen), "tmp"]
    run.close()
    assert store.rows("SELECT count(*) FROM metrics")[1] == [(7,)]


def test_a_reader_publishes_what_a_killed_writer_left_unpublished(tmp_path):
    store = Store(tmp_path)
    store.create()
    from dew_lib.store.parts import Stream
    from dew_lib.store.rows import metrics_table, now

    stream = Stream(store.directory, "metrics", "r", "sft", "step", compact_after=2, keep_loose=0,
                    on_change=lambda: None)  # a writer that dies before it publishes
    for step in range(3):
        stream.write(step, metrics_table({"loss": 1.0}, run="r", stage="sft", step=step, when=now()))
    assert store.rows("SELECT count(*) FROM metrics")[1] == [(3,)]
    assert snapshot.manifest(snapshot.current(store.directory))["gens"]["metrics"] == [
        os.path.relpath(stream.gen, store.directory)]
