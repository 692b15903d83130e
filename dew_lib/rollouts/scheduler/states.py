"""The scheduler's bookkeeping: attempts, samples, groups and task batches, and the states a
group moves through.

A group is one task's rollouts. It is RUNNING while its samples are drawn and COMPLETE once
`groups` of them finished; a finished sample that turns stale sends it back to RUNNING. It ends
ADMITTED (packed into the batch), CUT (complete, but its chains did not fit beside the groups
admitted before it), ABANDONED (too few samples left after `max_attempts`) or SURPLUS (still
open when its batch had admitted enough). `Group.move` refuses any other transition, so a
bookkeeping slip fails loudly instead of training the wrong rollouts.

Not here: when the moves happen (scheduler.py), whether a group fits (admission.py).
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from dew_lib.records.sessions import Session, Task


class GroupState(str, enum.Enum):
    """Where one task's group of rollouts stands."""

    RUNNING = "running"
    COMPLETE = "complete"
    ADMITTED = "admitted"
    CUT = "cut"
    ABANDONED = "abandoned"
    SURPLUS = "surplus"

    @property
    def open(self) -> bool:
        """Still drawing or waiting for admission: its rollouts can still train."""
        return self in (GroupState.RUNNING, GroupState.COMPLETE)


MOVES: dict[GroupState, frozenset[GroupState]] = {
    GroupState.RUNNING: frozenset({GroupState.COMPLETE, GroupState.ABANDONED, GroupState.SURPLUS}),
    GroupState.COMPLETE: frozenset({GroupState.RUNNING, GroupState.ADMITTED, GroupState.CUT,
                                    GroupState.ABANDONED, GroupState.SURPLUS}),
    GroupState.ADMITTED: frozenset(),
    GroupState.CUT: frozenset(),
    GroupState.ABANDONED: frozenset(),
    GroupState.SURPLUS: frozenset(),
}


class Attempt:
    """One submission of one sample: when, under which served version, and its future.
    `recorded_as`: the cause its session gets when the scheduler let go of it (cancelled it or
    abandoned its group) before handling its report, fixed then, so the report's timing never
    changes it."""

    __slots__ = ("sample", "number", "future", "submitted", "version", "cancelled", "recorded_as")

    def __init__(self, sample: Sample, number: int, submitted: float, version: int):
        self.sample, self.number = sample, number
        self.submitted, self.version = submitted, version
        self.future: Future | None = None
        self.cancelled = False
        self.recorded_as = "cancelled"


class Sample:
    """One of a group's samples, across its attempts."""

    __slots__ = ("group", "index", "attempt", "failures", "current", "session", "latency",
                 "given_up", "logged")

    def __init__(self, group: Group, index: int):
        self.group, self.index = group, index
        self.attempt = 0            # number of the current or next attempt
        self.failures = 0           # failed attempts (stale ones included)
        self.current: Attempt | None = None
        self.session: Session | None = None  # finished and admissible
        self.latency: float | None = None
        self.given_up = False
        self.logged: str | None = None  # the cause last recorded for `session`


class Group:
    """One task's samples; `finished` in completion order."""

    __slots__ = ("batch", "index", "id", "task", "samples", "finished", "state", "order")

    def __init__(self, batch: TaskBatch, index: int, group_id: int, task: Task, size: int):
        self.batch, self.index, self.id, self.task = batch, index, group_id, task
        self.samples = [Sample(self, i) for i in range(size)]
        self.finished: list[Sample] = []
        self.state = GroupState.RUNNING
        self.order = -1  # completion order among all groups

    def move(self, to: GroupState) -> None:
        """Go to state `to`; refuses a transition MOVES does not list."""
        if to not in MOVES[self.state]:
            raise RuntimeError(f"scheduler bookkeeping: group {self.id} (task {self.task.id!r}) "
                               f"cannot go from {self.state.value} to {to.value}")
        self.state = to


class TaskBatch:
    """One batch the task stream read: its position, data, groups and the inner stream's state
    before it was read (what a checkpoint taken before it resumes from)."""

    __slots__ = ("position", "data", "groups", "submitted", "stream_state")

    def __init__(self, position: int, data: Any, stream_state: Any = None):
        self.position, self.data, self.stream_state = position, data, stream_state
        self.groups: list[Group] = []
        self.submitted = False


def key_words(key: Any) -> list[int]:
    """The trainer's step key (typed or raw) as the words every attempt's seed starts from."""
    if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return [int(w) for w in np.asarray(key, np.uint32).ravel()]


def attempt_seed(words: list[int], sample: Sample) -> int:
    """The seed a sample's current attempt is drawn with: the step key's words, the group, the
    sample and the attempt, so a resumed run draws a re-read task as it was drawn before."""
    entropy = [*words, sample.group.id, sample.index, sample.attempt]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])
