"""Writers of the run store: one per run, one per stage, and a Trainer sink.

`RunWriter` records a run (status, parameters, code version) and opens `StageWriter`s. A stage
writer records what its stage produced: sessions and their calls, scheduler records, metrics,
evaluations, verdicts, Flow-GRPO samples and checkpoints. Each write is a unit: its rows become
one Parquet part per table (parts.py), committed durably before the write counts as done, and
keyed by its step so that a retried task replaces what the failed attempt wrote under the same
step instead of adding to it.

Writes run in order on one background thread (`background=True`, the default): the caller only
validates its arguments and queues them, so a training step does not wait for Arrow conversion,
compression or fsync. `flush()` waits until everything queued is durable; a failure on the
thread is raised by the next call. The queue is bounded, so a slow disk slows the writer's caller
instead of filling memory. Writers are closed at interpreter exit if the caller did not.

Readers see a write once a snapshot names it (snapshot.py): a write that adds a part to a
generation readers already see is visible at once; one that makes a new generation (compaction, a
stream's first part) is published by the thread when its queue is empty, at least every
`snapshot.PUBLISH_EVERY` seconds while it stays busy, and before `flush()` returns.

Not here: the file layout (parts.py), queries (store.py), anything Prefect.
"""

from __future__ import annotations

import atexit
import datetime
import json
import math
import os
import re
import socket
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dew_lib.store import prompts as prompt_rows
from dew_lib.store import rows, snapshot
from dew_lib.store.parts import FileLock, StoreError, Stream, replace_file
from dew_lib.store.schema import RUN_STATUSES, TABLES
from dew_lib.store.turns import turns_table
from dew_lib.store.worker import Worker

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a valid name; use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it names directories in the store)"
        )
    return value


def _step(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int,)) and not hasattr(value, "__index__"):
        raise TypeError(f"{field} must be an integer step, got {value!r}")
    value = int(value)
    if value < 0:
        raise ValueError(f"{field} must be >= 0, got {value}")
    return value


def _status(value: str) -> str:
    if value not in RUN_STATUSES:
        raise ValueError(f"status must be one of {RUN_STATUSES}, got {value!r}")
    return value


_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_writers() -> None:
    for writer in list(_OPEN):
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - at exit there is no one left to raise to
            pass


def _clear_stale(directory: str, age: float = 3600.0) -> None:
    """Remove temporary files a killed writer of this run left (the run's writers share the
    directory, so only files older than any write in progress)."""
    if not os.path.isdir(directory):
        return
    cutoff = time.time() - age
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        try:
            if os.path.getmtime(path) < cutoff:
                os.remove(path)
        except FileNotFoundError:
            pass


