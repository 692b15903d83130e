"""Tracker sinks: a stage's metrics, parameters and files in TensorBoard, MLflow or Weights & Biases,
so a team can put a Dew run beside the runs it already compares there.

    options = TrackerOptions(trackers=["tensorboard"], tensorboard_dir="runs/demo/tensorboard")
    with Trackers.open(options, run="demo-1a2b3c4d", stage="sft", params={...}) as trackers:
        trainer.fit(..., sinks=[*trackers.sinks, ...])
        trackers.attach(policy="runs/demo/sft/policy", curves="runs/demo/sft/curves.png")

Each tracker run carries the run store's run id and the stage's name (its name is `<run>/<stage>`,
and its tags or directory say both); `on_start` tells the caller the tracker's own run id, which the
pipeline records in the store's `trackers` table, so either side finds the other. Each backend is
imported only when its sink starts.

A tracker mirrors the run store and is never the record: one that fails (its package missing, its
server down, a write refused) logs one warning, stops for the rest of the stage, and the stage goes
on; nothing the store or the other sinks hold depends on it.

Not here: which stages get trackers and where the store records them (tasks/lifecycle.py), the
run store (dew_lib/store).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import logging
import math
import os
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, field_validator

from dew_lib.recipes.options import Options
from dew_lib.train.sinks import Sink

_LOG = logging.getLogger(__name__)
Kind = Literal["tensorboard", "mlflow", "wandb"]
KINDS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb")
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}  # the package each needs


class TrackerOptions(Options):
    """Which trackers a pipeline's training stages also log to, and where. Declared once: the
    pipeline's form holds it as its `tracking` block (tasks/params.PipelineParams)."""

    trackers: list[Kind] = Field(default_factory=list, description="trackers every training stage also "
                                 "logs to: 'tensorboard', 'mlflow', 'wandb' (each an extra: pip install "
                                 "'dew[tensorboard]'); empty: the run store only (docs/trackers.md)")
    tensorboard_dir: str | None = Field(None, description="tensorboard: the log directory; each stage's "
                                        "events go to <dir>/<run id>/<stage>; empty: <root>/<name>/tensorboard")
    mlflow_tracking_uri: str | None = Field(None, description="mlflow: the tracking server's URI (e.g. "
                                            "http://127.0.0.1:5000); empty: MLflow's own default "
                                            "(MLFLOW_TRACKING_URI)")
    mlflow_experiment: str = Field("dew", min_length=1, description="mlflow: the experiment the runs go to")
    mlflow_policy: bool = Field(True, description="mlflow: upload each stage's saved policy directory as an "
                                "artifact (as large as the model's weights); curves.png always goes")
    wandb_project: str = Field("dew", min_length=1, description="wandb: the project the runs go to")
    wandb_mode: Literal["offline", "online", "disabled"] | None = Field(
        None, description="wandb: 'offline' writes the runs to wandb_dir for a later `wandb sync`; empty: "
        "WANDB_MODE when set, else offline")
    wandb_dir: str | None = Field(None, description="wandb: where its run directories go (a wandb/ "
                                  "folder inside); empty: <root>/<name>")

    @field_validator("trackers")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"trackers names a tracker twice: {value}; name each of {KINDS} at most once")
        return value

    def resolved(self, output: str) -> TrackerOptions:
        """These options with the directories left empty placed under `output`, the run's directory."""
        return self.model_copy(update={
            "tensorboard_dir": os.path.abspath(self.tensorboard_dir or os.path.join(output, "tensorboard")),
            "wandb_dir": os.path.abspath(self.wandb_dir or output)})


@dataclasses.dataclass(frozen=True)
class TrackerRun:
    """A stage's run in a tracker. id: the tracker's own id of it (MLflow's and W&B's run ids; for
    TensorBoard the run's directory under the log directory, which TensorBoard names it by).
    location: the log directory, tracking URI or W&B run directory. parent: the MLflow run of the
    whole pipeline run this one is nested under."""

    tracker: str
    id: str
    name: str
    location: str
    parent: str | None = None


