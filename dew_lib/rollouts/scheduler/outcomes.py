"""What a finished attempt means to the scheduler: the session it ended with, whether a session
can train, and whether it is still fresh enough to.

Not here: what the scheduler does about it (scheduler.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from dew_lib.records.sessions import Session, Status
from dew_lib.rollouts.scheduler.states import Attempt


def outcome(attempt: Attempt) -> Session:
    """The session an attempt ended with, relabelled with the scheduler's identity; a CANCELLED
    stand-in when it was cancelled and has none. A source that raised or returned something
    other than a Session for an attempt nobody cancelled is broken: that raises."""
    sample, group, future = attempt.sample, attempt.sample.group, attempt.future
    labels: dict[str, Any] = dict(task=group.task.id, group=group.id, sample=sample.index,
                                  attempt=attempt.number)
    if future is None:
        raise ValueError(f"attempt {attempt.number} of task {group.task.id!r} was never submitted")
    if future.cancelled():
        return Session(**labels, status=Status.CANCELLED, detail="cancelled before it finished")
    error = future.exception()
    if error is not None:
        if not attempt.cancelled:
            raise error
        return Session(**labels, status=Status.CANCELLED,
                       detail=f"cancelled; the source then raised {type(error).__name__}: {error}")
    session = future.result()
    if not isinstance(session, Session):
        if attempt.cancelled:
            return Session(**labels, status=Status.CANCELLED,
                           detail=f"cancelled; the source then returned {type(session).__name__}")
        raise TypeError(f"the source resolved a future to {type(session).__name__}, not a Session")
    return dataclasses.replace(session, **labels)


def admissible(session: Session, truncation: str) -> bool:
    """Whether a finished session can take its place in a group under `truncation`."""
    if session.status in (Status.COMPLETED, Status.AGENT_ERROR):
        return session.reward is not None
    if session.status is Status.TRUNCATED:
        return truncation != "score" or session.reward is not None
    return False


def oldest_version(session: Session, default: int) -> int:
    """The oldest policy version any of the session's calls was drawn under."""
    return min((call.version for call in session.calls), default=default)


def stale(session: Session, updates: int, max_lag: int, submitted_version: int) -> bool:
    """Whether training the session at `updates` would exceed `max_lag`."""
    return updates - oldest_version(session, submitted_version) > max_lag


def reusable(session: Session, updates: int, max_lag: int) -> bool:
    """Whether a session an earlier run finished can stand in for a draw at `updates`: drawn
    from weights the resumed state descends from, and within the bound."""
    versions = [call.version for call in session.calls] or [updates + 1]
    return max(versions) <= updates and updates - min(versions) <= max_lag


def noted_stale(session: Session, updates: int, max_lag: int, attempts: int) -> Session:
    """The session with why it was given up in its detail, for the run store."""
    version = oldest_version(session, updates)
    note = (f"stale: drawn under version {version}, {updates - version} updates behind update "
            f"{updates} (max_lag {max_lag}); given up after {attempts} attempts")
    return dataclasses.replace(session, detail=f"{session.detail}; {note}" if session.detail else note)


def let_go(attempt: Attempt, updates: int, max_lag: int) -> Session:
    """The session of an attempt the scheduler let go of before handling its report. One that
    came back stale from an abandoned group carries the stale note, as the sample that gave the
    group up does, so both records read the same whichever report came first."""
    session = outcome(attempt)
    if (attempt.recorded_as == "abandoned" and session.status not in (Status.INFRA_ERROR, Status.CANCELLED)
            and stale(session, updates, max_lag, attempt.version)):
        session = noted_stale(session, updates, max_lag, attempt.number + 1)
    return session


class Offers:
    """Sessions an earlier run finished, keyed by (task, group id, sample), waiting to stand in
    for a draw when the resumed stream re-reads their task."""

    def __init__(self):
        self._by_key: dict[tuple[str, int, int], Session] = {}

    def add(self, sessions: Iterable[Any], truncation: str) -> int:
        """Keep the admissible ones (Sessions, or rows with a `.session`); returns how many
        distinct samples are offered."""
        count = 0
        for item in sessions:
            session = getattr(item, "session", item)
            if not isinstance(session, Session):
                raise TypeError(f"reuse takes Session objects or StoredSession rows, got "
                                f"{type(item).__name__}")
            if not admissible(session, truncation):
                continue
            key = (session.task, session.group, session.sample)
            count += key not in self._by_key
            self._by_key[key] = session
        return count

    def take(self, task: str, group: int, sample: int) -> Session | None:
        return self._by_key.pop((task, group, sample), None)


def check_reward(session: Session, task: str, sample: int) -> None:
    """Refuse a settled session without a reward or with a non-finite one: a source reports an
    unscored session as INFRA_ERROR, and a reward must be a finite number."""
    if session.status in (Status.COMPLETED, Status.AGENT_ERROR) and session.reward is None:
        raise ValueError(
            f"the source reported a {session.status.value} session without a reward (task {task!r}, "
            f"sample {sample}); a source reports an unscored session as INFRA_ERROR")
    if session.reward is not None and not math.isfinite(float(session.reward)):
        raise ValueError(f"the source reported reward {session.reward} for task {task!r}, sample "
                         f"{sample}; rewards must be finite")
