"""Parquet parts on disk: durable, atomic, replaceable, compacted, under a file lock.

A stream is the rows one writer keeps for one table of one stage: `store/<table>/<run>/<stage>`.
That path is a symbolic link to a generation directory under `store/.gens/`, which holds the
stream's parts:

    <key:012d>-<seq:04d>.parquet           a loose part: rows written under one key (step)
    c<first:012d>-<last:012d>-<id>.parquet a compacted part; its Parquet metadata lists its keys

Every file is written under a temporary name outside every view's glob, flushed, fsync'ed and
renamed into place, so a reader sees a part whole or not at all and a crash keeps every part that
was renamed. Adding a part, or replacing the only part of a key by one with the same name, is one
rename. Anything that removes rows (compaction, or a retry that rewrites a key an earlier attempt
stored in several parts) builds a new generation directory (hard links to the parts it keeps plus
the new ones) and swaps the link with one rename. A generation directory therefore never loses a
file while it exists. Readers never go through the link: they read snapshots (snapshot.py) that
name concrete generation directories, and a generation is removed only once no snapshot a reader
may hold names it (snapshot.collect). A stream reports every change a snapshot must follow (a new
generation, or the first part of an empty one) through `on_change`; a Stream without one
publishes a snapshot itself. Every link move also counts itself in `store/.locks/_swap.lock`
(`swap_count`, `swaps_since`), under a shared lock on that file.

The first write of a key in a writer's lifetime replaces whatever earlier lifetimes stored under
that key; later writes of it in the same lifetime add parts. That is what makes a retried task
write no duplicate rows. One writer per stream at a time: a `flock` on `store/.locks/` enforces it
and is released by the kernel if the process dies.

Not here: what the rows hold (schema.py, writer.py), snapshots (snapshot.py), queries (store.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dew_lib.store.schema import placeholder

ROW_GROUP = 122_880  # DuckDB's own row-group size: scans split across threads by row group
_LOOSE = re.compile(r"^(\d{12})-(\d{4})\.parquet$")
_COMPACTED = re.compile(r"^c(\d{12})-(\d{12})-([0-9a-f]{8})\.parquet$")
GEN = re.compile(r"^g(\d{6})$")
KEYS_METADATA = b"dew.keys"


class StoreError(RuntimeError):
    """The run store cannot do what was asked (the message says why and what to do)."""


class StoreBusy(StoreError):
    """Another live process holds the lock this writer needs."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, value, **dump) -> None:
    """Write `value` as JSON to `path` so a reader sees the old file or the whole new one, and a
    crash after the return keeps the new one: a unique temporary file in the same directory,
    fsync'ed, renamed over `path`, then the directory fsync'ed. `dump` goes to `json.dump`."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "x", encoding="utf-8") as out:
            json.dump(value, out, **dump)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def _encoding(schema: pa.Schema) -> dict:
    """Parquet settings per column. Scalar columns: LZ4, which DuckDB decodes as fast as its own
    files; dictionaries for strings and integers (run, status, step), plain floats; min/max
    statistics so DuckDB skips row groups. Token lists: zstd (a third smaller, and rarely
    scanned whole), no dictionary or statistics (they cost more time than they save)."""
    compression, dictionary, statistics = {}, [], []
    for field in schema:
        nested = pa.types.is_list(field.type) or pa.types.is_map(field.type)
        compression[field.name] = "zstd" if pa.types.is_list(field.type) else "lz4"
        if not nested:
            statistics.append(field.name)
            if not pa.types.is_floating(field.type) and not pa.types.is_timestamp(field.type):
                dictionary.append(field.name)
    return {"compression": compression, "use_dictionary": dictionary, "write_statistics": statistics}


def write_durable(table: pa.Table, path: str, metadata: dict[bytes, bytes] | None = None) -> int:
    """Write `table` to `path` (a temporary name) and fsync it; returns its size in bytes."""
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    with open(path, "wb") as out:
        pq.write_table(table, out, row_group_size=ROW_GROUP, **_encoding(table.schema))
        out.flush()
        os.fsync(out.fileno())
    return os.path.getsize(path)


def replace_file(table: pa.Table, path: str, tmp_dir: str) -> None:
    """Atomically write `table` as `path` (creating or replacing it), durably."""
    os.makedirs(tmp_dir, exist_ok=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(tmp_dir, f"{uuid.uuid4().hex}.tmp")
    write_durable(table, tmp)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


class FileLock:
    """An flock on `path`; the kernel drops it when the process dies.

    A lock another process holds raises StoreBusy after `wait` seconds (`dew runs` probes locks
    for an instant, so a writer that meets a probe retries instead of failing); `blocking`
    waits as long as it takes.
    """

    def __init__(self, path: str, *, shared: bool = False, blocking: bool = False, wait: float = 2.0,
                 what: str = ""):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(self.fd, mode if blocking else mode | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(self.fd)
                    raise
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise StoreBusy(
                        f"{what or path} is being written by another live process (lock {path}); "
                        "wait for it to finish, or write under another run or stage name"
                    ) from None
                time.sleep(0.02)
        if not shared:
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


def held(path: str) -> bool:
    """Whether some live process holds a lock on `path` (shared or exclusive)."""
    if not os.path.exists(path):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the probe's own lock
    return False


def swap_lock(store_dir: str) -> str:
    return os.path.join(store_dir, ".locks", "_swap.lock")


def swap_count(store_dir: str) -> int:
    """How many generation swaps the store has seen (the size of its swap lock file)."""
    try:
        return os.path.getsize(swap_lock(store_dir))
    except FileNotFoundError:
        return 0


def swaps_since(store_dir: str, count: int) -> bool:
    """Whether a link moved since `swap_count` returned `count`, or one is moving now."""
    # The lock first: a change counts itself before it lets go, so once the lock is seen free,
    # the count has every change that started before.
    return held(swap_lock(store_dir)) or swap_count(store_dir) != count


@contextlib.contextmanager
def announced_swap(store_dir: str):
    """Hold the swap lock (shared) around a change that hides files from a listing in progress,
    and count the change, so readers that overlapped it rerun."""
    guard = FileLock(swap_lock(store_dir), shared=True, blocking=True)
    try:
        yield
        with open(guard.path, "ab", buffering=0) as counter:
            counter.write(b".")
    finally:
        guard.release()


def _encode_keys(keys) -> bytes:
    """Sorted keys as JSON `[first, last]` runs: a long stage's contiguous steps stay short."""
    runs: list[list[int]] = []
    for key in sorted(keys):
        if runs and runs[-1][1] == key - 1:
            runs[-1][1] = key
        else:
            runs.append([key, key])
    return json.dumps(runs).encode()


