"""What the asynchronous scheduler reports: one `SchedulerRecord` and one `SessionLog` per trainer call,
and the words it uses for why a session was settled or drawn again.

CAUSES name what happened to a recorded session (the run store's `sessions.cause` column);
RESUBMIT_CAUSES name why a sample was drawn again (or, past `max_attempts`, abandoned).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from dew_lib.records.sessions import Session

CAUSES = ("pending", "admitted", "discarded", "cancelled", "resubmitted", "abandoned", "cut")
RESUBMIT_CAUSES = ("infra_error", "cancelled", "stale", "timeout", "unscored")


@dataclasses.dataclass(frozen=True)
class SchedulerRecord:
    """What one trainer call consumed and what it cost.

    updates: the trainer's optimizer updates at the call. version, lag: the oldest admitted
    call's version and updates - version. groups: groups admitted. resubmitted: resubmissions
    during the call by cause (infra_error, cancelled, stale, timeout, unscored). cancelled:
    in-flight rollouts cancelled as surplus, stale or abandoned. abandoned: groups given up
    after max_attempts. cut: complete groups left out because their chains did not fit the
    rows beside the groups admitted before them. waited: seconds the trainer waited for its
    rollouts. metrics: `session_metrics` over the admitted rollouts and their packed batch.
    """

    updates: int
    version: int
    lag: int
    groups: int
    resubmitted: Mapping[str, int]
    cancelled: int
    abandoned: int
    cut: int
    waited: float
    metrics: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class SessionLog:
    """The sessions one trainer call settled, with why: what `StageWriter.sessions` records.

    update: the trainer's updates at the call. causes: per session, one of pending (finished,
    waiting for its group or batch), admitted, discarded (stale), cancelled, resubmitted (a
    failed attempt that was drawn again), abandoned (a failed attempt not drawn again, or a
    member of an abandoned group) and cut. latencies: seconds from submission to finish (None
    for a session reused from a previous run). trained: whether the session is in the batch's
    loss (admitted and training under the truncation policy).
    """

    update: int
    sessions: tuple[Session, ...]
    causes: tuple[str, ...]
    latencies: tuple[float | None, ...]
    trained: tuple[bool, ...]
