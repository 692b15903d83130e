"""Safetensors files in the Hugging Face layout: find, read tensor by tensor, write, swap in.

A checkpoint is `model.safetensors`, or shards named `model-0000i-of-0000n.safetensors` listed by
`model.safetensors.index.json`. The `safetensors` library lists and validates the files; tensor
bytes are then read one tensor at a time with `pread` into buffers the loader chooses, so the
process never maps or holds the whole file at once and reads each byte once. Writing
stages a complete directory beside the target and swaps it in with one rename, so a reader sees
the old checkpoint or the new one, never a mixture.

Not here: what the tensors mean (see `layout`), torch (never imported).
"""

from __future__ import annotations

import contextlib
import ctypes
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

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
                "F16": np.dtype(np.float16), "F64": np.dtype(np.float64)}
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


def write(
    directory: Path,
    tensors: Iterable[tuple[str, np.ndarray]],
    sizes: Sequence[tuple[str, int]],
    max_shard_size: int,
) -> list[str]:
    """Write `tensors` (yielded in `sizes` order) as one file or as shards plus an index.

    Holds at most one shard's tensors in memory. Returns the file names written.
    """
    plan = shard_plan(sizes, max_shard_size)
    names = shard_names(len(plan))
    stream = iter(tensors)
    weight_map = {}
    for file, members in zip(names, plan, strict=True):
        shard = {}
        for expected in members:
            name, array = next(stream)
            if name != expected:
                raise RuntimeError(f"tensor stream out of order: got {name}, expected {expected}")
            shard[name] = np.ascontiguousarray(array)
            weight_map[name] = file
        save_file(shard, directory / file, metadata={"format": "pt"})
        del shard
    if next(stream, None) is not None:
        raise RuntimeError("tensor stream yielded more tensors than planned")
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(size for _, size in sizes)},
                 "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        names.append(INDEX)
    return names


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
