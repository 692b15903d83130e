"""Safetensors files in the Hugging Face layout: find, read tensor by tensor, write, swap in.

A checkpoint is `model.safetensors`, or shards named `model-0000i-of-0000n.safetensors` listed by
`model.safetensors.index.json`. The `safetensors` library lists and validates the files; tensor
bytes are then read one tensor at a time with `pread` into buffers the loader chooses, so the
process never maps or holds the whole file at once and reads each byte once. Writing puts each
tensor on disk as it arrives (the header, known beforehand, first; the bytes are those the
`safetensors` library writes), so a save holds one tensor at a time, and stages a complete
directory beside the target and swaps it in with one rename, so a reader sees the old
checkpoint or the new one, never a mixture.

Not here: what the tensors mean (see `layout`), torch (never imported).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
                "F16": np.dtype(np.float16), "F64": np.dtype(np.float64)}
_CODES = {dtype: code for code, dtype in FLOAT_DTYPES.items()}
_WIDEST_FIRST = ("F64", "F32", "BF16", "F16")  # the order of safetensors' own Dtype, reversed
ALIGNMENT = 64
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class CheckpointError(ValueError):
    """The files do not hold the tensors the config describes (missing, extra, wrong shape)."""


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" (10**9) or "512MiB" (2**20)."""
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.match(str(size))
        if not match:
            raise ValueError(f"cannot read {size!r} as a size; write e.g. 5GB, 512MiB or 1000000")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])
    if value <= 0:
        raise ValueError(f"a shard size must be positive, got {size!r}")
    return value


def locate(directory: Path) -> dict[str, Path]:
    """Map every tensor name stored under `directory` to the file that holds it."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map object")
        located = {name: directory / file for name, file in weight_map.items()}
        for path in sorted(set(located.values())):
            if not path.is_file():
                raise CheckpointError(f"{index.name} lists shard {path.name}, which is missing")
        return located
    single = directory / SINGLE
    if single.is_file():
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise CheckpointError(
        f"{directory} has neither {SINGLE} nor {INDEX} (found: {present[:12]}); Dew reads "
        "safetensors checkpoints only"
    )


def headers(located: Mapping[str, Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each located tensor's safetensors dtype code and shape, read from the file headers only."""
    by_file: dict[Path, list[str]] = {}
    for name, path in located.items():
        by_file.setdefault(path, []).append(name)
    out = {}
    for path, names in by_file.items():
        with safe_open(path, framework="numpy") as f:
            stored = set(f.keys())
            for name in names:
                if name not in stored:
                    raise CheckpointError(
                        f"tensor {name} is listed in {INDEX} under {path.name}, "
                        "but that file does not hold it"
                    )
                view = f.get_slice(name)
                out[name] = (view.get_dtype(), tuple(view.get_shape()))
    return out


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised byte buffer whose data starts on a 64-byte boundary.

    JAX's CPU backend adopts such a buffer as device memory without copying it.
    """
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes]


class Reader:
    """Reads the tensors of one safetensors file straight into caller-chosen buffers.

    The `safetensors` library has already validated the header (see `headers`); this class
    reads the same header for the byte offsets, which the library does not expose, and fills
    buffers with `pread`. That lets the loader read into 64-byte-aligned memory that becomes
    the device buffer itself, or into one reused scratch buffer, instead of a fresh copy per
    tensor.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            size = int.from_bytes(os.pread(self._fd, 8, 0), "little")
            header = json.loads(os.pread(self._fd, size, 8))
            self._start = 8 + size
            self._length = os.fstat(self._fd).st_size - self._start
        except Exception:
            os.close(self._fd)
            raise
        header.pop("__metadata__", None)
        self.entries = header

    def nbytes(self, name: str) -> int:
        begin, end = self.entries[name]["data_offsets"]
        return end - begin

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Tensor `name` as an array over `out` (a byte buffer of `nbytes(name)`) or a new one."""
        entry = self.entries[name]
        dtype = FLOAT_DTYPES.get(entry["dtype"], np.dtype(np.uint8))
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if entry["dtype"] not in FLOAT_DTYPES or end - begin != math.prod(shape) * dtype.itemsize \
                or end > self._length:
            raise CheckpointError(f"tensor {name} in {self.path.name} has an inconsistent header")
        out = aligned_empty(end - begin) if out is None else out
        view = out.data.cast("B")  # the array's buffer (what memoryview(out) gives)
        done = 0
        while done < len(view):  # one pread returns at most ~2 GiB on Linux
            got = os.preadv(self._fd, [view[done:]], self._start + begin + done)
            if got <= 0:
                raise CheckpointError(f"{self.path.name} ended inside tensor {name}")
            done += got
        return out.view(dtype).reshape(shape)

    def raw(self, name: str, offset: int, length: int) -> bytes:
        """`length` bytes of tensor `name`'s data, starting `offset` bytes in."""
        return os.pread(self._fd, length, self._start + self.entries[name]["data_offsets"][0]
                        + offset)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def same_tensor(located: Mapping[str, Path], a: str, b: str, chunk: int = 1 << 26) -> bool:
    """Whether two stored tensors have the same dtype, shape and bytes; reads a chunk at a time."""
    with Reader(located[a]) as first, Reader(located[b]) as second:
        x, y = first.entries[a], second.entries[b]
        if (x["dtype"], x["shape"]) != (y["dtype"], y["shape"]):
            return False
        size = first.nbytes(a)
        for offset in range(0, size, chunk):
            length = min(chunk, size - offset)
            if first.raw(a, offset, length) != second.raw(b, offset, length):
                return False
    return True


