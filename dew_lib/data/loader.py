"""The batching engine behind ChatMessages, PreferencePairs and Prompts.

A loader hands this module its records (plain Python objects, already validated), an `Encoder`
(a picklable callable that turns a chunk of records into arrays: tokenizing, checking) and a
`Layout` (how encoded items are placed into the rows of a fixed-shape batch). The engine then

- orders records: epoch e is a permutation seeded by `(Loading.seed, e)`, and a process takes
  the share `order[partition.index::partition.count]` (cut to an equal length for every process);
  the training stream is the epochs one after another, without end;
- encodes chunks of records on `Loading.workers` worker processes (worker.py), or in the
  producer thread when it is 0, keeping chunk order, so batches never depend on the number of
  workers;
- places items first-fit into the rows of the current batch; an item that fits nowhere closes
  the batch and opens the next, so batch n starts at a record that only lengths decide;
- prepares `Loading.read_buffer` batches ahead on a background thread;
- seeks: `stream.seek(n)` finds the record that batch n starts at from item lengths alone
  (arithmetic when every item has the same length, otherwise the lengths of the records before
  it, computed once and cached) and restarts the producer there. Resumed == uninterrupted.
  `stream.state()` names that record for the batch the stream stands at; the Trainer saves it
  with each checkpoint and `seek(n, state)` starts there without tokenizing anything before it.

Not here: reading files (readers.py) or anything format-specific (the loaders' own modules).
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from dew_lib.data.dataset import Batch, Dataset, Partition
from dew_lib.data.loading import Loading
from dew_lib.data.worker import WorkerPool
from dew_lib.options import integer

CHUNK = 32  # records per encoding task: large enough to amortize IPC, small enough to balance


class Encoder(Protocol):
    """Turns records into encoded items; runs in worker processes, so it must pickle.

    An encoder may also have `setup() -> [(function, argument)]`: calls each worker runs first.
    """

    def __call__(self, records: Sequence[Any]) -> list[Any]: ...

    def lengths(self, records: Sequence[Any]) -> list[int]: ...


class Layout(Protocol):
    """How encoded items become one batch of `rows` rows, `width` slots each (1 for one item a row)."""

    @property
    def width(self) -> int: ...

    @property
    def fixed_length(self) -> int | None:  # every item's length in slots, when it is known without encoding
        ...

    def length(self, item: Any) -> int: ...

    def build(self, rows: int, placed: list[tuple[int, int, Any]]) -> Batch: ...


class Planner:
    """First-fit placement of lengths into `rows` rows of `width` slots."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self.free = np.full(rows, width, np.int64)

    def place(self, length: int) -> tuple[int, int] | None:
        """(row, offset) for an item of this length, or None when no row of the batch has room."""
        room = np.flatnonzero(self.free >= length)
        if room.size == 0:
            return None
        row = int(room[0])
        offset = self.width - int(self.free[row])
        self.free[row] -= length
        return row, offset

    def reset(self) -> None:
        self.free[:] = self.width


