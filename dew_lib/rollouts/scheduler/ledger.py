"""The scheduler's ledger: every session it settled since the last flush, with its cause, and
the counts that make one trainer call's `SchedulerRecord`.

Not here: deciding the causes (scheduler.py); storing them (the caller's `session_log`, e.g. a
run-store `StageWriter`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dew_lib.records.scheduler import SchedulerRecord, SessionLog
from dew_lib.records.sessions import Session
from dew_lib.rollouts.packing import session_metrics, trains
from dew_lib.rollouts.scheduler.states import Group, Sample, TaskBatch


class Ledger:
    """Entries (session, cause, latency, trained) and the current call's counts."""

    def __init__(self, session_log: Callable[[SessionLog], None] | None):
        self.session_log = session_log
        self.entries: list[tuple[Session, str, float | None, bool]] = []
        self.reset()

    def reset(self) -> None:
        """Start a trainer call's counts."""
        self.resubmitted: collections.Counter[str] = collections.Counter()
        self.cancelled = self.abandoned = self.cut = 0

    def session(self, session: Session, cause: str, latency: float | None,
                trained: bool = False) -> None:
        self.entries.append((session, cause, latency, trained))

    def sample(self, sample: Sample, cause: str, trained: bool = False) -> None:
        """Record a finished sample's session under `cause`, remembering that it was recorded."""
        self.entries.append((sample.session, cause, sample.latency, trained))
        sample.logged = cause

    def admit(self, groups: Sequence[Group], size: int, truncation: str, *, position: int,
              max_attempts: int) -> tuple[list[Session], list[float | None]]:
        """Record the first `size` finished samples of each admitted group as admitted and return
        their sessions (what `pack` trains) and latencies; with no group at all, raise why."""
        if not groups:
            raise RuntimeError(
                f"no group of the batch at position {position} could be admitted ({self.abandoned} "
                f"abandoned after max_attempts={max_attempts}, {self.cut} cut, resubmissions "
                f"{dict(self.resubmitted)}); the source keeps failing: see the causes and details of "
                "the recorded sessions")
        sessions: list[Session] = []
        latencies: list[float | None] = []
        for sample in (sample for group in groups for sample in group.finished[:size]):
            assert sample.session is not None, "a finished sample holds its session"
            self.sample(sample, "admitted", trained=trains(sample.session, truncation))
            sessions.append(sample.session)
            latencies.append(sample.latency)
        return sessions, latencies

    def record(self, updates: int, sessions: Sequence[Session], packed: Mapping[str, Any],
               latencies: Sequence[float | None], *, groups: int, waited: float,
               truncation: str) -> SchedulerRecord:
        """The call's record: its counts, the oldest admitted version and the admitted
        sessions' metrics over their packed batch (a latency of None is a reused session)."""
        version = int(min((call.version for s in sessions for call in s.calls), default=updates))
        metrics = session_metrics(sessions, packed, latencies=[x for x in latencies if x is not None],
                                  version=updates, truncation=truncation)
        metrics["sessions/reused"] = float(sum(x is None for x in latencies))
        return SchedulerRecord(updates=updates, version=version, lag=updates - version,
                               groups=groups, resubmitted=dict(self.resubmitted),
                               cancelled=self.cancelled, abandoned=self.abandoned, cut=self.cut,
                               waited=waited, metrics=metrics)

    def flush(self, updates: int, batches: Iterable[TaskBatch]) -> None:
        """Hand the settled sessions, and the finished ones still waiting (as pending), to
        session_log."""
        for batch in batches:
            for group in batch.groups:
                if group.state.open:
                    for sample in group.finished:
                        if sample.logged is None:
                            self.sample(sample, "pending")
        entries, self.entries = self.entries, []
        if self.session_log is None or not entries:
            return
        sessions, causes, latencies, trained = zip(*entries, strict=True)
        self.session_log(SessionLog(updates, sessions, causes, latencies, trained))
