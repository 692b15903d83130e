"""The `dew` command in a subprocess: `dew sql` (table, CSV, JSON), `dew runs`, `dew schema`, errors."""

import csv
import io
import json
import os
import subprocess
import sys
import time

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


def test_global_options_go_before_the_command_too(project):
    out = dew("--store", project, "sql", "SELECT count(*) AS n FROM metrics", "--csv")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["n", "4"]
    out = dew("--store", project, "--json", "runs")
    assert out.returncode == 0, out.stderr
    assert [row["stage"] for row in json.loads(out.stdout)] == ["sft"]
    after = dew("--store", "/nowhere", "sql", "SELECT count(*) AS n FROM metrics", "--store", project, "--csv")
    assert after.stdout.splitlines() == ["n", "4"], after.stderr  # the later one wins


def test_a_damaged_format_file_is_one_line_naming_it(tmp_path):
    Store(tmp_path).create()
    (tmp_path / "store" / "format.json").write_text("{not json")
    out = dew("sql", "SELECT 1", "--store", tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("dew: ") and str(tmp_path / "store" / "format.json") in out.stderr
    assert '{"format": 2}' in out.stderr  # what it should hold


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """A GRPO stage logging `reward`, an evaluation with greedy and sampled answers whose start
    was queued behind a slow write, and a stage whose writer went away after one record."""
    path = tmp_path_factory.mktemp("graded") / "runs"
    store = Store(path)
    with store.writer("g") as run:
        run.start()
        with run.stage("grpo", kind="grpo") as stage:
            stage.metrics(1, {"loss": 0.5, "reward": 0.25})
            stage.metrics(2, {"loss": 0.25, "reward": 0.75})
        run.worker.submit(lambda: time.sleep(0.5))  # the stage's start row waits behind this
        with run.stage("eval", kind="evaluate") as stage:
            greedy = [Evaluation(item=i, prompt="p", answer="a", score=float(i < 3), correct=i < 3)
                      for i in range(4)]
            drawn = [Evaluation(item=i, prompt="p", answer="a", score=float(i == 0), correct=i == 0,
                                temperature=1.0, sample=s) for s in (1, 2) for i in range(4)]
            stage.evaluations(greedy + drawn, step=2)
        stage = run.stage("cut", kind="grpo")
        stage.metrics(1, {"loss": 1.0})
        stage.close()  # no finish: the writer is gone, the stage shows as interrupted
        run.finish()
    return path


def runs_by_stage(path):
    out = dew("runs", "--store", path, "--json")
    assert out.returncode == 0, out.stderr
    return {row["stage"]: row for row in json.loads(out.stdout)}


def test_dew_runs_shows_the_grpo_reward(graded):
    rows = runs_by_stage(graded)
    assert rows["grpo"]["reward"] == 0.75 and rows["grpo"]["loss"] == 0.25


def test_dew_runs_shows_greedy_and_sampled_accuracy_apart(graded):
    rows = runs_by_stage(graded)
    assert (rows["eval"]["accuracy"], rows["eval"]["sampled"]) == (0.75, 0.25)
    assert rows["grpo"]["sampled"] is None


def test_dew_runs_seconds_are_never_negative(graded):
    rows = runs_by_stage(graded)
    assert all(row["seconds"] >= 0 for row in rows.values()), rows
    table = dew("runs", "--store", graded)
    assert " -0 " not in table.stdout and "-0\n" not in table.stdout, table.stdout


def test_an_interrupted_stages_seconds_end_at_its_last_record(graded):
    rows = runs_by_stage(graded)
    assert rows["cut"]["stage_status"] == "interrupted"
    time.sleep(1.5)
    assert runs_by_stage(graded)["cut"]["seconds"] == rows["cut"]["seconds"]  # not until now
