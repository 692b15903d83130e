"""One damaged file never blocks the rest: real files truncated, garbled, deleted and restored.

A damaged part (truncated, garbled bytes) must be named with its path, table, run and stage; it
must not stop queries of other tables or other runs, `dew runs`, or a new run writing (also in a
new process); a garbled snapshot is replaced; a deleted generation directory is an error naming
it, not zero rows. `dew store check` lists what is damaged and `dew store repair` moves it aside
into a recorded quarantine, never deleting it, and republishes.
"""

import io
import json
import os
import subprocess
import sys

import duckdb
import pyarrow.parquet as pq
import pytest
from store_worker import sessions_for, two_runs

from dew_lib import cli
from dew_lib.store import Store, StoreDamaged, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(os.path.dirname(__file__), "store_worker.py")
PER_UPDATE = 2 * 4  # store_worker's sessions_for(update, prompts=2): 2 prompts x 4 samples


@pytest.fixture
def project(tmp_path):
    """Runs a and b, each a stage `grpo` of 3 updates of sessions, calls and metrics."""
    path = tmp_path / "runs"
    two_runs(path, loss=lambda update: 1.0 / (update + 1))
    return path


def part_of(project, table="sessions", run="a", stage="grpo"):
    generation = os.path.realpath(project / "store" / table / run / stage)
    return os.path.join(generation, sorted(n for n in os.listdir(generation) if n.endswith(".parquet"))[0])


