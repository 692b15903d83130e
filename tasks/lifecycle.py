"""A training stage's life, the same for text and image stages: enter the directory of its
inputs, reuse a finished result or find where to start, fit with the same sinks, then record,
plot and publish the outcome and write `result.json` last.

    start = begin(...)                # a finished result (reused and recorded), or where to train
    with stage_trackers(...) as trackers:  # TensorBoard, MLflow, W&B, when the run chose them
    sinks = stage_sinks(...)          # log, progress, the store, metrics.jsonl, trackers, the deadline
    metrics = conclude(...)           # history, final metrics, curves, the store's last rows
    write_result(...)                 # result.json: a rerun with these inputs reuses the stage

What a stage trains, and how (in the task's process or as a job), is its task's business
(tasks/train.py, tasks/flow_train.py); the directory rules are tasks/storage.py's.

Not here: building objectives (dew_lib/recipes), Prefect flows.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from dew_lib.train.sinks import JsonlSink, Sink
from dew_lib.train.trackers import TrackerOptions, Trackers
from tasks.params import StageParams
from tasks.records import record_reused
from tasks.storage import StageDirectory, enter_stage, start_point, write_json
from tasks.ui import Deadline, LogSink, ProgressSink, plot_curves, publish_stage


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a stage that has to train starts: its directory of these inputs, the checkpoint
    step it continues from (None: step 0) and where that checkpoint was first written."""

    place: StageDirectory
    resumed: int | None
    written: str

    @property
    def directory(self) -> str:
        return self.place.directory


def begin(stage: str, kind: str, params: StageParams, key: str, inputs: dict, directory: str,
          store_root: str, run: str, *, links: tuple[str, ...], labels: dict[str, str], result: type[BaseModel],
          logger, shorter: bool = True) -> BaseModel | Start:
    """The stage's finished `result` (marked cached and recorded as reused in the store) when
    its directory holds one for exactly these inputs; else where its training starts, logged.
    shorter: a run whose inputs differ from another's only in steps continues that one's
    checkpoint (not for a schedule that spans the steps)."""
    place, finished = enter_stage(directory, key, inputs, links, stage, logger)
    if finished is not None:
        reused = result(**finished).model_copy(update={"cached": True})
        saved = getattr(reused, "policy", None) or getattr(reused, "model", None)
        logger.info("%s reused: it finished with these inputs before (%s)", stage, saved.path if saved else "")
        record_reused(store_root, run, stage, kind, params.model_dump(mode="json"), reused.metrics)
        return reused
    resumed, written = start_point(place, inputs, params.steps, stage=stage, labels=labels, logger=logger,
                                   shorter=shorter)
    return Start(place=place, resumed=resumed, written=written)


def stage_trackers(tracking: TrackerOptions | None, writer, run: str, stage: str, params: BaseModel,
                   output: str, logger=None):
    """The stage's tracker sinks (dew_lib/train/trackers.py) as a context that ends their runs
    with the stage, each run recorded in the store's `trackers` table as it starts; none without
    a writer (a process of a job other than process 0). params: the stage's options (a training
    stage's, or an evaluation's). output: the run's directory."""

    def record(step: int, started) -> None:
        writer.tracker_run(step, started.tracker, started.id, name=started.name, location=started.location,
                           parent=started.parent)

    return Trackers.open(tracking if writer is not None else None, run=run, stage=stage,
                         params=params.model_dump(mode="json"), output=output, on_start=record, logger=logger)


def stage_sinks(stage: str, params: StageParams, writer, log_path: str, *, shown: Sequence[str],
                before: Sequence[Sink] = (), progress: bool = True, logger=None,
                trackers: Sequence[Sink] = ()) -> list:
    """Every stage's sinks, in order: `before` (the stage's own), its log line and progress
    artifact, the run store, metrics.jsonl, the `trackers`, and last the deadline, so a window is
    recorded everywhere before a deadline stops the stage. writer None: a process that records
    nothing (not process 0 of a job), which keeps only `before` and the deadline."""
    shown_sinks = [LogSink(stage, tuple(shown), logger)] + ([ProgressSink(stage, params.steps)] if progress else [])
    recorded = [] if writer is None else [*shown_sinks, writer.sink(), JsonlSink(log_path), *trackers]
    return [*before, *recorded, Deadline(stage, params.max_minutes)]


def history(path: str) -> list[tuple[int, dict]]:
    """Logged windows of every attempt; a window logged again after a resume replaces the old."""
    windows: dict[tuple[int, bool], dict] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                row = json.loads(line)
                step = row.pop("step")
                values = {k: v for k, v in row.items() if v is not None}
                windows[(step, any(k.startswith("val/") for k in values))] = values
    return sorted(((step, values) for (step, _), values in windows.items()), key=lambda x: x[0])


def final_metrics(windows) -> dict[str, float]:
    """The last training window merged with the last validation, if any."""
    train = [m for _, m in windows if not any(k.startswith("val/") for k in m)]
    val = [m for _, m in windows if any(k.startswith("val/") for k in m)]
    return {**(train[-1] if train else {}), **(val[-1] if val else {})}


def conclude(writer, stage: str, kind: str, directory: str, steps: int, saved: str, *,
             extra: Mapping[str, float] | None = None,
             publish: Callable[[str, dict, str | None], Any] | None = publish_stage) -> dict[str, float]:
    """Close a trained stage: its final metrics (with `extra`), curves.png, the published summary,
    then the store's `policy` checkpoint row at `saved` and the stage marked completed, last."""
    log_path = os.path.join(directory, "metrics.jsonl")
    windows = history(log_path)
    metrics = {**final_metrics(windows), **(extra or {})}
    plot = plot_curves(windows, os.path.join(directory, "curves.png"), f"{stage} ({kind})")
    if publish is not None:
        publish(stage, metrics, plot)
    writer.checkpoint(steps, saved, kind="policy")
    writer.finish("completed", metrics)
    return metrics


def write_result(directory: str, key: str, result: BaseModel) -> None:
    """result.json, written last: a rerun with the same inputs reuses the stage through it."""
    write_json(os.path.join(directory, "result.json"), {"fingerprint": key, "result": result.model_dump()})


__all__ = ["Start", "begin", "conclude", "final_metrics", "history", "stage_sinks", "stage_trackers", "write_result"]