def shard_plan(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split tensors, in order, into consecutive shards of at most `max_shard_size` bytes.

    A single tensor larger than the limit gets a shard of its own, as transformers does.
    """
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_names(count: int) -> list[str]:
    """File names for `count` shards in the Hugging Face convention."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


@dataclasses.dataclass(frozen=True)
class Planned:
    """A tensor a save will write, known before its data exists: name, shape and numpy dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class Shard:
    """One file's tensors (`planned`, in the order `stream` yields them) and the stream of
    `(name, array)` they come from, shared with the shards after it."""

    planned: list[Planned]
    stream: Iterator[tuple[str, Any]]


def write(
    directory: Path,
    tensors: Iterable[tuple[str, np.ndarray]],
    planned: Sequence[Planned],
    max_shard_size: int,
) -> list[str]:
    """Write `tensors` (yielded in `planned` order) as one file or as shards plus an index.

    Each tensor goes to disk as it is yielded, so no more than the one being written need be in
    memory. Returns the file names written.
    """
    by_name = {tensor.name: tensor for tensor in planned}
    plan = shard_plan([(tensor.name, tensor.nbytes) for tensor in planned], max_shard_size)
    names = shard_names(len(plan))
    stream = iter(tensors)
    weight_map = {}
    for file, members in zip(names, plan, strict=True):
        save_file(Shard([by_name[name] for name in members], stream), directory / file,
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, file))
    if next(stream, None) is not None:
        raise RuntimeError("tensor stream yielded more tensors than planned")
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(tensor.nbytes for tensor in planned)},
                 "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX)
    return names


def save_file(shard: Shard, path: Path, metadata: Mapping[str, str] | None = None) -> None:
    """Write one safetensors file, a tensor at a time as `shard.stream` yields them.

    Every name, dtype and shape is known beforehand, so the header goes first and each tensor's
    bytes then go straight to their offset; nothing is held back. The bytes are those the
    `safetensors` library writes for the same tensors: its header (compact JSON, the metadata
    first, the tensors by dtype, widest first, then by name, padded with spaces to 8 bytes) and
    the data in that order.
    """
    order = sorted(shard.planned, key=lambda t: (_WIDEST_FIRST.index(_CODES[t.dtype]), t.name))
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    offsets, end = {}, 0
    for tensor in order:
        offsets[tensor.name] = end
        header[tensor.name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [end, end + tensor.nbytes]}
        end += tensor.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        start = out.tell()
        for expected in shard.planned:
            name, array = next(shard.stream, (None, None))
            if name != expected.name:
                raise RuntimeError(f"tensor stream out of order: got {name}, expected {expected.name}")
            array = np.ascontiguousarray(array)
            if array.shape != expected.shape or array.dtype != expected.dtype:
                raise RuntimeError(f"tensor {name} arrived as {array.dtype}{list(array.shape)}, "
                                   f"planned as {expected.dtype}{list(expected.shape)}")
            out.seek(start + offsets[name])
            out.write(array.reshape(-1).view(np.uint8).data)
            del array  # the next tensor may be gathered now


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if result != 0:
        errno = ctypes.get_errno()
        if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem cannot swap
            return False
        raise OSError(errno, os.strerror(errno), f"swapping {a} and {b}")
    return True


@contextlib.contextmanager
def staged_directory(target: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield an empty directory beside `target`; on success it replaces `target` in one step.

    The stage is a hidden sibling (same filesystem, so the rename is atomic). An existing target
    is swapped out atomically where the OS allows (Linux), else renamed aside first; either way
    the old files are removed afterwards and nothing of the stage survives a failure.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory")
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(stage, 0o777 & ~umask)  # mkdtemp's 0700 would hide the files from servers
        yield stage
        for path in stage.iterdir():
            _fsync(path)
        _fsync(stage)
        if not target.exists():
            os.rename(stage, target)
        elif _exchange(stage, target):
            shutil.rmtree(stage)
        else:
            old = target.parent / f".{target.name}.{uuid.uuid4().hex}.old"
            os.rename(target, old)
            os.rename(stage, target)
            shutil.rmtree(old)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
