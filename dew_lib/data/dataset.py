"""Dataset: how the Trainer gets batches, and how it finds its place again after a restart.

A Dataset wraps a `train(partition)` callable that returns an iterator of batches (dicts of
fixed-shape NumPy arrays). The Trainer counts the batches it consumes; that count is the data
position stored in checkpoints, together with the iterator's `state()` when it has one. On resume
the stream is reopened and moved forward to the position: through the iterator's own
`seek(n, state)` when it has one (the loaders do, and with the saved state they start at the
right record without replaying anything), otherwise by drawing and discarding n batches, which
is exact for any deterministic stream.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

Batch = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which share of the data this process reads: `index` of `count` equal shares."""

    index: int = 0
    count: int = 1

    @classmethod
    def current(cls) -> Partition:
        return cls(jax.process_index(), jax.process_count())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dataset:
    """Training and validation streams.

    train: `partition -> iterator of batches`; may be infinite.
    val: `partition -> iterable of batches`, finite, read in full at every evaluation; or None.
    records: examples in one pass over the training data, when known (for progress and epochs).
    batch: global batch size (rows per step across all processes).
    """

    train: Callable[[Partition], Iterable[Batch]]
    val: Callable[[Partition], Iterable[Batch]] | None = None
    records: int | None = None
    batch: int

    def __post_init__(self):
        if not callable(self.train):
            raise TypeError("Dataset.train must be a callable `partition -> iterator of batches`")
        if self.val is not None and not callable(self.val):
            raise TypeError("Dataset.val must be None or a callable `partition -> batches`")
        if self.batch <= 0:
            raise ValueError(f"Dataset.batch must be positive, got {self.batch}")

    def stream(self, partition: Partition, position: int = 0, state: Mapping | None = None
               ) -> Iterator[Batch]:
        """The training stream moved forward past `position` batches.

        state: what the stream's `state()` returned at that position (saved in checkpoints), for
        iterators whose `seek` takes it; it lets them resume without replaying earlier records.
        """
        iterator = iter(self.train(partition))
        if position:
            seek = getattr(iterator, "seek", None)
            if seek is not None:
                seek(position, state) if state is not None else seek(position)
            else:
                skipped = sum(1 for _ in itertools.islice(iterator, position))
                if skipped < position:
                    raise ValueError(
                        f"the training stream ended after {skipped} batches but the checkpoint "
                        f"resumes at batch {position}; the data changed since the checkpoint"
                    )
        return iterator


def describe(batch: Mapping[str, Any]) -> str:
    """`name: shape dtype` for every field, for error messages."""
    return ", ".join(
        f"{k}: {tuple(np.shape(v))} {getattr(v, 'dtype', type(v).__name__)}" for k, v in batch.items()
    )