def flat(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameters as one level of dotted names; lists and None as JSON text."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat(value, name + "."))
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


class Tracker(Sink):
    """A sink that mirrors a stage into one tracker, behind a guard: the first error is logged once
    as a warning and the tracker stops; nothing it raises reaches the Trainer.

    Subclasses implement `_start(first_step) -> TrackerRun`, `_write`, `_finish(status, files)`
    and may implement `_note`, `_checkpoint`, `_flush`. `finish` ends the tracker's run after the
    stage (the Trainer only `close`s a sink, which flushes): files saved after training, such as
    the policy and curves.png, go with it.
    """

    kind = ""

    def __init__(self, run: str, stage: str, params: Mapping[str, Any], *,
                 on_start: Callable[[int, TrackerRun], None] | None = None, logger=None):
        self.run, self.stage, self.params = run, stage, dict(params)
        self.on_start, self.logger = on_start, logger or _LOG
        self.started: TrackerRun | None = None
        self.failed: str | None = None
        self.ended = False  # finish ran: later hooks have nothing to write to
        self.last_step = 0

    @property
    def name(self) -> str:
        return f"{self.run}/{self.stage}"

    def _guard(self, what: str, call: Callable[[], Any]) -> None:
        if self.failed is not None:
            return
        try:
            call()
        except Exception as error:  # noqa: BLE001 - a tracker never stops a stage
            self.failed = f"{type(error).__name__}: {error}"
            hint = f"; install it with pip install 'dew[{self.kind}]'" if isinstance(error, ImportError) else ""
            self.logger.warning("%s tracker stopped for stage %s of run %s (while it %s): %s%s. The stage "
                                "goes on; its metrics are in the run store", self.kind, self.stage, self.run,
                                what, self.failed, hint)

    def begin(self, first_step: int, total_steps: int) -> None:
        def start():
            if self.started is None:
                self.started = self._start(first_step)
                self.last_step = first_step
                if self.on_start is not None:
                    self.on_start(first_step, self.started)

        self._guard("started", start)

    @property
    def live(self) -> bool:
        return self.started is not None and not self.ended

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.live:
            self.last_step = max(self.last_step, step)
            self._guard("wrote metrics", lambda: self._write(step, {k: float(v) for k, v in metrics.items()}))

    def note(self, step: int, text: str) -> None:
        if self.live:
            self._guard("wrote a note", lambda: self._note(step, text))

    def checkpoint(self, step: int, path: str) -> None:
        if self.live:
            self._guard("recorded a checkpoint", lambda: self._checkpoint(step, path))

    def close(self) -> None:
        if self.live:
            self._guard("flushed", self._flush)

    def finish(self, status: Literal["completed", "failed"], files: Mapping[str, str] | None = None) -> None:
        """End the tracker's run as `status`, with `files` (name -> file or directory) that exist;
        once: a second call does nothing."""
        if self.live:
            self.ended = True
            present = {k: v for k, v in (files or {}).items() if v and os.path.exists(v)}
            self._guard("finished", lambda: self._finish(status, present))

    @abc.abstractmethod
    def _start(self, first_step: int) -> TrackerRun:
        """Open the tracker's run; what it is called there."""

    @abc.abstractmethod
    def _write(self, step: int, metrics: dict[str, float]) -> None:
        """Log one window's metrics at `step`."""

    def _note(self, step: int, text: str) -> None:
        return None

    def _checkpoint(self, step: int, path: str) -> None:
        return None

    def _flush(self) -> None:
        return None

    @abc.abstractmethod
    def _finish(self, status: str, files: Mapping[str, str]) -> None:
        """Upload `files` and end the run as `status`."""


# ----- TensorBoard -------------------------------------------------------------------------------
def png_size(data: bytes) -> tuple[int, int, int]:
    """(height, width, channels) from a PNG's header."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    width, height = struct.unpack(">II", data[16:24])
    return height, width, {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}[data[25]]


class TensorBoardTracker(Tracker):
    """Event files under `<log_dir>/<run>/<stage>`, written with tensorboard's own event writer:
    every metric as a scalar at its step, the stage's parameters as text and as hparams, notes and
    checkpoints as text, and at the end every PNG among the files as an image at the last step."""

    kind = "tensorboard"

    def __init__(self, log_dir: str, run: str, stage: str, params: Mapping[str, Any], **kwargs):
        super().__init__(run, stage, params, **kwargs)
        self.log_dir = os.path.abspath(log_dir)
        self.writer: Any = None

    def _event(self, step: int, values: Sequence[Any]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2  # type: ignore[import-untyped]

        summary = summary_pb2.Summary(value=list(values))
        self.writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _text(self, step: int, tag: str, text: str) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb  # type: ignore[import-untyped]

        self._event(step, text_pb(tag, text).value)

    def _start(self, first_step: int) -> TrackerRun:
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb  # type: ignore[import-untyped]
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # type: ignore[import-untyped]

        relative = os.path.join(self.run, self.stage)
        self.writer = EventFileWriter(os.path.join(self.log_dir, relative), flush_secs=10)
        shown = json.dumps({"run": self.run, "stage": self.stage, "params": self.params}, indent=2, sort_keys=True)
        self._text(first_step, "params", "```\n" + shown + "\n```")  # the text plugin renders Markdown
        hparams = {"dew.run": self.run, "dew.stage": self.stage, **flat(self.params)}
        self._event(first_step, hparams_pb(hparams, trial_id=self.name).value)
        self.writer.flush()
        return TrackerRun(self.kind, relative, self.name, self.log_dir)

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboard.compat.proto import summary_pb2  # type: ignore[import-untyped]

        self._event(step, [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()])

    def _note(self, step: int, text: str) -> None:
        self._text(step, "notes", text)

    def _checkpoint(self, step: int, path: str) -> None:
        self._text(step, "checkpoints", f"step {step}: {path}")

    def _flush(self) -> None:
        self.writer.flush()

    def _finish(self, status: str, files: Mapping[str, str]) -> None:
        from tensorboard.compat.proto import summary_pb2  # type: ignore[import-untyped]

        for name, path in sorted(files.items()):
            if os.path.isfile(path) and path.endswith(".png"):
                with open(path, "rb") as handle:
                    data = handle.read()
                height, width, channels = png_size(data)
                image = summary_pb2.Summary.Image(height=height, width=width, colorspace=channels,
                                                  encoded_image_string=data)
                self._event(self.last_step, [summary_pb2.Summary.Value(tag=name, image=image)])
        self._text(self.last_step, "status", status)
        self.writer.close()


# ----- MLflow ------------------------------------------------------------------------------------
def reachable(uri: str, timeout: float = 5.0) -> None:
    """Raise when an http(s) tracking server does not answer its health check: MLflow's client
    retries a refused connection for minutes, which would hold the stage up."""
    if uri.startswith(("http://", "https://")):
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as answer:
            answer.read()


class MLflowTracker(Tracker):
    """A run per stage (`<run>/<stage>`), nested under a run per pipeline run (named by the run id,
    found again by its tag `dew.run` for each later stage), both tagged with the store's run id:
    parameters (dotted names), metrics by step, and at the end the files as artifacts (a
    directory under its name, a file at the top; directories: whether to send directories)."""

    kind = "mlflow"
    BATCH = 100  # parameters per request: MLflow's limit for one log_batch

    def __init__(self, tracking_uri: str | None, experiment: str, run: str, stage: str,
                 params: Mapping[str, Any], *, directories: bool = True, **kwargs):
        super().__init__(run, stage, params, **kwargs)
        self.tracking_uri, self.experiment, self.directories = tracking_uri, experiment, directories
        self.client: Any = None
        self.run_id = self.parent_id = ""

    def _start(self, first_step: int) -> TrackerRun:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(self.tracking_uri)
        uri = client.tracking_uri
        reachable(uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        query = f"tags.`dew.run` = '{self.run}' and tags.`dew.level` = 'pipeline'"
        parents = client.search_runs([experiment], filter_string=query, max_results=1)
        if parents:
            self.parent_id = parents[0].info.run_id
            client.update_run(self.parent_id, status="RUNNING")
        else:
            self.parent_id = client.create_run(experiment, run_name=self.run, tags={
                "dew.run": self.run, "dew.level": "pipeline"}).info.run_id
        self.run_id = client.create_run(experiment, run_name=self.name, tags={
            "mlflow.parentRunId": self.parent_id, "dew.run": self.run, "dew.stage": self.stage,
            "dew.level": "stage", "dew.first_step": str(first_step)}).info.run_id
        params = [Param(k, str(v)) for k, v in sorted(flat(self.params).items())]
        for at in range(0, len(params), self.BATCH):
            client.log_batch(self.run_id, params=params[at:at + self.BATCH])
        return TrackerRun(self.kind, self.run_id, self.name, uri, parent=self.parent_id)

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def _finish(self, status: str, files: Mapping[str, str]) -> None:
        for name, path in sorted(files.items()):
            if os.path.isdir(path):
                if self.directories:  # a policy: as large as the model (TrackerOptions.mlflow_policy)
                    self.client.log_artifacts(self.run_id, path, artifact_path=name)
            else:
                self.client.log_artifact(self.run_id, path)
        ended = "FINISHED" if status == "completed" else "FAILED"
        self.client.set_terminated(self.run_id, ended)
        self.client.set_terminated(self.parent_id, ended)  # the next stage sets it running again


# ----- Weights & Biases --------------------------------------------------------------------------
class WandbTracker(Tracker):
    """A W&B run per stage (`<run>/<stage>`, grouped by the run id, tagged with both): the stage's
    parameters as config and metrics by step. Offline unless asked: `mode`, else `WANDB_MODE`,
    else 'offline', which writes the run under `<directory>/wandb/` for a later `wandb sync`."""

    kind = "wandb"

    def __init__(self, project: str, mode: str | None, directory: str, run: str, stage: str,
                 params: Mapping[str, Any], **kwargs):
        super().__init__(run, stage, params, **kwargs)
        self.project, self.directory = project, os.path.abspath(directory)
        self.mode: Any = mode or os.environ.get("WANDB_MODE") or "offline"  # wandb checks the value
        self.wandb_run: Any = None

    def _start(self, first_step: int) -> TrackerRun:
        import wandb

        os.makedirs(self.directory, exist_ok=True)
        config = {**flat(self.params), "dew.run": self.run, "dew.stage": self.stage, "dew.first_step": first_step}
        self.wandb_run = run = wandb.init(
            project=self.project, dir=self.directory, mode=self.mode, name=self.name, group=self.run,
            job_type=self.stage, tags=[self.run[:64], self.stage[:64]], config=config, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True))
        location = os.path.dirname(run.dir) if run.dir else self.directory  # the run's directory, not files/
        return TrackerRun(self.kind, run.id, self.name, location)

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        self.wandb_run.log({k: (v if math.isfinite(v) else float("nan")) for k, v in metrics.items()}, step=step)

    def _finish(self, status: str, files: Mapping[str, str]) -> None:
        self.wandb_run.finish(exit_code=0 if status == "completed" else 1)


# ----- a stage's trackers ------------------------------------------------------------------------
class Trackers:
    """The tracker sinks of one stage. As a context manager (`open`), it ends every tracker's run
    when the block ends: completed, with the files `attach` named, or failed if the block raised."""

    def __init__(self, sinks: Sequence[Tracker] = ()):
        self.sinks = list(sinks)
        self.files: dict[str, str] = {}

    @classmethod
    @contextlib.contextmanager
    def open(cls, options: TrackerOptions | None, *, run: str, stage: str, params: Mapping[str, Any],
             output: str = "runs", on_start: Callable[[int, TrackerRun], None] | None = None,
             logger=None) -> Iterator[Trackers]:
        """The trackers `options` chooses for `stage` of `run`; none for None. output: the run's
        directory, under which empty directory options resolve (TrackerOptions.resolved)."""
        trackers = cls(build(options, run=run, stage=stage, params=params, output=output,
                             on_start=on_start, logger=logger))
        try:
            yield trackers
        except BaseException:
            trackers.finish("failed")
            raise
        trackers.finish("completed")

    def attach(self, **files: str | None) -> None:
        """Files to send with the runs when they end: name -> file or directory."""
        self.files.update({k: v for k, v in files.items() if v})

    def finish(self, status: Literal["completed", "failed"]) -> None:
        for sink in self.sinks:
            sink.close()
            sink.finish(status, self.files)


def build(options: TrackerOptions | None, *, run: str, stage: str, params: Mapping[str, Any],
          output: str = "runs", on_start: Callable[[int, TrackerRun], None] | None = None,
          logger=None) -> list[Tracker]:
    """One sink per tracker `options` names, in the order it names them."""
    if options is None or not options.trackers:
        return []
    options = options.resolved(output)
    common = dict(on_start=on_start, logger=logger)
    made: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorBoardTracker(options.tensorboard_dir or "", run, stage, params, **common),
        "mlflow": lambda: MLflowTracker(options.mlflow_tracking_uri, options.mlflow_experiment, run, stage,
                                        params, directories=options.mlflow_policy, **common),
        "wandb": lambda: WandbTracker(options.wandb_project, options.wandb_mode, options.wandb_dir or output,
                                      run, stage, params, **common),
    }
    return [made[kind]() for kind in options.trackers]


__all__ = ["KINDS", "MLflowTracker", "TensorBoardTracker", "Tracker", "TrackerOptions", "TrackerRun", "Trackers",
           "WandbTracker", "build", "flat", "png_size", "reachable"]
