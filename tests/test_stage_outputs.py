"""What a finished training stage leaves behind and publishes: its last checkpoint only (said in
the log), and artifacts whose keys belong to the run, the curves artifact showing its PNG
embedded. One tiny SFT-only pipeline under Prefect's test harness."""

import base64
import os
import re

import pytest

pytest.importorskip("prefect")

from tasks.params import PipelineParams  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
TINY = dict(
    data=dict(train_problems=400, test_problems=20),
    model=dict(emb_features=32, num_layers=1, num_heads=2, mlp_features=64),
    sft=dict(steps=4, batch=4, log_every=1, checkpoint_every=1),
    evaluation=dict(batch=20, max_new_tokens=8, samples=1),
    stages=("sft",),
)


@pytest.fixture(scope="module")
def finished(prefect_harness, tmp_path_factory):
    from flows.pipeline import pipeline

    root = tmp_path_factory.mktemp("runs")
    return root, pipeline(PipelineParams(root=str(root), name="outputs", **TINY))


def artifacts_of(keys):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))


@pytest.mark.slow
def test_a_finished_stage_keeps_only_its_last_checkpoint_and_says_so(finished):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTextSearch
    from prefect.client.schemas.sorting import LogSort

    root, outcome = finished
    directories = {os.path.realpath(os.path.join(folder, "checkpoints"))
                   for folder, names, _ in os.walk(os.path.join(root, "outputs", "sft"))
                   if "checkpoints" in names}
    assert len(directories) == 1, directories
    checkpoints, = directories
    assert sorted(os.listdir(checkpoints)) == ["4"]  # saved at steps 1-4, training kept 3 and 4
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # logs reach the server from a background worker
    # Prefect's text search ORs space-separated words, so the phrase is quoted: unquoted, every log
    # with "the" matched, and this run's line fell past the first page once the worker had run enough.
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(text=LogFilterTextSearch(query='"kept the last checkpoint"')),
                                sort=LogSort.TIMESTAMP_DESC)
    lines = [log.message for log in logs if log.message.startswith("sft: kept the last checkpoint")
             and checkpoints in log.message]  # this run's line: the worker's other runs log theirs too
    assert lines, "no log line says what the stage kept"
    said = r"step 4 \([0-9.]+ MiB\), in .*checkpoints; removed the older step 3"
    assert re.search(said, lines[-1]), lines[-1]


@pytest.mark.slow
def test_the_stage_artifacts_are_keyed_by_run_and_the_curves_embed_their_png(finished):
    _, outcome = finished
    run = outcome["run"]
    keys = [f"{run}-sft-{what}" for what in ("progress", "metrics", "curves")]
    found = {a.key: a for a in artifacts_of(keys)}
    assert sorted(found) == sorted(keys)
    assert not artifacts_of(["sft-progress", "sft-metrics", "sft-curves"])  # no keys shared by runs
    curves = found[f"{run}-sft-curves"].data
    assert "file://" not in curves
    encoded, = re.findall(r"!\[sft curves\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", curves)
    image = base64.b64decode(encoded)
    assert image.startswith(PNG) and len(image) < 100_000
    assert "| loss |" in curves  # the metrics under the image