def truncate(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    return data


def garble(path):
    data = open(path, "rb").read()
    with open(path, "wb") as f:  # the footer's magic and length intact: the bytes between are not
        f.write(data[:4] + bytes(b ^ 0x5A for b in data[4:-8]) + data[-8:])
    return data


def dew(capsys, project, *args):
    code = cli.main(["--store", str(project), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("damage", [truncate, garble])
def test_a_damaged_part_is_named_and_blocks_nothing_else(project, damage, capsys):
    path = part_of(project)
    damage(path)
    store = Store(project)
    assert store.rows("SELECT count(*) FROM metrics")[1] == [(6,)]  # other tables
    assert store.rows("SELECT count(*) FROM sessions WHERE run = 'b'")[1] == [(3 * PER_UPDATE,)]  # other runs
    assert store.rows("SELECT count(*) FROM calls")[1] == [(6 * PER_UPDATE,)]
    with pytest.raises(StoreDamaged) as raised:  # this run's sessions: the file, named
        store.sql("SELECT count(*) FROM sessions")
    message = str(raised.value)
    assert path in message and "table sessions, run a, stage grpo" in message and "dew store repair" in message
    code, out, err = dew(capsys, project, "sql", "SELECT sum(reward) FROM sessions WHERE run = 'a'")
    assert code == 1 and path in err and len(err.splitlines()) == 1
    code, out, err = dew(capsys, project, "--json", "runs")  # dew runs: every run, the file named
    assert code == 0 and sorted(r["run"] for r in json.loads(out)) == ["a", "b"]
    assert path in err and "dew store repair" in err
    with store.writer("c", background=False) as writer:  # a new run writes, in this process ...
        writer.start()
        with writer.stage("grpo") as stage:
            stage.sessions(sessions_for(0, 2), update=0)
        writer.finish()
    env = dict(os.environ, PYTHONPATH=ROOT)  # ... and in a new one
    done = subprocess.run([sys.executable, WORKER, str(project), "d", "grpo", "--steps", "2", "--prompts", "2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert store.rows("SELECT run, count(*) FROM sessions WHERE run <> 'a' GROUP BY run ORDER BY run")[1] == [
        ("b", 3 * PER_UPDATE), ("c", PER_UPDATE), ("d", 2 * PER_UPDATE)]
    raw = duckdb.connect(str(project / "dew.duckdb"), read_only=True)  # the duckdb client routes around it too
    assert raw.sql("SELECT count(*) FROM sessions WHERE run = 'b'").fetchall() == [(3 * PER_UPDATE,)]
    with pytest.raises(duckdb.Error, match="damaged file"):
        raw.sql("SELECT count(*) FROM sessions").fetchall()
    raw.close()


def test_check_lists_and_repair_moves_aside_with_a_record(project, capsys):
    path = part_of(project)
    original = garble(path)
    damaged = open(path, "rb").read()
    code, out, _ = dew(capsys, project, "store", "check")
    assert code == 1 and path in out and "table sessions, run a, stage grpo" in out
    code, out, _ = dew(capsys, project, "--json", "store", "check")
    found, = json.loads(out)
    assert (found["kind"], found["table"], found["run"], found["stage"]) == ("part", "sessions", "a", "grpo")
    code, out, err = dew(capsys, project, "store", "repair")
    assert code == 0, out + err
    log = [json.loads(line) for line in open(project / "store" / ".quarantine" / "log.jsonl")]
    assert [(e["path"], e["kind"], e["run"]) for e in log] == [(os.path.relpath(path, project / "store"), "part", "a")]
    kept = project / "store" / log[0]["moved_to"]
    assert open(kept, "rb").read() == damaged and damaged != original  # kept byte for byte, not deleted
    assert dew(capsys, project, "store", "check")[0] == 0
    store = Store(project)  # the stream lost that part's rows and nothing else; every query reads
    assert store.rows("SELECT count(*) FILTER (run = 'a'), count(*) FILTER (run = 'b') FROM sessions")[1] == [
        (3 * PER_UPDATE - _rows_in(original), 3 * PER_UPDATE)]  # a finished stage: one part, all of a's
    with store.writer("a", background=False) as writer, writer.stage("grpo") as stage:  # its writer resumes
        stage.sessions(sessions_for(5, 2), update=5)
    assert store.rows("SELECT count(*) FROM sessions WHERE run = 'a' AND update = 5")[1] == [(PER_UPDATE,)]


def _rows_in(data):
    return pq.read_metadata(io.BytesIO(data)).num_rows


def test_a_restored_part_reads_whole_again(project):
    path = part_of(project)
    original = truncate(path)
    store = Store(project)
    with pytest.raises(StoreDamaged):
        store.sql("SELECT count(*) FROM sessions")
    with open(path, "wb") as f:
        f.write(original)
    assert store.rows("SELECT count(*) FROM sessions")[1] == [(6 * PER_UPDATE,)]
    assert store.damaged() == []


def test_a_garbled_snapshot_is_replaced_and_kept_aside(project, capsys):
    current = snapshot.current(str(project / "store"))
    os.chmod(current, 0o644)
    garble(current)
    code, out, err = dew(capsys, project, "sql", "SELECT count(*) AS n FROM sessions")
    assert code == 0, err
    assert snapshot.current(str(project / "store")) != current
    log = [json.loads(line) for line in open(project / "store" / ".quarantine" / "log.jsonl")]
    assert log[0]["kind"] == "snapshot" and "not a valid DuckDB database" in log[0]["reason"]
    raw = duckdb.connect(str(project / "dew.duckdb"), read_only=True)
    assert raw.sql("SELECT count(*) FROM sessions").fetchall() == [(6 * PER_UPDATE,)]


def test_a_deleted_generation_is_an_error_naming_it_not_zero_rows(project, capsys):
    import shutil

    generation = os.path.realpath(project / "store" / "metrics" / "a" / "grpo")
    shutil.rmtree(generation)
    store = Store(project)
    with pytest.raises(StoreDamaged, match=f"{generation}.*run a, stage grpo.*missing"):
        store.sql("SELECT count(*) FROM metrics")
    assert store.rows("SELECT count(*) FROM metrics WHERE run = 'b'")[1] == [(3,)]
    code, out, _ = dew(capsys, project, "store", "check")
    assert code == 1 and generation in out
    assert dew(capsys, project, "store", "repair")[0] == 0
    assert store.rows("SELECT run, count(*) FROM metrics GROUP BY run")[1] == [("b", 3)]


def test_a_failed_publish_raises_its_own_error_and_the_next_one_works(project, monkeypatch):
    store_dir = str(project / "store")
    real = snapshot.view_statements
    monkeypatch.setattr(snapshot, "view_statements",
                        lambda *a, **k: [*real(*a, **k)[:2], "CREATE VIEW broken AS SELECT * FROM nowhere"])
    os.remove(snapshot.current(store_dir)[: -len(".duckdb")] + ".json")  # so that a publish must build
    with pytest.raises(duckdb.CatalogException, match="nowhere"):  # the cause, not "transaction aborted"
        snapshot.publish(store_dir)
    monkeypatch.setattr(snapshot, "view_statements", real)
    assert os.path.exists(snapshot.publish(store_dir))  # the same process publishes again
    assert Store(project).rows("SELECT count(*) FROM metrics")[1] == [(6,)]


def test_a_damaged_runs_row_leaves_the_other_runs_listed_and_a_new_run_shows(project, capsys):
    row = project / "store" / "runs" / "a" / "run" / "run.parquet"
    truncate(row)
    store = Store(project)
    assert store.rows("SELECT run FROM runs WHERE run = 'b'")[1] == [("b",)]
    with pytest.raises(StoreDamaged, match=f"{row} \\(table runs, run a\\)"):
        store.sql("SELECT * FROM runs")
    with store.writer("c", background=False) as writer:
        writer.start()
        writer.finish()
    assert store.rows("SELECT run FROM runs WHERE run <> 'a' ORDER BY run")[1] == [("b",), ("c",)]
    code, out, err = dew(capsys, project, "--json", "runs")
    assert code == 0 and sorted(r["run"] for r in json.loads(out)) == ["b", "c"] and str(row) in err
    assert dew(capsys, project, "store", "repair")[0] == 0
    assert not row.exists() and store.rows("SELECT count(*) FROM runs")[1] == [(2,)]
