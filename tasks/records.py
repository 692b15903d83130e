"""Opening the run store from a task: one writer per run, one per stage, closed on every exit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from dew_lib.store import Store


@contextlib.contextmanager
def open_stage(store_root: str, run: str, stage: str, kind: str,
               params: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A StageWriter for `stage` of `run`; marked failed, with the error, if the body raises."""
    with Store(store_root).writer(run) as run_writer:
        with run_writer.stage(stage, kind=kind, params=params) as writer:
            yield writer


def mark_run(store_root: str, run: str, status: str, params: Mapping[str, Any] | None = None,
             error: str | None = None) -> None:
    """Record that a run started (status "running", with its parameters) or ended."""
    with Store(store_root).writer(run) as run_writer:
        if status == "running":
            run_writer.start(params=params)
        else:
            run_writer.finish(status, error=error)
