"""TensorBoard, MLflow and W&B hold what the run store holds, and a failing tracker never stops a stage.

The sinks are driven as the Trainer drives them (begin, write, note, checkpoint, close, then the
stage's `finish`) and read back with each tracker's own reader: tensorboard's EventAccumulator,
MlflowClient against a real `mlflow server` on SQLite that the test starts and stops, and the
records of W&B's offline `.wandb` file parsed with wandb's own protobuf messages. One tiny SFT
pipeline with all three trackers checks that what they hold equals the store's `metrics` and
`stages.params`, and that the store's `trackers` table and the trackers' names and tags lead to
each other.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from dew_lib.diffusion.preview import encode_png
from dew_lib.train.trackers import (
    MLflowTracker,
    TensorBoardTracker,
    TrackerOptions,
    TrackerRun,
    Trackers,
    WandbTracker,
    build,
    flat,
)

PARAMS = {"steps": 4, "learning_rate": 0.5, "lora": {"rank": 0, "targets": ["q", "v"]}, "mesh": ""}
WINDOWS = [(2, {"loss": 1.25, "val/loss": 2.5}), (4, {"loss": 0.75})]  # exact in float32 too


class Warnings(logging.Handler):
    """A logger's warnings, kept."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.logger = logging.getLogger(f"trackers-test-{id(self)}")
        self.logger.addHandler(self)
        self.logger.propagate = False

    def emit(self, record):
        self.messages.append(record.getMessage())


def drive(tracker, files: dict[str, str] | None = None, status: str = "completed") -> None:
    """The calls a stage makes: fit's hooks, then the stage's end with its files."""
    tracker.begin(0, 4)
    for step, metrics in WINDOWS:
        tracker.write(step, metrics)
    tracker.note(4, "nothing left to train")
    tracker.checkpoint(4, "/tmp/checkpoints/4")
    tracker.close()
    tracker.finish(status, files)


