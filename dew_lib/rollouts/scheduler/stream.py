"""The task stream a scheduler hands the Trainer: every batch it yields is registered with the
scheduler first, so rollouts for it can be drawn before the trainer reaches it.

`TaskReader` keeps what was read: the batches read ahead of the trainer, the one it was just
given, and every batch not yet consumed, by position. Opening the stream again (a resume) starts
a new generation; an iterator of an older one refuses to go on.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax

from dew_lib.data.dataset import Batch, Dataset, Partition
from dew_lib.records.sessions import Task
from dew_lib.rollouts.scheduler.states import Group, TaskBatch


class TaskStream:
    """The iterator `tasks(dataset).stream(...)` returns; see RolloutScheduler.tasks."""

    def __init__(self, scheduler: Any, generation: int):
        self.scheduler, self.generation = scheduler, generation

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.scheduler._next_batch(self.generation)

    def state(self) -> Any:
        """The inner stream's state at the next batch the trainer reads (not at the batches
        already read ahead), so a checkpoint resumes the data where the trainer stood; None
        when the inner stream cannot say."""
        return self.scheduler._stream_state(self.generation)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduledDataset(Dataset):
    """A Dataset whose training stream registers its batches with a scheduler."""

    scheduler: Any
    inner: Dataset

    def stream(self, partition: Partition, position: int = 0, state: Mapping | None = None
               ) -> Iterator[Batch]:
        return self.scheduler._open(self.inner.stream(partition, position, state), position)


def read_batch(inner: Iterator[Batch], position: int, task_fn: Callable[[Batch], Sequence[Task]],
               size: int, tasks_per_batch: int | None) -> TaskBatch:
    """The next batch of `inner` at `position` with a group of `size` samples per task; its
    group ids are `position * tasks + index`, so a re-read task keeps its id after a resume. In
    a multi-process job `tasks` and `index` count the job's whole batch, each process's rows
    after those of the processes before it: a task has the group id (and so the seeds) it would
    have in one process reading the same global batches.
    Raises StopIteration at the end of `inner`, which ends the trainer's stream as usual."""
    state = getattr(inner, "state", None)
    stream_state = state() if state is not None else None
    data = next(inner)
    tasks = list(task_fn(data))
    if not tasks or not all(isinstance(t, Task) for t in tasks):
        raise ValueError(f"tasks(batch) must return a nonempty list of Task, got {tasks!r:.200}")
    if tasks_per_batch is not None and len(tasks) != tasks_per_batch:
        raise ValueError(
            f"the batch at position {position} has {len(tasks)} tasks and earlier ones "
            f"{tasks_per_batch}; the scheduler's group ids need a fixed batch size")
    batch = TaskBatch(position, data, stream_state)
    first = (position * jax.process_count() + jax.process_index()) * len(tasks)
    batch.groups = [Group(batch, i, first + i, task, size) for i, task in enumerate(tasks)]
    return batch


class TaskReader:
    """The scheduler's side of its task stream; see the module docstring."""

    def __init__(self, task_fn: Callable[[Batch], Sequence[Task]], size: int):
        self.task_fn, self.size = task_fn, size
        self.generation = 0
        self.inner: Iterator[Batch] | None = None
        self.next_position = 0
        self.tasks_per_batch: int | None = None
        self.ahead: collections.deque[TaskBatch] = collections.deque()  # read, not yet yielded
        self.given: TaskBatch | None = None     # yielded, waiting for its call
        self.batches: dict[int, TaskBatch] = {}  # read and not yet consumed, by position

    def open(self, inner: Iterator[Batch], position: int) -> int:
        """Start reading `inner` at `position`; returns the new generation."""
        self.generation += 1
        self.inner, self.next_position = inner, int(position)
        self.ahead.clear()
        self.batches.clear()
        self.given = None
        return self.generation

    def _check(self, generation: int) -> None:
        if generation != self.generation:
            raise RuntimeError("this task stream was replaced by a newer one (the scheduler's "
                               "tasks(dataset) stream was opened again); read from the new one")

    def next(self, generation: int) -> Batch:
        """The next batch for the trainer: the first one read ahead, or a new one."""
        self._check(generation)
        batch = self.ahead.popleft() if self.ahead else self.read()
        self.given = batch
        return batch.data

    def state(self, generation: int) -> Any:
        """The inner stream's state at the batch the trainer reads next."""
        self._check(generation)
        if self.ahead:
            return self.ahead[0].stream_state
        state = getattr(self.inner, "state", None)
        return state() if state is not None else None

    def read(self) -> TaskBatch:
        """Read one batch from the inner stream and register it."""
        batch = read_batch(self.inner, self.next_position, self.task_fn, self.size,
                           self.tasks_per_batch)
        self.tasks_per_batch = len(batch.groups)
        self.batches[batch.position] = batch
        self.next_position += 1
        return batch
