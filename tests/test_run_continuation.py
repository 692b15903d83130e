"""Which run a pipeline records under: a rerun with the same parameters and inputs as the last run
in its directory is that run's next attempt, whether it finished or not; other parameters or
inputs start a new one; two live pipelines never share a directory."""

import pytest

pytest.importorskip("prefect")

from dew_lib.store import Store, StoreBusy  # noqa: E402
from tasks.records import pipeline_run  # noqa: E402


def start(tmp_path, params, inputs=None):
    return pipeline_run(str(tmp_path), str(tmp_path / "demo"), "demo", params, inputs=inputs)


def runs(tmp_path):
    return Store(str(tmp_path)).rows("SELECT run, status, attempts FROM runs ORDER BY started_at")[1]


def test_a_rerun_with_the_same_parameters_is_the_same_run_finished_or_not(tmp_path):
    with pytest.raises(RuntimeError), start(tmp_path, {"lr": 1}) as (first, continued):
        assert not continued
        raise RuntimeError("killed")
    assert runs(tmp_path) == [(first, "failed", 1)]
    with start(tmp_path, {"lr": 1}) as (again, continued):
        assert (again, continued) == (first, True)
        assert runs(tmp_path) == [(first, "running", 2)]
    assert runs(tmp_path) == [(first, "completed", 2)]
    with start(tmp_path, {"lr": 1}) as (after, continued):  # finished: its next attempt all the same
        assert (after, continued) == (first, True)
    assert runs(tmp_path) == [(first, "completed", 3)]


def test_other_parameters_start_a_new_run(tmp_path):
    with pytest.raises(RuntimeError), start(tmp_path, {"lr": 1}) as (first, _):
        raise RuntimeError("killed")
    with start(tmp_path, {"lr": 2}) as (other, continued):
        assert other != first and not continued
    assert {status for _, status, _ in runs(tmp_path)} == {"failed", "completed"}


def test_other_inputs_start_a_new_run(tmp_path):
    with start(tmp_path, {"lr": 1}, {"chat_path": [120, 1.5]}) as (first, _):
        pass
    with start(tmp_path, {"lr": 1}, {"chat_path": [120, 1.5]}) as (again, continued):
        assert (again, continued) == (first, True)
    with start(tmp_path, {"lr": 1}, {"chat_path": [121, 2.5]}) as (edited, continued):  # the file changed
        assert edited != first and not continued
    assert runs(tmp_path) == [(first, "completed", 2), (edited, "completed", 1)]


def test_a_second_live_pipeline_in_the_same_directory_is_refused(tmp_path):
    with start(tmp_path, {"lr": 1}):
        with pytest.raises(StoreBusy, match="pipeline 'demo'"), start(tmp_path, {"lr": 1}):
            pass