def picture(tmp_path) -> tuple[str, bytes]:
    pixels = np.zeros((6, 10, 3), np.uint8)
    pixels[:, :5, 0] = 255
    data = encode_png(pixels)
    path = tmp_path / "curves.png"
    path.write_bytes(data)
    return str(path), data


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ----- reading each tracker back with its own tools ----------------------------------------------
def tensorboard_events(directory: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(directory, size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return events


def tensorboard_text(events, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]


def wandb_records(run_dir: str, wait: float = 30.0):
    """Every record of a W&B run's `.wandb` file, once it ends with the run's exit record.

    wandb-core writes the file from its own process and `finish` can return before the records
    reach the disk, so the file is read again until it is whole, for at most `wait` seconds."""
    from google.protobuf.message import DecodeError

    path, = glob.glob(os.path.join(run_dir, "*.wandb"))
    deadline = time.monotonic() + wait
    while True:
        try:
            records = parse_wandb_log(path)
            if records and records[-1].WhichOneof("record_type") == "exit":
                return records
        except DecodeError:  # a record still being written
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} holds no exit record {wait} s after the run finished")
        time.sleep(0.05)


def parse_wandb_log(path: str):
    """The records of a `.wandb` file: LevelDB's log format (32 KiB blocks of checksummed
    fragments) after W&B's 7-byte header, each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < 7:  # not even the header yet
        return []
    assert data[:4] == b":W&B"
    records, pending, at, block = [], b"", 7, 32768
    while at + 7 <= len(data):
        left = block - at % block
        if left < 7:  # a block's tail too short for a fragment header is padding
            at += left
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if at + 7 + length > len(data):  # a fragment still being written
            break
        pending += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: str) -> list[tuple[int, dict[str, float]]]:
    rows = []
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            rows.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return rows


def wandb_run_record(run_dir: str):
    runs = [r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    return runs[0]


# ----- the sinks on their own --------------------------------------------------------------------
def test_tensorboard_holds_the_scalars_parameters_notes_and_curves_at_their_steps(tmp_path):
    pytest.importorskip("tensorboard")
    started: list[tuple[int, TrackerRun]] = []
    tracker = TensorBoardTracker(str(tmp_path / "tb"), "demo-1", "sft", PARAMS,
                                 on_start=lambda step, run: started.append((step, run)))
    png, data = picture(tmp_path)
    drive(tracker, {"curves": png})

    assert started == [(0, TrackerRun("tensorboard", os.path.join("demo-1", "sft"), "demo-1/sft",
                                      str(tmp_path / "tb")))]
    events = tensorboard_events(str(tmp_path / "tb" / "demo-1" / "sft"))
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(2, 1.25), (4, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 2.5)]
    (step, shown), = tensorboard_text(events, "params")
    assert step == 0 and json.loads(shown.strip("`\n")) == {"run": "demo-1", "stage": "sft", "params": PARAMS}
    assert tensorboard_text(events, "notes") == [(4, "nothing left to train")]
    assert tensorboard_text(events, "checkpoints") == [(4, "step 4: /tmp/checkpoints/4")]
    assert tensorboard_text(events, "status") == [(4, "completed")]
    image, = events.Images("curves")
    assert (image.step, image.height, image.width, image.encoded_image_string) == (4, 6, 10, data)


def test_the_hparams_tensorboard_lists_are_the_flat_parameters(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.hparams import metadata

    drive(TensorBoardTracker(str(tmp_path), "demo-1", "sft", PARAMS))
    events = tensorboard_events(str(tmp_path / "demo-1" / "sft"))
    content = events.SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data.content
    info = metadata.parse_session_start_info_plugin_data(content)
    values = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    assert values == {"dew.run": "demo-1", "dew.stage": "sft", "steps": 4.0, "learning_rate": 0.5,
                      "lora.rank": 0.0, "lora.targets": '["q", "v"]', "mesh": ""}


def test_wandb_writes_an_offline_run_with_the_config_and_history_by_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    started: list[tuple[int, TrackerRun]] = []
    tracker = WandbTracker("dew-tests", None, str(tmp_path), "demo-1", "sft", PARAMS,
                           on_start=lambda step, run: started.append((step, run)))
    drive(tracker)

    (step, run), = started
    run_dir, = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert (step, run.tracker, run.name, run.location) == (0, "wandb", "demo-1/sft", run_dir)
    assert run_dir.endswith("-" + run.id)
    assert wandb_history(run_dir) == WINDOWS
    record = wandb_run_record(run_dir)
    config = {u.key: json.loads(u.value_json) for u in record.config.update if u.key != "_wandb"}
    assert config == {**flat(PARAMS), "dew.run": "demo-1", "dew.stage": "sft", "dew.first_step": 0}
    assert (record.run_id, record.display_name, record.run_group, list(record.tags)) == (
        run.id, "demo-1/sft", "demo-1", ["demo-1", "sft"])


def test_wandb_is_offline_unless_its_option_or_wandb_mode_says_otherwise(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert WandbTracker("p", None, ".", "r", "s", {}).mode == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbTracker("p", None, ".", "r", "s", {}).mode == "disabled"
    assert WandbTracker("p", "offline", ".", "r", "s", {}).mode == "offline"  # the option wins


def test_a_tracker_whose_package_is_missing_warns_once_and_the_others_go_on(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    caught = Warnings()
    options = TrackerOptions(trackers=["wandb", "tensorboard"], wandb_dir=str(tmp_path))
    started: list = []
    with Trackers.open(options, run="demo-1", stage="sft", params=PARAMS, output=str(tmp_path),
                       on_start=lambda step, run: started.append(run.tracker), logger=caught.logger) as trackers:
        for sink in trackers.sinks:
            drive(sink)
    assert caught.messages == [
        "wandb tracker stopped for stage sft of run demo-1 (while it started): ModuleNotFoundError: import of "
        "wandb halted; None in sys.modules; install it with pip install 'dew[wandb]'. The stage goes on; its "
        "metrics are in the run store"]
    assert started == ["tensorboard"]  # the store records only the runs that started
    events = tensorboard_events(str(tmp_path / "tensorboard" / "demo-1" / "sft"))
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(2, 1.25), (4, 0.75)]


def test_a_tracker_on_a_dead_server_warns_once_and_the_training_completes_with_every_row_stored(tmp_path):
    pytest.importorskip("mlflow")
    import jax
    import optax
    from conftest import tiny_model

    from dew_lib import Dataset, LMObjective, Trainer
    from dew_lib.store import Store
    from dew_lib.train.sinks import MemorySink

    caught = Warnings()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    tracker, = build(TrackerOptions(trackers=["mlflow"], mlflow_tracking_uri=dead), run="demo-1", stage="sft",
                     params=PARAMS, output=str(tmp_path), logger=caught.logger)
    rng = np.random.default_rng(0)
    batches = [{"text": rng.integers(1, 32, size=(2, 9)).astype(np.int32),
                "text_segment_ids": np.ones((2, 9), np.int32)} for _ in range(4)]
    trainer = Trainer(LMObjective(tiny_model(), seq_len=8), optax.sgd(0.1), key=jax.random.key(0))
    memory = MemorySink()
    store = Store(tmp_path / "store")
    with store.writer("demo-1") as run, run.stage("sft", kind="sft") as stage:
        trainer.fit(Dataset(train=lambda partition: iter(batches), batch=2), steps=4, log_every=1,
                    sinks=[stage.sink(), memory, tracker])
        tracker.finish("completed")
    assert len(caught.messages) == 1 and "mlflow tracker stopped for stage sft of run demo-1 (while it started)" \
        in caught.messages[0], caught.messages
    assert [step for step, _ in memory.history] == [1, 2, 3, 4]
    stored = store.rows("SELECT step, value FROM metrics WHERE name = 'loss' ORDER BY step")[1]
    assert stored == [(step, metrics["loss"]) for step, metrics in memory.history]
    assert store.rows("SELECT count(*) FROM trackers")[1] == [(0,)]


def test_options_refuse_a_tracker_named_twice_and_place_empty_directories_under_the_run(tmp_path):
    with pytest.raises(ValueError, match="trackers names a tracker twice"):
        TrackerOptions(trackers=["wandb", "wandb"])
    with pytest.raises(ValueError):
        TrackerOptions(trackers=["neptune"])
    resolved = TrackerOptions(trackers=["tensorboard"]).resolved(str(tmp_path))
    assert (resolved.tensorboard_dir, resolved.wandb_dir) == (str(tmp_path / "tensorboard"), str(tmp_path))
    assert build(None, run="r", stage="s", params={}) == [] == build(TrackerOptions(), run="r", stage="s", params={})


def test_turning_a_tracker_on_continues_the_same_run():
    from tasks.params import PipelineParams
    from tasks.records import run_digest

    plain = PipelineParams().model_dump(mode="json")
    tracked = PipelineParams(tracking={"trackers": ["tensorboard"]}).model_dump(mode="json")
    assert run_digest(plain) == run_digest(tracked)
    assert run_digest(plain) != run_digest(PipelineParams(seed=1).model_dump(mode="json"))


# ----- a pipeline with every tracker -------------------------------------------------------------
TINY = dict(
    data=dict(train_problems=400, test_problems=20),
    model=dict(emb_features=32, num_layers=1, num_heads=2, mlp_features=64),
    sft=dict(steps=4, batch=4, log_every=1, checkpoint_every=2),
    evaluation=dict(batch=20, max_new_tokens=8, samples=0),
    stages=("sft",),
)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on SQLite with its artifacts on disk: started, waited for, stopped."""
    pytest.importorskip("mlflow")
    where = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server", "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{where}/mlflow.db",
               "--artifacts-destination", str(where / "artifacts")]
    # MLflow's server-side jobs off: the tracker never submits one, and the server started eight
    # queue consumers (huey) for them, each about 3 s of CPU to import MLflow; without them the
    # two MLflow tests took 34.7 s instead of 43.9 s (one process, 2 cores).
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(where / "server.log", "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=where, start_new_session=True,
                                  env=env)
    uri = f"http://127.0.0.1:{port}"
    try:
        yield uri, server
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and the workers it started
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def wait_for(uri: str, server, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, "mlflow server exited"
        try:
            with urllib.request.urlopen(uri + "/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"mlflow server at {uri} did not answer in {seconds} s")


@pytest.fixture(scope="module")
def tracked(mlflow_server, prefect_harness, tmp_path_factory):
    from flows.pipeline import pipeline
    from tasks.params import PipelineParams

    uri, server = mlflow_server
    wait_for(uri, server)  # started before the harness, so the two start together
    root = tmp_path_factory.mktemp("runs")
    saved = os.environ.pop("WANDB_MODE", None)  # the default, offline, is what is checked
    try:
        outcome = pipeline(PipelineParams(root=str(root), name="tracked", tracking=dict(
            trackers=["tensorboard", "mlflow", "wandb"], mlflow_tracking_uri=uri, wandb_project="dew-tests"), **TINY))
    finally:
        if saved is not None:
            os.environ["WANDB_MODE"] = saved
    from dew_lib.store import Store

    return root, outcome["run"], Store(root), uri


def store_metrics(store, run: str) -> dict[str, list[tuple[int, float]]]:
    rows = store.rows("SELECT name, step, value FROM metrics WHERE run = ? AND stage = 'sft' ORDER BY name, step",
                      [run])[1]
    out: dict[str, list[tuple[int, float]]] = {}
    for name, step, value in rows:
        out.setdefault(name, []).append((step, value))
    return out


def store_trackers(store, run: str) -> dict[str, tuple]:
    rows = store.rows("SELECT tracker, step, tracker_run, parent_run, name, location FROM trackers "
                      "WHERE run = ? AND stage = 'sft'", [run])[1]
    return {row[0]: row[1:] for row in rows}


@pytest.mark.slow
def test_tensorboard_holds_the_stores_metrics_of_the_pipeline_stage(tracked):
    root, run, store, _ = tracked
    expected = store_metrics(store, run)
    assert [step for step, _ in expected["loss"]] == [1, 2, 3, 4]
    step, relative, parent, name, location = store_trackers(store, run)["tensorboard"]
    assert (step, relative, parent, name) == (0, os.path.join(run, "sft"), None, f"{run}/sft")
    assert location == str(root / "tracked" / "tensorboard")
    events = tensorboard_events(os.path.join(location, relative))
    held = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    # TensorBoard keeps a scalar as float32: the store's float64, rounded so, exactly.
    assert held == {k: [(s, float(np.float32(v))) for s, v in series] for k, series in expected.items()}
    assert [image.step for image in events.Images("curves")] == [4]


@pytest.mark.slow
def test_the_mlflow_server_lists_the_pipeline_and_stage_runs_with_the_stores_params_and_metrics(tracked):
    from mlflow.tracking import MlflowClient

    _, run, store, uri = tracked
    step, run_id, parent_id, name, location = store_trackers(store, run)["mlflow"]
    assert (step, name, location) == (0, f"{run}/sft", uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("dew")
    found = {r.info.run_id: r for r in client.search_runs([experiment.experiment_id],
                                                          filter_string=f"tags.`dew.run` = '{run}'")}
    levels = sorted(r.data.tags.get("dew.stage", r.data.tags["dew.level"]) for r in found.values())
    assert levels == ["eval-sft", "eval-start", "pipeline", "sft"]  # each evaluation is a run of its own
    stage, parent = found[run_id], found[parent_id]
    assert (parent.info.run_name, parent.data.tags["dew.level"], parent.info.status) == (run, "pipeline", "FINISHED")
    assert (stage.info.run_name, stage.data.tags["mlflow.parentRunId"], stage.data.tags["dew.stage"],
            stage.info.status) == (f"{run}/sft", parent_id, "sft", "FINISHED")
    params, = store.rows("SELECT params FROM stages WHERE run = ? AND stage = 'sft'", [run])[1][0]
    assert stage.data.params == {k: str(v) for k, v in flat(json.loads(params)).items()}
    assert (stage.data.params["steps"], stage.data.params["log_every"]) == ("4", "1")
    expected = store_metrics(store, run)
    held = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in stage.data.metrics}
    assert held == expected
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert artifacts == {"curves.png", "policy"}
    assert "model.safetensors" in {os.path.basename(a.path) for a in client.list_artifacts(run_id, "policy")}


@pytest.mark.slow
def test_each_evaluation_sends_its_held_out_accuracy_to_every_tracker(tracked):
    from mlflow.tracking import MlflowClient

    root, run, store, uri = tracked
    for stage, step in (("eval-start", 0), ("eval-sft", 4)):
        (accuracy,), = store.rows("SELECT metrics['greedy_accuracy'] FROM stages WHERE run = ? AND stage = ?",
                                  [run, stage])[1]
        runs = {row[0]: row[1:] for row in store.rows(
            "SELECT tracker, step, tracker_run, name FROM trackers WHERE run = ? AND stage = ?", [run, stage])[1]}
        assert sorted(runs) == ["mlflow", "tensorboard", "wandb"]
        assert all(at == step and name == f"{run}/{stage}" for at, _, name in runs.values())
        events = tensorboard_events(str(root / "tracked" / "tensorboard" / run / stage))
        assert [(e.step, e.value) for e in events.Scalars("greedy_accuracy")] == [(step, float(np.float32(accuracy)))]
        history = MlflowClient(uri).get_metric_history(runs["mlflow"][1], "greedy_accuracy")
        assert [(m.step, m.value) for m in history] == [(step, accuracy)]


@pytest.mark.slow
def test_the_wandb_offline_run_holds_the_stores_history_and_names_the_run(tracked):
    root, run, store, _ = tracked
    step, run_id, parent, name, location = store_trackers(store, run)["wandb"]
    assert (step, parent, name) == (0, None, f"{run}/sft")
    assert location.startswith(str(root / "tracked" / "wandb" / "offline-run-")) and location.endswith(run_id)
    expected: dict[int, dict[str, float]] = {}
    for metric, series in store_metrics(store, run).items():
        for at, value in series:
            expected.setdefault(at, {})[metric] = value
    history = wandb_history(location)
    assert history == sorted(expected.items())
    record = wandb_run_record(location)
    assert (record.run_id, record.display_name, record.run_group) == (run_id, f"{run}/sft", run)


@pytest.mark.slow
def test_mlflow_nests_each_stage_under_one_pipeline_run_and_marks_a_failed_stage(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    uri, server = mlflow_server
    wait_for(uri, server)
    png, data = picture(tmp_path)
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    started: list[TrackerRun] = []
    for stage, status in (("sft", "completed"), ("dpo", "failed")):
        tracker = MLflowTracker(uri, "dew-units", "demo-1", stage, PARAMS, on_start=lambda _, run: started.append(run))
        drive(tracker, {"curves": png, "policy": str(policy)}, status)
    sft, dpo = started
    assert sft.parent == dpo.parent and (sft.name, dpo.name) == ("demo-1/sft", "demo-1/dpo")
    client = MlflowClient(uri)
    parent = client.get_run(sft.parent)
    assert (parent.info.run_name, parent.data.tags["dew.level"], parent.info.status) == ("demo-1", "pipeline",
                                                                                          "FAILED")
    for run, status in ((sft, "FINISHED"), (dpo, "FAILED")):
        held = client.get_run(run.id)
        assert (held.info.status, held.data.tags["mlflow.parentRunId"]) == (status, sft.parent)
        assert held.data.params == {"steps": "4", "learning_rate": "0.5", "lora.rank": "0",
                                    "lora.targets": '["q", "v"]', "mesh": ""}
        assert [(m.step, m.value) for m in client.get_metric_history(run.id, "loss")] == [(2, 1.25), (4, 0.75)]
        assert [(m.step, m.value) for m in client.get_metric_history(run.id, "val/loss")] == [(2, 2.5)]
        assert {a.path for a in client.list_artifacts(run.id)} == {"curves.png", "policy"}
        local = client.download_artifacts(run.id, "curves.png", str(tmp_path / run.id))
        with open(local, "rb") as handle:
            assert handle.read() == data


@pytest.mark.slow
def test_the_image_stages_send_their_scalars_curves_and_previews_to_tensorboard(prefect_harness, tmp_path):
    from dew_lib.store import Store
    from flows.flow_grpo import flow_grpo_pipeline
    from tasks.params import FlowPipelineParams

    tiny = dict(data=dict(count=64), model=dict(emb_features=8, num_layers=1, num_heads=2),
                pretrain=dict(steps=4, batch=16, log_every=2, checkpoint_every=2, preview_rows=4, preview_steps=3),
                grpo=dict(steps=3, batch=2, groups=2, log_every=1, checkpoint_every=1, rollout_steps=3,
                          preview_rows=4, preview_steps=3))
    outcome = flow_grpo_pipeline(FlowPipelineParams(root=str(tmp_path), name="images",
                                                    tracking=dict(trackers=["tensorboard"]), **tiny))
    store = Store(tmp_path)
    for stage, last in (("flow_pretrain", 4), ("flow_grpo", 3)):
        rows = store.rows("SELECT name, step, value FROM metrics WHERE run = ? AND stage = ? ORDER BY name, step",
                          [outcome["run"], stage])[1]
        expected: dict[str, list] = {}
        for name, step, value in rows:
            expected.setdefault(name, []).append((step, float(np.float32(value))))
        events = tensorboard_events(str(tmp_path / "images" / "tensorboard" / outcome["run"] / stage))
        held = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
        assert held == expected and expected
        assert sorted(events.Tags()["images"]) == ["curves", "preview-000000", f"preview-{last:06d}"]
        assert {e.step for tag in events.Tags()["images"] for e in events.Images(tag)} == {last}