class Order:
    """Which record sits at each position of a process's stream."""

    def __init__(self, count: int, seed: int | None, partition: Partition, shuffle: bool = True):
        if count < partition.count:
            raise ValueError(
                f"the data has {count} records, fewer than the {partition.count} processes that "
                "share it; give more records or run fewer processes"
            )
        self.count, self.seed, self.partition, self.shuffle = count, seed, partition, shuffle
        self.share = count // partition.count
        self._epoch, self._order = -1, np.zeros(0, np.int64)

    def epoch(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle and self.seed is not None:
                full = np.random.default_rng([self.seed, epoch]).permutation(self.count)
            else:
                full = np.arange(self.count)
            self._order = full[self.partition.index::self.partition.count][:self.share]
            self._epoch = epoch
        return self._order

    def __getitem__(self, position: int) -> int:
        epoch, offset = divmod(position, self.share)
        return int(self.epoch(epoch)[offset])


class Pipeline:
    """Records, their encoder and layout, and the worker pool that the loader's streams share."""

    def __init__(self, records: Sequence[Any], encoder: Encoder, layout: Layout, loading: Loading,
                 share: Pipeline | None = None):
        self.records, self.encoder, self.layout, self.loading = records, encoder, layout, loading
        self.lengths = np.full(len(records), -1, np.int64)  # cached item lengths, -1 = unknown
        self._share = share  # another pipeline whose worker pool this one uses (validation)
        self._pool: WorkerPool | None = None
        self._lock = threading.Lock()

    def pool(self) -> WorkerPool | None:
        if self.loading.workers == 0:
            return None
        if self._share is not None:
            return self._share.pool()
        with self._lock:
            if self._pool is None:
                self._pool = WorkerPool(self.loading.workers, getattr(self.encoder, "setup", None))
                weakref.finalize(self, self._pool.shutdown)
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    def map_chunks(self, function: Callable, indices: Iterator[np.ndarray],
                   stop: threading.Event | None = None) -> Iterator[tuple[np.ndarray, list]]:
        """Apply `function` to chunks of records, in order; on workers, several chunks in flight."""
        pool = self.pool()
        if pool is None:
            for chunk in indices:
                yield chunk, function([self.records[i] for i in chunk])
                if stop is not None and stop.is_set():
                    return
            return
        ahead = 2 * self.loading.workers + self.loading.read_buffer
        pending: collections.deque = collections.deque()
        try:
            for chunk in indices:
                pending.append((chunk, pool.submit(function, [self.records[i] for i in chunk])))
                if len(pending) >= ahead:
                    done, future = pending.popleft()
                    yield done, future.result()
                if stop is not None and stop.is_set():
                    return
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        finally:
            for _, future in pending:
                future.cancel()

    def ensure_lengths(self, indices: np.ndarray) -> None:
        """Fill the length cache for these records (tokenizing those not seen yet)."""
        missing = np.unique(indices[self.lengths[indices] < 0])
        if missing.size == 0:
            return
        chunks = (missing[i:i + CHUNK] for i in range(0, missing.size, CHUNK))
        for chunk, lengths in self.map_chunks(self.encoder.lengths, chunks):
            self.lengths[chunk] = np.minimum(lengths, self.layout.width)

    # ----- streams ------------------------------------------------------------------------------

    def train(self, partition: Partition, rows: int) -> BatchStream:
        return BatchStream(self, Order(len(self.records), self.loading.seed, partition), rows)

    def val(self, partition: Partition, rows: int) -> Iterator[Batch]:
        """One pass in file order; every process packs all records and keeps its slice of rows."""
        order = Order(len(self.records), None, Partition(0, 1), shuffle=False)
        stream = BatchStream(self, order, rows * partition.count, finite=True)
        lo, hi = partition.index * rows, (partition.index + 1) * rows
        for batch in stream:
            yield {name: value[lo:hi] for name, value in batch.items()}


def rows_per_process(batch: int, partition: Partition) -> int:
    """This process's rows of a global batch; every process gets the same number."""
    if batch % partition.count:
        raise ValueError(
            f"batch={batch} rows do not divide across {partition.count} processes; make the batch "
            f"a multiple of {partition.count}"
        )
    return batch // partition.count


def as_dataset(train: Pipeline, val: Pipeline | None, batch: int) -> Dataset:
    """The Dataset a loader's `.load(batch)` returns: each process reads its share of rows."""
    return Dataset(
        train=lambda partition: train.train(partition, rows_per_process(batch, partition)),
        val=None if val is None else (
            lambda partition: val.val(partition, rows_per_process(batch, partition))),
        records=len(train.records),
        batch=batch,
    )


def check_batch_size(owner: str, batch) -> int:
    return integer(f"{owner}.load(batch=...)", batch)


def check_sources(owner: str, records, path, val_records, val_path) -> None:
    """Exactly one training source and at most one validation source."""
    if (records is None) == (path is None):
        raise ValueError(f"{owner} takes exactly one source: records= (JSON strings) or path=, "
                         f"not {'both' if records is not None else 'neither'}")
    if val_records is not None and val_path is not None:
        raise ValueError(f"{owner} takes at most one validation source: val_records= or val_path=")


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_END = object()


class _Producer:
    """Builds batches from one stream position on a daemon thread into a bounded queue.

    It holds no reference to its BatchStream, so a stream that is dropped is collected, and its
    finalizer stops the thread.
    """

    def __init__(self, pipeline: Pipeline, order: Order, rows: int, start: int, limit: int | None):
        self.pipeline, self.order, self.rows, self.start, self.limit = pipeline, order, rows, start, limit
        self.stop = threading.Event()
        self.queue: queue.Queue = queue.Queue(maxsize=pipeline.loading.read_buffer)
        self.thread = threading.Thread(target=self._run, name="dew-data", daemon=True)
        self.thread.start()

    def _chunks(self) -> Iterator[np.ndarray]:
        buffer, position = [], self.start
        while self.limit is None or position < self.limit:
            buffer.append(self.order[position])
            position += 1
            if len(buffer) == CHUNK:
                yield np.asarray(buffer)
                buffer = []
        if buffer:
            yield np.asarray(buffer)

    def _run(self) -> None:
        pipeline, layout = self.pipeline, self.pipeline.layout
        try:
            planner, position = Planner(self.rows, layout.width), self.start
            placed: list[tuple[int, int, Any]] = []
            for records, items in pipeline.map_chunks(pipeline.encoder, self._chunks(), self.stop):
                for record, item in zip(records, items, strict=True):
                    length = layout.length(item)
                    pipeline.lengths[record] = length
                    spot = planner.place(length)
                    if spot is None:  # this record starts the next batch
                        if not self._put((layout.build(self.rows, placed), position)):
                            return
                        planner.reset()
                        placed = []
                        spot = planner.place(length)
                        if spot is None:
                            raise ValueError(f"an encoded item of {length} slots does not fit in an empty batch "
                                             f"of {self.rows} rows of {layout.width} slots")
                    placed.append((*spot, item))
                    position += 1
                if self.stop.is_set():
                    return
            if placed and not self._put((layout.build(self.rows, placed), position)):
                return
            self._put(_END)
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._put(_Failure(error))

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def halt(self) -> None:
        self.stop.set()
        while self.thread.is_alive():
            try:
                self.queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self.thread.join()

    def get(self):
        item = self.queue.get()
        if item is _END or isinstance(item, _Failure):
            self.queue.put(item)  # keep answering the same way
        return item


class BatchStream(Iterator[Batch]):
    """An iterator of batches with `seek(n)`; prepares batches ahead on a background thread."""

    def __init__(self, pipeline: Pipeline, order: Order, rows: int, finite: bool = False):
        self.pipeline, self.order, self.rows, self.finite = pipeline, order, rows, finite
        self.position = 0  # batches handed out
        self._start = 0  # stream record at which the next batch starts
        self._producer: _Producer | None = None

    def state(self) -> dict[str, int]:
        """Where the stream stands: batches handed out and the stream record the next one starts
        at. Saved with a checkpoint, it lets `seek` resume without tokenizing what came before."""
        return {"batch": self.position, "record": self._start}

    def seek(self, n: int, state: dict | None = None) -> None:
        """Move so that the next batch is batch n of this stream (n counts from 0).

        state: what `state()` returned when the stream stood at batch n; the stream then starts
        at its record directly. Without it, the record is found from the lengths of the records
        before it (tokenizing them once unless every item has a fixed length).
        """
        if n < 0:
            raise ValueError(f"seek position must be >= 0, got {n}")
        if state is not None and int(state.get("batch", -1)) != n:
            raise ValueError(f"the stream state {state} was saved at another batch than {n}")
        self.close()
        self._start = int(state["record"]) if state is not None else self._record_of_batch(n)
        self.position = n

    def _record_of_batch(self, n: int) -> int:
        layout = self.pipeline.layout
        if layout.fixed_length is not None:
            return n * self.rows * (layout.width // layout.fixed_length)
        planner, batches, position = Planner(self.rows, layout.width), 0, 0
        block = 1024
        while batches < n:
            positions = np.arange(position, position + block)
            records = np.asarray([self.order[int(p)] for p in positions])
            self.pipeline.ensure_lengths(records)
            for p, length in zip(positions, self.pipeline.lengths[records], strict=True):
                if planner.place(int(length)) is None:
                    batches += 1
                    planner.reset()
                    if batches == n:
                        return int(p)
                    planner.place(int(length))
            position += block
        return position

    def __next__(self) -> Batch:
        if self._producer is None:
            limit = self.order.share if self.finite else None
            self._producer = _Producer(self.pipeline, self.order, self.rows, self._start, limit)
            weakref.finalize(self, self._producer.stop.set)
        item = self._producer.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        batch, self._start = item
        self.position += 1
        return batch

    def close(self) -> None:
        """Stop the producer; a later next() or seek() starts it again where the stream is."""
        if self._producer is not None:
            self._producer.halt()
            self._producer = None


__all__ = ["BatchStream", "CHUNK", "Encoder", "Layout", "Order", "Pipeline", "Planner", "as_dataset",
           "check_batch_size", "check_sources", "rows_per_process"]
