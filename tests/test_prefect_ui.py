"""What a stage publishes, looked at in the Prefect UI: a real server, a short flow that publishes
a stage's curves through tasks/ui.py, and headless Chromium (tests/browser.py) on the artifact's
page in both of Prefect's UIs (v2, which the server's front page opens, and v1), which must show
the curves image loaded and the metrics table.

DEW_UPDATE_DOCS=1 also saves the screenshot as docs/prefect_curves.png (the README shows it).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from browser import Browser

from tasks.lifetimes import bound_child, free_port, stop, wait_until_healthy

# bound_child's parent-death signal needs a preexec_fn, so a fork, which JAX (imported by
# conftest) warns about; the child only execs the server or the browser.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = "ui-check-1a2b3c4d"
PUBLISH = textwrap.dedent("""
    import math, sys
    from prefect import flow, task
    from tasks.ui import plot_curves, publish_stage

    @task
    def train(stage: str, directory: str, run: str) -> None:
        history = [(s, {"loss": 2.5 * math.exp(-s / 60) + 0.05, "reward": 1 - math.exp(-s / 90),
                        "accuracy": min(0.97, s / 250)}) for s in range(10, 410, 10)]
        plot = plot_curves(history, f"{directory}/curves.png", f"{stage} ({stage})")
        publish_stage(stage, history[-1][1], plot)

    @flow(name="curves")
    def curves(directory: str, run: str) -> None:
        train("sft", directory, run)

    curves(sys.argv[1], sys.argv[2])
""")
# the page has the embedded PNG decoded (naturalWidth > 0) and the metrics table rendered
SHOWN = """(() => {
    const images = [...document.querySelectorAll('img')]
        .filter(i => i.src.startsWith('data:image/png') && i.complete && i.naturalWidth > 0);
    const tables = [...document.querySelectorAll('table')].map(t => t.innerText)
        .filter(text => text.includes('loss') && text.includes('accuracy'));
    return images.length > 0 && tables.length > 0 &&
        {width: images[0].naturalWidth, height: images[0].naturalHeight, table: tables[0]};
})()"""


def api_json(api: str, path: str, body: dict) -> list:
    request = urllib.request.Request(f"{api}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


@pytest.mark.slow
def test_the_curves_artifact_shows_its_image_and_metrics_in_the_prefect_ui(tmp_path, chromium):
    port = free_port()
    ui, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
           "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PYTHONPATH": ROOT}
    log_path = tmp_path / "services.log"
    server = None
    with open(log_path, "w") as log:
        try:
            server = bound_child([os.path.join(os.path.dirname(sys.executable), "prefect"), "server",
                                  "start", "--host", "127.0.0.1", "--port", str(port)],
                                 env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            wait_until_healthy(api, server, 300)
            directory = tmp_path / "runs" / "demo" / "sft"
            published = subprocess.run([sys.executable, "-c", PUBLISH, str(directory), RUN], env=env,
                                       cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert published.returncode == 0, published.stderr[-3000:]
            key = f"{RUN}-sft-curves"
            artifacts = api_json(api, "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}})
            assert len(artifacts) == 1, f"no artifact {key!r}: {published.stderr[-2000:]}"
            metrics = {"artifacts": {"key": {"any_": [f"{RUN}-sft-metrics"]}}}
            assert api_json(api, "/artifacts/filter", metrics)
            artifact = artifacts[0]
            assert "data:image/png;base64," in artifact["data"] and "file://" not in artifact["data"]
            assert len(artifact["data"]) < 100_000
            shown = {}
            with Browser(chromium, str(tmp_path / "chromium"), width=1280, height=760) as browser:
                for ui_version, prefix in (("v2", "/v2"), ("v1", "")):  # v2 is what / opens
                    browser.open(f"{ui}{prefix}/artifacts/artifact/{artifact['id']}")
                    shown[ui_version] = browser.wait_for(SHOWN, 120, f"the {ui_version} UI rendering the "
                                                         "curves image and the metrics table")
                    browser.screenshot(str(tmp_path / f"prefect_curves_{ui_version}.png"))
        finally:
            stop(server, grace=20)
    for ui_version, page in shown.items():
        assert (page["width"], page["height"]) == (960, 240), ui_version
        assert "0.97" in page["table"] and "reward" in page["table"], ui_version
        assert (tmp_path / f"prefect_curves_{ui_version}.png").stat().st_size > 10_000
    if os.environ.get("DEW_UPDATE_DOCS") == "1":
        shutil.copyfile(tmp_path / "prefect_curves_v2.png", os.path.join(ROOT, "docs", "prefect_curves.png"))
