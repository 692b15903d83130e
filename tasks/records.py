"""The run store from flows and tasks: the run a pipeline records under, and one writer per stage.

A run is its name, parameters and inputs (the data files): starting a pipeline again with the
same ones as the last run in its directory is that run's next attempt, whether it finished, was
killed or failed, instead of a new run. A stage an earlier attempt finished keeps its record (the
rerun reuses it); a resumed stage carries on its own rows: what a later attempt redid replaces what
the earlier one wrote under the same step (dew_lib/store/writer.py), and the store's queries answer
as if the run had never stopped. Anything else changed starts a new run.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from dew_lib.store import Store
from dew_lib.store.parts import FileLock
from tasks.storage import read_json, write_json

MARKER = "run.json"  # in the pipeline's directory: its current run, parameters digest and status


@contextlib.contextmanager
def open_stage(store_root: str, run: str, stage: str, kind: str,
               params: Mapping[str, Any] | None = None, started_at: datetime.datetime | None = None
               ) -> Iterator[Any]:
    """A StageWriter for `stage` of `run`; marked failed, with the error, if the body raises.
    started_at: when the stage's work began, for a stage recorded once it is done (evaluations)."""
    with Store(store_root).writer(run) as run_writer:
        with run_writer.stage(stage, kind=kind, params=params, started_at=started_at) as writer:
            yield writer


def stage_completed(store_root: str, run: str, stage: str) -> bool:
    """Whether `run` already recorded `stage` as completed (an earlier attempt finished it)."""
    store = Store(store_root)
    if not store.exists():
        return False
    found = store.rows("SELECT status FROM stages WHERE run = ? AND stage = ?", [run, stage])[1]
    return bool(found) and found[0][0] == "completed"


def record_reused(store_root: str, run: str, stage: str, kind: str, params: Mapping[str, Any],
                  metrics: Mapping[str, float]) -> None:
    """Record a stage that reused a finished result as completed with its metrics, unless this
    run already has it completed (a continued run keeps the attempt that did the work)."""
    if not stage_completed(store_root, run, stage):
        with open_stage(store_root, run, stage, kind, params) as writer:
            writer.finish("completed", metrics)


def new_run_id(name: str) -> str:
    """A fresh run id: the pipeline name and this flow run's id."""
    from prefect.runtime import flow_run  # here: a stage job's processes import this module, not Prefect

    identity = flow_run.get_id() or uuid.uuid4().hex
    return f"{name}-{str(identity).replace('-', '')[:8]}"


# Parameters that say where a run's records also go, not what it computes: changing them
# continues the same run.
NOT_IDENTITY = frozenset({"tracking"})


def run_digest(params: Mapping[str, Any], inputs: Mapping[str, Any] | None = None) -> str:
    """What identifies a run: its parameters (but NOT_IDENTITY) and, when there are any, its inputs."""
    params = {name: value for name, value in params.items() if name not in NOT_IDENTITY}
    identity = {"params": params, "inputs": inputs} if inputs else params
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


@contextlib.contextmanager
def pipeline_run(store_root: str, directory: str, name: str, params: Mapping[str, Any],
                 inputs: Mapping[str, Any] | None = None) -> Iterator[tuple[str, bool]]:
    """(run id, whether it continues the last run in `directory`) for a pipeline working there: the
    same run, as its next attempt, when `params` and `inputs` (what else decides the stages' work,
    e.g. the data files' sizes and times) are those of the last run, finished or not.

    The run is marked running for the whole body (its writer's lock tells `dew runs` it is alive),
    then completed, or failed with the error. A second live pipeline in the same directory is
    refused: both would train into the same stage directories.
    """
    Store(store_root).create()  # an unusable store fails here, naming its path
    guard = FileLock(os.path.join(directory, "run.lock"),
                     what=f"pipeline {name!r} (directory {directory})")
    try:
        marker = os.path.join(directory, MARKER)
        digest = run_digest(params, inputs)
        previous = read_json(marker) or {}
        continued = "run" in previous and previous.get("params") == digest
        run = previous["run"] if continued else new_run_id(name)
        write_json(marker, {"run": run, "params": digest, "status": "running"})
        with Store(store_root).writer(run) as writer:
            writer.start(params=params)
            try:
                yield run, continued
            except BaseException as error:
                writer.finish("failed", error=f"{type(error).__name__}: {error}")
                raise
            writer.finish("completed")
        write_json(marker, {"run": run, "params": digest, "status": "completed"})
    finally:
        guard.release()
