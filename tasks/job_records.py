"""What an asynchronous GRPO stage records when it trains as a job of several processes.

Each process runs its own RolloutScheduler (dew_lib.recipes.ScheduledRollout), which records
whenever it settles sessions: how often depends on that process's own timing, so the calls
cannot meet in a collective as a synchronous stage's do (tasks/stage_job.py `GatheredWriter`).
`DeferredWriter` keeps them instead, and after every trainer call, which every process makes
once a step, every process's are gathered and process 0 writes them to the store, in process
order, with the processes' scheduler records of the update merged into one (`merged_record`).

What a process settles after its last trainer call (cancelled or pending at close, or a call
that failed) is written by process 0 for its own scheduler only: the other processes' rows of
that kind are not recorded.

Not here: the synchronous stages' gathering (stage_job.py), the scheduler (dew_lib.rollouts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dew_lib.records.scheduler import SchedulerRecord
from dew_lib.store.prompts import new_prompts
from dew_lib.train import distributed

SUMMED = ("sessions/reused", "batch/response_tokens")  # metrics that count; the others are shares


class DeferredWriter:
    """A StageWriter's recording methods, kept until `gather` (module docstring).

    writer: the stage's StageWriter on process 0, None on the others.
    """

    def __init__(self, writer):
        self.writer = writer
        self.held: list[tuple[str, Any]] = []
        self.prompted: set[str] = set()  # tasks whose prompt this process has handed on

    def has_prompt(self, task) -> bool:
        return str(task) in self.prompted

    def prompts(self, prompts, *, update: int, decode=None) -> int:
        """Keep the prompts of tasks not handed on yet, decoded here (process 0 writes them)."""
        new = new_prompts(prompts, self.prompted, decode)
        self.prompted.update(p.task for p in new)
        if new:
            self.held.append(("prompts", (new, update)))
        return len(new)

    def sessions(self, sessions, *, update: int, **given) -> None:
        self.held.append(("sessions", (list(sessions), update, given)))

    def record(self, record: SchedulerRecord) -> None:
        self.held.append(("record", record))

    def after_each(self, rollout: Callable) -> Callable:
        """`rollout`, gathering what every process kept after each call; a failed call writes
        what process 0 kept and raises."""

        def call(state, batch, key):
            try:
                packed = rollout(state, batch, key)
            except BaseException:
                self.write_own()
                raise
            self.gather()
            return packed

        return call

    def gather(self) -> None:
        """Every process's kept calls, written by process 0; every process must call it."""
        every = distributed.every_process(self.held)
        self.held = []
        if self.writer is not None:
            self._write([entry for part in every for entry in part])

    def write_own(self) -> None:
        """What this process kept, written if it is process 0 (no collective: at close)."""
        held, self.held = self.held, []
        if self.writer is not None:
            self._write(held)

    def _write(self, entries: list[tuple[str, Any]]) -> None:
        records: dict[int, list[SchedulerRecord]] = {}
        for kind, entry in entries:
            if kind == "prompts":
                prompts, update = entry
                self.writer.prompts(prompts, update=update)
            elif kind == "sessions":
                sessions, update, given = entry
                self.writer.sessions(sessions, update=update, **given)
            else:
                records.setdefault(entry.updates, []).append(entry)
        for merged in map(merged_record, records.values()):
            self.writer.record(merged)


def merged_record(records: Sequence[SchedulerRecord]) -> SchedulerRecord:
    """One record for the processes' records of one update: the counts added, the oldest
    version and so the largest lag, the longest wait, and the metrics' maxima for `*/max`,
    sums for counts (`SUMMED`), else their mean weighted by the groups each process admitted
    (so `latency/p50` and `latency/p90` are the processes' percentiles averaged, not the job's)."""
    if len(records) == 1:
        return records[0]
    weights = np.array([r.groups for r in records], np.float64)
    weights = weights / weights.sum() if weights.sum() else np.full(len(records), 1 / len(records))
    metrics: dict[str, float] = {}
    for name in dict.fromkeys(n for r in records for n in r.metrics):
        values = [r.metrics[name] for r in records if name in r.metrics]
        if name.endswith("/max"):
            metrics[name] = max(values)
        elif name in SUMMED:
            metrics[name] = sum(values)
        else:
            shares = [w for r, w in zip(records, weights, strict=True) if name in r.metrics]
            metrics[name] = float(np.dot(values, shares) / sum(shares)) if sum(shares) else float(np.mean(values))
    resubmitted: dict[str, int] = {}
    for record in records:
        for cause, count in record.resubmitted.items():
            resubmitted[cause] = resubmitted.get(cause, 0) + count
    version = min(r.version for r in records)
    return dataclasses.replace(records[0], version=version, lag=records[0].updates - version,
                               groups=sum(r.groups for r in records), resubmitted=resubmitted,
                               cancelled=sum(r.cancelled for r in records),
                               abandoned=sum(r.abandoned for r in records), cut=sum(r.cut for r in records),
                               waited=max(r.waited for r in records), metrics=metrics)


__all__ = ["DeferredWriter", "merged_record"]