def _read_row(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    return pq.ParquetFile(path).read().to_pylist()[0]


class RunWriter:
    """Records one run and opens writers for its stages. Use as a context manager, or `close()`.

    Several processes may hold a RunWriter for the same run (say a flow and its tasks); each
    stage has one writer at a time. background: write on a thread (see the module docstring).
    Compaction settings go to every stream (see parts.Stream).
    """

    def __init__(self, store, run: str, *, background: bool = True, queue_depth: int = 8,
                 **compaction: int):
        self.store, self.run = store, check_name("run", run)
        self.compaction = compaction
        store.create()
        self.lock = FileLock(store.lock_path(run), shared=True, blocking=True)  # only probes exclude it
        _clear_stale(store.tmp_dir(run))
        self.worker = Worker(background, queue_depth, publish=lambda: snapshot.publish(store.directory))
        self.stages: list[StageWriter] = []
        self.closed = False
        _OPEN.add(self)

    # ----- the run row -------------------------------------------------------------------------
    def _update_run(self, **fields: Any) -> None:
        path = os.path.join(self.store.directory, "runs", self.run, "run", "run.parquet")
        when = rows.now()  # when the caller asked, not when the thread got to it

        def job():
            guard = FileLock(self.store.lock_path(self.run, "_row"), blocking=True)
            try:
                row = _read_row(path) or {"run": self.run, "attempts": 0, "started_at": when}
                if fields.pop("_started", False):
                    row["attempts"] = (row["attempts"] or 0) + 1
                    row["finished_at"] = row["error"] = None
                row.update(fields, host=socket.gethostname(), pid=os.getpid(), updated_at=when)
                table = pa.Table.from_pylist([row], schema=TABLES["runs"].schema)
                replace_file(table, path, self.store.tmp_dir(self.run))
            finally:
                guard.release()

        self.worker.submit(job)

    def start(self, params: Mapping[str, Any] | None = None, code_version: str | None = None) -> RunWriter:
        """Mark the run running (counting an attempt) with its parameters and code version."""
        self._update_run(_started=True, status="running", params=_json(params),
                         code_version=code_version or self.store.code_version())
        return self

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        """Mark the run completed or failed (with why)."""
        self._update_run(status=_status(status), error=error, finished_at=rows.now())
        self.flush()

    # ----- stages ------------------------------------------------------------------------------
    def stage(self, name: str, *, kind: str = "", params: Mapping[str, Any] | None = None,
              code_version: str | None = None, started_at: datetime.datetime | None = None) -> StageWriter:
        """Open the stage for writing (one writer per stage at a time) and mark it running.

        started_at: when the stage's work began (timezone-aware; default now), for a stage that
        records itself only once its work is done, as an evaluation does, so that its `seconds`
        in `dew runs` cover the work."""
        if self.closed:
            raise StoreError(f"the writer of run {self.run!r} is closed; open a new one")
        writer = StageWriter(self, check_name("stage", name), kind=kind, params=params,
                             code_version=code_version, started_at=rows.check_started_at(started_at))
        self.stages.append(writer)
        return writer

    def flush(self) -> None:
        """Wait until every queued write is durable; raise if one failed."""
        self.worker.flush()

    @property
    def write_seconds(self) -> tuple[float, float]:
        """(wall, CPU) seconds this writer's thread spent converting, writing and compacting."""
        return self.worker.seconds, self.worker.cpu_seconds

    def close(self) -> None:
        """Flush, release every stage this writer opened and stop its thread."""
        if self.closed:
            return
        try:
            self.worker.flush()
        finally:
            self.closed = True
            self.worker.stop()
            for stage in self.stages:  # after the flush: nothing of theirs is still queued
                stage.closed = True
                stage.lock.release()
            self.lock.release()
            _OPEN.discard(self)

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StageWriter:
    """Records one stage of a run; see the module docstring. As a context manager it marks the
    stage failed (with the exception) when the block raises and completed when it ends."""

    def __init__(self, run: RunWriter, stage: str, *, kind: str, params, code_version, started_at=None):
        self.run_writer, self.run, self.stage = run, run.run, stage
        self.store, self.worker = run.store, run.worker
        self.lock = FileLock(self.store.lock_path(self.run, stage), what=f"stage {stage!r} of run {self.run!r}")
        self.streams: dict[str, Stream] = {}
        self.prompted: set[str] = set()  # tasks whose prompt this writer recorded
        self.finished = False
        self.closed = False
        self._stage_row(started=True, started_at=started_at, kind=kind, status="running", params=_json(params),
                        code_version=code_version or self.store.code_version())

    def _stage_row(self, started: bool = False, started_at=None, **fields: Any) -> None:
        path = os.path.join(self.store.directory, "stages", self.run, self.stage, "stage.parquet")
        when = rows.now()  # when the caller asked: a finish queued behind it is never earlier

        def job():
            row = _read_row(path) or {"run": self.run, "stage": self.stage, "attempt": 0, "metrics": {}}
            if started:
                row.update(attempt=(row["attempt"] or 0) + 1, started_at=started_at or when, finished_at=None,
                           error=None, metrics={})
            row.update(fields, updated_at=when)
            metrics = row.get("metrics") or []  # a dict when set here, (name, value) pairs when read
            row["metrics"] = list(metrics.items()) if isinstance(metrics, dict) else metrics
            table = pa.Table.from_pylist([row], schema=TABLES["stages"].schema)
            replace_file(table, path, self.store.tmp_dir(self.run))

        self.worker.submit(job)

    def _stream(self, table: str) -> Stream:
        if table not in self.streams:
            self.streams[table] = Stream(self.store.directory, table, self.run, self.stage,
                                         TABLES[table].key, on_change=self.worker.changed,
                                         **self.run_writer.compaction)
        return self.streams[table]

    def _write(self, convert: Callable[[], list[tuple[str, int, pa.Table]]]) -> None:
        if self.closed:
            raise StoreError(f"stage {self.stage!r} of run {self.run!r} is closed; open it again to write")

        def job():
            for table, key, rows_ in convert():
                self._stream(table).write(key, rows_)

        self.worker.submit(job)

    # ----- records -----------------------------------------------------------------------------
    def sessions(self, sessions: Sequence[Any], *, update: int, latencies=None, causes=None,
                 trained=None, truncation: str = "mask", verdicts=None, episodes=None) -> None:
        """Record sessions drawn for trainer update `update`, with their calls.

        latencies: seconds from submission to finish, one per session (or None). causes: why
        each was or was not trained (records.CAUSES), one for all or one per session. trained:
        True/False for all, one flag per session, or None for what `pack` trains on under
        `truncation`. verdicts: None, or one list of Verdict records per session (the programs
        a code reward ran for it), stored with the session's `session_uid`. episodes: None, or
        the tool episode (`dew_lib.records.Episode`) behind each session, whose actions land in
        `turns` (store/turns.py); None in place of a session's episode records no turns for it.
        Calls, verdicts and turns are committed before their sessions, so a visible session
        always has them.
        """
        update = _step("update", update)
        sessions = tuple(sessions)
        if verdicts is not None:
            verdicts = rows.check_verdicts(verdicts, len(sessions), "session")
        latencies = rows.per_session(latencies, len(sessions), "latencies")
        causes = rows.per_session(causes, len(sessions), "causes")
        rows.check_latencies(latencies)
        rows.check_causes(causes)
        if trained is not None and not isinstance(trained, (bool, np.bool_)):
            trained = list(trained)  # the caller may reuse its list while the thread converts
        rows.check_trained(trained, len(sessions), truncation)

        def convert():
            flags = rows.trained_flags(sessions, trained, truncation)
            when = rows.now()
            s, c = rows.session_tables(sessions, run=self.run, stage=self.stage, update=update, trained=flags,
                                       latencies=latencies, causes=causes, when=when)
            written = [("calls", update, c)]
            if verdicts is not None and any(verdicts):
                owners = [(x.task, x.group, x.sample, x.attempt, flag) for x, flag in zip(sessions, flags)]
                written.append(("verdicts", update, rows.owners_verdicts_table(
                    owners, verdicts, run=self.run, stage=self.stage, update=update, when=when)))
            if episodes is not None:
                written.append(("turns", update, turns_table(sessions, episodes, flags, run=self.run,
                                                             stage=self.stage, update=update, when=when)))
            return written + [("sessions", update, s)]

        if episodes is not None:
            episodes = tuple(episodes)
            if len(episodes) != len(sessions):
                raise ValueError(f"episodes has {len(episodes)} entries for {len(sessions)} sessions; "
                                 "give one episode per session, in the same order")
        self._write(convert)

    def prompts(self, prompts: Sequence[Any], *, update: int,
                decode: Callable[[Sequence[int]], str] | None = None) -> int:
        """Record the prompt of every task this writer has not recorded yet, under `update` (the
        update whose sessions first name it; call before `sessions`). Returns how many it queued.

        prompts: `Prompt` records, or `Task`s whose data holds `prompt_ids` and the reward fields
        (prompt_tasks' layout). decode: ids -> text for prompts without text, run here on the
        caller's thread and only for new tasks (store/prompts.py).
        """
        update = _step("update", update)
        if self.closed:
            raise StoreError(f"stage {self.stage!r} of run {self.run!r} is closed; open it again to write")
        new = prompt_rows.new_prompts(prompts, self.prompted, decode)
        if new:
            self._write(lambda: [("prompts", update, prompt_rows.prompts_table(
                new, run=self.run, stage=self.stage, update=update, when=rows.now()))])
            self.prompted.update(p.task for p in new)
        return len(new)

    def has_prompt(self, task: str) -> bool:
        """Whether this writer recorded the prompt of `task` (sessions.task)."""
        return str(task) in self.prompted

    def record(self, record: Any) -> None:
        """Record a scheduler record (SchedulerRecord or a mapping with its fields)."""
        table = rows.record_table(record, run=self.run, stage=self.stage, when=rows.now())
        self._write(lambda: [("scheduler_records", _step("updates", table["updates"][0].as_py()), table)])

    def metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record metrics logged at `step`."""
        step, metrics = _step("step", step), {str(k): float(v) for k, v in metrics.items()}
        self._write(lambda: [("metrics", step, rows.metrics_table(metrics, run=self.run, stage=self.stage,
                                                                  step=step, when=rows.now()))])

    def evaluations(self, results: Sequence[rows.Evaluation], *, step: int, split: str = "test",
                    verdicts=None) -> None:
        """Record evaluated answers of the policy at `step`.

        verdicts: None, or one list of Verdict records per answer (the programs a code reward
        ran for it). They land in `verdicts` with `update` = step, `group_id` = the answer's
        item, `task` = its task, sample and attempt 0 (rows.evaluation_owners).
        """
        step, results = _step("step", step), tuple(results)
        for r in results:
            if not isinstance(r, rows.Evaluation):
                raise TypeError(f"evaluations takes Evaluation records, got {type(r).__name__}")
        if verdicts is not None:
            verdicts = rows.check_verdicts(verdicts, len(results), "evaluation")

        def convert():
            when = rows.now()
            written = []
            if verdicts is not None and any(verdicts):
                written.append(("verdicts", step, rows.owners_verdicts_table(
                    rows.evaluation_owners(results), verdicts, run=self.run, stage=self.stage,
                    update=step, when=when)))
            return written + [("evaluations", step, rows.evaluations_table(
                results, run=self.run, stage=self.stage, step=step, split=split, when=when))]

        self._write(convert)

    def verdicts(self, session: Any, verdicts: Sequence[rows.Verdict], *, update: int,
                 trained: bool = True) -> None:
        """Record what a code reward's programs did for `session` (recorded at `update`)."""
        update = _step("update", update)
        verdicts, = rows.check_verdicts([verdicts], 1, "session")
        self._write(lambda: [("verdicts", update, rows.verdicts_table(
            session, verdicts, run=self.run, stage=self.stage, update=update, trained=trained,
            when=rows.now()))])

    def samples(self, record: Any, *, update: int | None = None,
                images: Sequence[bytes | None] | None = None) -> None:
        """Record the image samples of one Flow-GRPO rollout: each sample's reward, its group's
        mean and standard deviation, its advantage and whether it trained.

        record: a `FlowRolloutRecord` (or anything with its group, rewards, group_mean,
        group_std, advantages, kept and captions). update: trainer updates before the rollout
        (default: `record.step`). images: one PNG (bytes) per sample, or None to leave them out.
        """
        columns = rows.sample_columns(record, images)
        update = _step("update", getattr(record, "step", None) if update is None else update)
        self._write(lambda: [("samples", update, rows.samples_table(
            columns, run=self.run, stage=self.stage, update=update, when=rows.now()))])

    def checkpoint(self, step: int, path: str, kind: str = "checkpoint") -> None:
        """Record where the state (kind "checkpoint") or exported policy ("policy") of `step` is."""
        step = _step("step", step)
        path = os.path.abspath(os.fspath(path))
        self._write(lambda: [("checkpoints", step, rows.checkpoint_table(
            step, path, kind, run=self.run, stage=self.stage, when=rows.now()))])

    def tracker_run(self, step: int, tracker: str, tracker_run: str, *, name: str, location: str, parent=None) -> None:
        """Record a tracker's run (TensorBoard, MLflow, W&B) of this stage's attempt from `step`."""
        key = _step("step", step)
        row = {"run": self.run, "stage": self.stage, "step": key, "tracker": tracker, "tracker_run": tracker_run,
               "parent_run": parent, "name": name, "location": location}
        self._write(lambda: [("trackers", key, pa.Table.from_pylist(
            [{**row, "written_at": rows.now()}], schema=TABLES["trackers"].schema))])

    def sink(self) -> StoreSink:
        """A Trainer sink writing every delivered window to `metrics` and saves to `checkpoints`."""
        return StoreSink(self)

    def discard_after(self, step: int) -> None:
        """Drop rows earlier attempts of this stage recorded after `step` (the checkpoint this
        attempt resumed from) in every table; rows this writer wrote are kept."""
        step = _step("step", step)

        def job():
            for table, spec in TABLES.items():
                if spec.key is not None and os.path.lexists(os.path.join(self.store.directory, table,
                                                                         self.run, self.stage)):
                    self._stream(table).discard_after(step)

        self.worker.submit(job)

    # ----- life cycle --------------------------------------------------------------------------
    def flush(self) -> None:
        self.worker.flush()

    def finish(self, status: str = "completed", metrics: Mapping[str, float] | None = None,
               error: str | None = None) -> None:
        """Compact the stage's parts, mark it completed or failed, flush and release it."""
        status = _status(status)
        clean = {str(k): float(v) for k, v in (metrics or {}).items()}

        def compact():
            for stream in self.streams.values():
                stream.compact(everything=True)

        self.worker.submit(compact)
        self._stage_row(status=status, metrics=clean, error=error, finished_at=rows.now())
        self.finished = True
        self.close()

    def close(self) -> None:
        """Flush and release the stage lock (its status stays as last recorded)."""
        if self.closed:
            return
        try:
            self.worker.flush()
        finally:
            self.closed = True
            self.lock.release()

    def __enter__(self) -> StageWriter:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if self.finished or self.closed:
            return
        if error is not None:
            try:
                self.finish("failed", error=f"{kind.__name__}: {error}")
            except StoreError:
                self.close()
        else:
            self.finish("completed")


class StoreSink:
    """A Trainer sink (the hooks of `dew_lib.train.sinks.Sink`, which this package may not
    import): each delivered window of metrics becomes `metrics` rows at its step, and each
    checkpoint the Trainer saves becomes a `checkpoints` row. `close` flushes."""

    def __init__(self, stage: StageWriter):
        self.stage = stage

    def begin(self, first_step: int, total_steps: int) -> None:
        return None

    def before_step(self, step: int, state: Any) -> None:
        return None

    def note(self, step: int, text: str) -> None:
        return None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.stage.metrics(step, metrics)

    def checkpoint(self, step: int, path: str) -> None:
        self.stage.checkpoint(step, path)

    def close(self) -> None:
        self.stage.flush()


def _json(params: Mapping[str, Any] | None) -> str | None:
    if params is None:
        return None

    def default(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return repr(value)

    return json.dumps(dict(params), default=default, sort_keys=True)
