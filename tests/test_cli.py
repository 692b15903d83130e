"""The `dew` command in a subprocess: `dew sql` (table, CSV, JSON), `dew runs`, `dew schema`, errors."""

import csv
import io
import json
import os
import subprocess
import sys

import pytest

from dew_lib.store import Evaluation, Store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALLED = os.path.join(os.path.dirname(sys.executable), "dew")


def dew(*args, command=(sys.executable, "-m", "dew_lib.cli"), cwd=None):
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    path = tmp_path_factory.mktemp("project") / "runs"
    store = Store(path)
    with store.writer("demo") as run:
        run.start(params={"seed": 0})
        with run.stage("sft", kind="sft") as stage:
            for step, loss in ((10, 2.5), (20, 1.25)):
                stage.metrics(step, {"loss": loss, "accuracy": 0.5})
            stage.evaluations([Evaluation(item=i, prompt=f"{i}+{i}=", answer=str(2 * i if i else 1),
                                          reference=str(2 * i), score=float(i > 0)) for i in range(4)], step=20)
        run.finish()
    return path


def test_dew_sql_prints_a_table_csv_and_json(project):
    query = "SELECT step, value FROM metrics WHERE name = 'loss' ORDER BY step"
    table = dew("sql", query, "--store", project)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines() == ["step | value", "-----+------", "  10 |   2.5", "  20 |  1.25",
                                         "(2 rows)"]
    as_csv = dew("sql", query, "--store", project, "--csv")
    assert list(csv.reader(io.StringIO(as_csv.stdout))) == [["step", "value"], ["10", "2.5"], ["20", "1.25"]]
    as_json = dew("sql", query, "--store", project / "dew.duckdb", "--json")  # the database path works too
    assert json.loads(as_json.stdout) == [{"step": 10, "value": 2.5}, {"step": 20, "value": 1.25}]


def test_dew_runs_lists_stages_status_and_headline_metrics(project):
    out = dew("runs", "--store", project, "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert {k: row[k] for k in ("run", "status", "stage", "kind", "stage_status", "attempt", "steps", "loss",
                                "accuracy")} == {"run": "demo", "status": "completed", "stage": "sft", "kind": "sft",
                                                 "stage_status": "completed", "attempt": 1, "steps": 20,
                                                 "loss": 1.25, "accuracy": 0.75}


def test_bad_sql_and_a_missing_store_exit_with_status_1_and_a_message(project, tmp_path):
    syntax = dew("sql", "SELEC step FROM metrics", "--store", project)
    assert syntax.returncode == 1 and "syntax error" in syntax.stderr and syntax.stdout == ""
    unknown = dew("sql", "SELECT * FROM rollouts", "--store", project)
    assert unknown.returncode == 1 and "rollouts" in unknown.stderr
    missing = dew("sql", "SELECT 1", "--store", tmp_path / "nothing")
    assert missing.returncode == 1 and "no run store at" in missing.stderr
    assert not (tmp_path / "nothing").exists()  # reading never creates a store
    assert dew("runs", "--store", tmp_path / "nothing").returncode == 1


def test_the_default_store_is_runs_in_the_working_directory(project):
    out = dew("sql", "SELECT count(*) AS n FROM evaluations", "--csv", cwd=project.parent)
    assert out.stdout.splitlines() == ["n", "4"], out.stderr


def test_dew_schema_describes_every_table():
    out = dew("schema", "sessions")
    assert out.returncode == 0 and out.stdout.startswith("sessions: one row per recorded rollout session")
    assert "behavior_log_probs" not in out.stdout and "latency" in out.stdout
    assert dew("schema", "nope").returncode == 1


@pytest.mark.skipif(not os.path.exists(INSTALLED), reason=f"no installed dew command at {INSTALLED}")
def test_the_installed_dew_command_runs(project):
    out = dew("sql", "SELECT run, status FROM runs", "--store", project, "--csv", command=(INSTALLED,))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["run,status", "demo,completed"]