def _decode_keys(raw: bytes) -> frozenset[int]:
    return frozenset(k for first, last in json.loads(raw) for k in range(first, last + 1))


def _read(path: str) -> pa.Table:
    try:
        return pq.ParquetFile(path).read().replace_schema_metadata(None)
    except (OSError, pa.ArrowException) as error:  # a damaged part: say which (damage.py)
        raise StoreError(f"cannot read the part {path} ({type(error).__name__}: {error}); `dew store check` "
                         "lists damaged files and `dew store repair` moves them aside") from error


def _tier(size: int) -> int:
    """Compacted parts within a factor of 4 in size share a tier."""
    return max(0, (size >> 16).bit_length() // 2)


def loose_name(key: int, seq: int) -> str:
    return f"{key:012d}-{seq:04d}.parquet"


class Stream:
    """One writer's view of one stream's current generation (see the module docstring).

    compact_after: fold loose parts into one compacted part once this many exist, keeping the
    parts of the newest `keep_loose` keys loose (a retry usually rewrites those). merge_after:
    merge compacted parts smaller than `target_bytes` once this many exist. on_change: called
    when readers' snapshots must change to show this stream's rows (None: publish one now).
    """

    def __init__(self, store_dir: str, table: str, run: str, stage: str, key_column: str, *,
                 compact_after: int = 4, keep_loose: int = 1, merge_after: int = 2,
                 target_bytes: int = 128 << 20, on_change: Callable[[], None] | None = None):
        self.table, self.key_column = table, key_column
        self.store_dir = store_dir
        self.link = os.path.join(store_dir, table, run, stage)
        self.home = os.path.join(store_dir, ".gens", table, run, stage)
        self.tmp = os.path.join(self.home, "tmp")
        self.compact_after, self.keep_loose = compact_after, keep_loose
        self.merge_after, self.target_bytes = merge_after, target_bytes
        self.placeholder = placeholder(store_dir, table)  # a zero-row part older Dews wrote
        self.on_change = on_change
        self.written: dict[int, int] = {}  # keys written in this lifetime -> next seq
        self.loose: dict[int, list[str]] = {}
        self.compacted: dict[str, tuple[frozenset[int], int]] = {}
        self._open()

    # ----- generations ------------------------------------------------------------------------
    def _open(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)  # what a killed writer left half written
        os.makedirs(self.tmp)
        os.makedirs(os.path.dirname(self.link), exist_ok=True)
        if os.path.islink(self.link):
            self.gen = os.path.realpath(self.link)
        else:
            self.gen = os.path.join(self.home, "g000001")
            os.makedirs(self.gen, exist_ok=True)
            self._point_link(self.gen)
        newest = int(os.path.basename(self.gen)[1:])
        for name in os.listdir(self.home):  # generations a killed swap built but never linked
            if (match := GEN.match(name)) and int(match[1]) > newest:
                shutil.rmtree(os.path.join(self.home, name), ignore_errors=True)
        # Older generations may still be read through a snapshot: snapshot.collect removes them.
        for name in os.listdir(self.gen):
            if match := _LOOSE.match(name):
                self.loose.setdefault(int(match[1]), []).append(name)
            elif _COMPACTED.match(name):
                path = os.path.join(self.gen, name)
                keys = _decode_keys(pq.read_metadata(path).metadata[KEYS_METADATA])
                self.compacted[name] = (keys, os.path.getsize(path))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
        else:
            from dew_lib.store import snapshot  # imports this module

            snapshot.publish(self.store_dir)

    def _point_link(self, target: str) -> None:
        relative = os.path.relpath(target, os.path.dirname(self.link))
        tmp = os.path.join(self.tmp, f"link-{uuid.uuid4().hex}")
        os.symlink(relative, tmp)
        with announced_swap(self.store_dir):
            os.replace(tmp, self.link)  # one rename: readers follow the old target or the new one
            fsync_dir(os.path.dirname(self.link))

    def _swap(self, drop: set[str], rewrite: dict[str, frozenset[int]], add: dict[str, str]) -> None:
        """A new generation: the current parts minus `drop`, compacted parts in `rewrite` without
        the given keys, plus `add` (name -> durable temporary file)."""
        number = int(os.path.basename(self.gen)[1:]) + 1
        new = os.path.join(self.home, f"g{number:06d}")
        os.makedirs(new)
        for name in os.listdir(self.gen):
            if name in drop or name in rewrite:
                continue
            os.link(os.path.join(self.gen, name), os.path.join(new, name))
        for name, remove in rewrite.items():
            keys, _ = self.compacted.pop(name)
            table = _read(os.path.join(self.gen, name))
            keep = pc.invert(pc.is_in(table[self.key_column], pa.array(sorted(remove), pa.int64())))
            table = table.filter(keep)
            if table.num_rows:
                rest = keys - remove
                new_name = self._compacted_name(min(rest), max(rest))
                size = write_durable(table, os.path.join(new, new_name),
                                     {KEYS_METADATA: _encode_keys(rest)})
                self.compacted[new_name] = (frozenset(rest), size)
        for name, tmp in add.items():
            os.replace(tmp, os.path.join(new, name))
        fsync_dir(new)
        self.gen = new
        self._point_link(new)  # the old generation stays until no snapshot names it
        self._changed()

    @staticmethod
    def _compacted_name(first: int, last: int) -> str:
        return f"c{first:012d}-{last:012d}-{uuid.uuid4().hex[:8]}.parquet"

    def _tmp_file(self, table: pa.Table, metadata=None) -> tuple[str, int]:
        path = os.path.join(self.tmp, f"{uuid.uuid4().hex}.tmp")
        return path, write_durable(table, path, metadata)

    # ----- writing ----------------------------------------------------------------------------
    def write(self, key: int, table: pa.Table) -> None:
        """Commit `table` (rows of one key) durably; see the module docstring for replacement."""
        seq, was_empty = self.written.get(key), not self.loose and not self.compacted
        if seq is None:
            name = loose_name(key, 0)
            stale_loose = set(self.loose.get(key, []))
            stale_compacted = {c: frozenset([key]) for c, (keys, _) in self.compacted.items() if key in keys}
            tmp, _ = self._tmp_file(table)
            if not stale_compacted and stale_loose <= {name}:
                os.replace(tmp, os.path.join(self.gen, name))
                fsync_dir(self.gen)
            else:
                self._swap(stale_loose, stale_compacted, {name: tmp})
            self.loose[key] = [name]
            self.written[key] = 1
        else:
            name = loose_name(key, seq)
            tmp, _ = self._tmp_file(table)
            os.replace(tmp, os.path.join(self.gen, name))
            fsync_dir(self.gen)
            self.loose.setdefault(key, []).append(name)
            self.written[key] = seq + 1
        if os.path.exists(self.placeholder):
            try:  # an older Dew's views read it; this one's snapshots never name it
                with announced_swap(self.store_dir):
                    os.remove(self.placeholder)
            except FileNotFoundError:
                pass
        if was_empty:  # snapshots leave an empty generation out: show this one now
            self._changed()
        self.compact()

    def discard_after(self, key: int) -> None:
        """Drop rows earlier lifetimes stored under keys above `key` (one generation swap)."""
        drop = {n for k, names in self.loose.items() if k > key and k not in self.written for n in names}
        rewrite = {c: frozenset(k for k in keys if k > key and k not in self.written)
                   for c, (keys, _) in self.compacted.items()}
        rewrite = {c: keys for c, keys in rewrite.items() if keys}
        if drop or rewrite:
            self._swap(drop, rewrite, {})
            self.loose = {k: v for k, v in self.loose.items() if not set(v) & drop}

    def compact(self, everything: bool = False) -> None:
        """Fold loose parts and merge small compacted ones (all of them when `everything`)."""
        keys = sorted(self.loose)
        small = sorted((c for c, (_, size) in self.compacted.items() if size < self.target_bytes),
                       key=lambda c: min(self.compacted[c][0]))
        if everything:
            fold, merge = keys, small
        else:
            loose_count = sum(map(len, self.loose.values()))
            fold = keys[: max(len(keys) - self.keep_loose, 0)] if loose_count >= self.compact_after else []
            merge = []
            tiers: dict[int, list[str]] = {}  # size tiers, so each byte is rewritten O(log n) times
            for c in small:
                tiers.setdefault(_tier(self.compacted[c][1]), []).append(c)
            for members in tiers.values():
                if len(members) >= self.merge_after:
                    merge += members
        if sum(len(self.loose[k]) for k in fold) + len(merge) <= 1:
            return
        pieces = [_read(os.path.join(self.gen, c)) for c in merge]
        pieces += [_read(os.path.join(self.gen, n)) for k in fold for n in self.loose[k]]
        keys_in = set().union(*(self.compacted[c][0] for c in merge), fold)
        table = pa.concat_tables(pieces)
        table = table.take(pc.sort_indices(table[self.key_column]))  # stable: keeps write order
        name = self._compacted_name(min(keys_in), max(keys_in))
        tmp, size = self._tmp_file(table, {KEYS_METADATA: _encode_keys(keys_in)})
        drop = {n for k in fold for n in self.loose[k]} | set(merge)
        self._swap(drop, {}, {name: tmp})
        for c in merge:
            del self.compacted[c]
        for k in fold:
            del self.loose[k]
        self.compacted[name] = (frozenset(keys_in), size)
