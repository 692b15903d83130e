"""A pipeline run looked at in TensorBoard: a short SFT, DPO and GRPO run with the tensorboard
tracker on, `tensorboard` serving its log directory, and headless Chromium (tests/browser.py) on
the time-series dashboard, which must draw the stages' curves. TensorBoard's own HTTP API must
hold the store's steps and values.

DEW_UPDATE_DOCS=1 also saves the screenshot as docs/tensorboard.png (docs/trackers.md shows it).
"""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
from browser import Browser
from test_pipeline import TINY

from tasks.lifetimes import bound_child, free_port, stop

pytest.importorskip("tensorboard")
# bound_child's parent-death signal needs a preexec_fn, so a fork, which JAX (imported by
# conftest) warns about; the child only execs the server or the browser.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("sft", "dpo", "grpo")
RUN_PARAMS = dict(TINY, stages=STAGES, tracking=dict(trackers=["tensorboard"]),
                  sft=dict(steps=40, batch=4, log_every=2, checkpoint_every=40),
                  dpo=dict(steps=10, batch=4, log_every=1, checkpoint_every=10),
                  grpo=dict(steps=6, batch=2, groups=4, log_every=1, checkpoint_every=6, max_new_tokens=8))
# the dashboard drew a chart card per shown tag, each with its plot, and lists every stage's run
DRAWN = """((runs) => {
    if (!document.body) return false;  // the page is not there yet
    const cards = [...document.querySelectorAll('scalar-card')]
        .filter(card => card.querySelector('line-chart canvas, line-chart svg'));
    const text = document.body.innerText;
    return cards.length >= 3 && runs.every(run => text.includes(run)) && cards.length;
})(%s)"""


def tensorboard_json(base: str, path: str, **query):
    with urllib.request.urlopen(f"{base}{path}?{urllib.parse.urlencode(query)}", timeout=30) as reply:
        return json.loads(reply.read())


@pytest.mark.slow
def test_tensorboard_draws_the_pipeline_s_stages_with_the_store_s_values(prefect_harness, tmp_path, chromium):
    from dew_lib.store import Store
    from flows.pipeline import pipeline
    from tasks.params import PipelineParams

    outcome = pipeline(PipelineParams(root=str(tmp_path / "runs"), name="tracked", **RUN_PARAMS))
    run, logs = outcome["run"], str(tmp_path / "runs" / "tracked" / "tensorboard")
    store = Store(str(tmp_path / "runs"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "tensorboard.log", "w") as log:
        server = bound_child([os.path.join(os.path.dirname(sys.executable), "tensorboard"), "--logdir", logs,
                              "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        wanted = [f"{run}/{stage}" for stage in STAGES]
        deadline, runs = time.monotonic() + 120, []
        while time.monotonic() < deadline and not set(wanted) <= set(runs):
            assert server.poll() is None, (tmp_path / "tensorboard.log").read_text()[-2000:]
            try:
                runs = tensorboard_json(base, "/data/runs")
            except OSError:
                pass
            time.sleep(1)
        assert set(wanted) <= set(runs), runs
        for stage in STAGES:  # TensorBoard's own API: the store's loss at each logged step, as float32
            stored = store.rows("SELECT step, value FROM metrics WHERE run = ? AND stage = ? AND name = 'loss' "
                                "ORDER BY step", [run, stage])[1]
            shown = tensorboard_json(base, "/data/plugin/scalars/scalars", run=f"{run}/{stage}", tag="loss")
            assert [(step, value) for _, step, value in shown] == [(s, float(np.float32(v))) for s, v in stored]
        screenshot = tmp_path / "tensorboard.png"
        with Browser(chromium, str(tmp_path / "chromium"), width=1400, height=900) as browser:
            browser.open(f"{base}/?darkMode=false&tagFilter=%5E(loss%7Caccuracy%7Crewards%2Fmargin)%24#timeseries")
            cards = browser.wait_for(DRAWN % json.dumps(wanted), 120, "the time series of every stage's loss")
            browser.evaluate("document.querySelector('button[aria-label=\"Close side pane\"]')?.click()")
            time.sleep(2)  # the charts' last frame
            browser.screenshot(str(screenshot))
    finally:
        stop(server, grace=10)
    assert cards == 3  # loss (every stage), accuracy (SFT) and rewards/margin (DPO)
    assert screenshot.stat().st_size > 10_000
    if os.environ.get("DEW_UPDATE_DOCS") == "1":
        shutil.copyfile(screenshot, os.path.join(ROOT, "docs", "tensorboard.png"))
