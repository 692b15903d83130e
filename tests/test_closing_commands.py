"""The commands the pipeline's closing message prints work exactly as printed, from the directory
it ran in, naming the store the run used; `make ui` lists every deployment it serves.

(tests/test_pipeline.py runs the commands of a real pipeline's closing message too.)
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("prefect")

from dew_lib.store import Store  # noqa: E402
from flows.pipeline import store_commands  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
RUN = "demo-1a2b3c4d"


@pytest.fixture
def project(tmp_path):
    """A project directory whose store holds one run with a finished SFT stage."""
    with Store(str(tmp_path / "runs")).writer(RUN) as run:
        run.start(params={"name": "demo"})
        with run.stage("sft", kind="sft") as stage:
            stage.metrics(1, {"loss": 2.0})
            stage.finish("completed", {"loss": 2.0})
        run.finish("completed")
    return tmp_path


def shell(command: str, cwd) -> str:
    """`command` run by a shell in `cwd`, as a user pastes it; its output."""
    done = subprocess.run(command, shell=True, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    return done.stdout


def test_from_the_project_directory_the_store_is_runs_and_dew_this_environments(project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as after `make run`: .venv/bin is not on PATH
    dew = os.path.join(BIN, "dew")
    listing, query = store_commands(str(project / "runs"), RUN)
    assert listing == f"{dew} runs --store runs"
    assert query == f"{dew} sql --store runs \"SELECT stage, kind, status, attempt FROM stages WHERE run = '{RUN}' " \
                    "ORDER BY started_at\""
    assert RUN in shell(listing, project)
    assert shell(query, project).splitlines() == ["stage | kind | status    | attempt",
                                                  "------+------+-----------+--------",
                                                  "sft   | sft  | completed |       1",
                                                  "(1 row)"]


def test_from_the_repository_the_printed_dew_is_the_venvs_and_the_store_absolute(project, monkeypatch):
    if os.path.dirname(BIN) != os.path.join(ROOT, ".venv"):
        pytest.skip("the tests run outside the repository's .venv")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    listing, query = store_commands(str(project / "runs"), RUN)
    assert listing == f".venv/bin/dew runs --store {project}/runs"  # what `make run` prints, with its root
    assert RUN in shell(listing, ROOT) and "(1 row)" in shell(query, ROOT)


def test_with_dew_on_path_the_plain_name_is_printed(project, monkeypatch):
    monkeypatch.chdir(project)
    monkeypatch.setenv("PATH", f"{BIN}:/usr/bin:/bin")  # e.g. after `source .venv/bin/activate`
    listing, _ = store_commands(str(project / "runs"), RUN)
    assert listing == "dew runs --store runs"
    assert RUN in shell(listing, project)


def test_make_ui_lists_every_deployment_it_serves():
    sys.path.insert(0, os.path.join(ROOT, "deployments"))
    try:
        import serve
        import ui
    finally:
        sys.path.pop(0)
    served = [deployment.name for deployment in serve.deployments()]
    assert served == ["pipeline", "tool-episodes", "flow-grpo", "retrain-nightly"]
    assert ui.banner("http://127.0.0.1:4200") == (
        "Prefect UI: http://127.0.0.1:4200  (deployments: pipeline, tool-episodes, flow-grpo, retrain-nightly; "
        "Ctrl-C stops)")
    assert ui.deployment_names() == served
