"""The task stream a scheduler hands the Trainer: every batch it yields is registered with the
scheduler first, so rollouts for it can be drawn before the trainer reaches it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from dew_lib.data.dataset import Batch, Dataset, Partition


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
