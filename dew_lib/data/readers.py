"""Reading records from Parquet, JSON lines, in-memory JSON strings and Hugging Face datasets.

Every loader (ChatMessages, PreferencePairs, Prompts) reads its source through `read_rows`, which
returns a `Rows`: random access to plain Python records plus `where(i)`, a short locator such as
`train.jsonl line 12` that every later error message quotes. Parquet files and Hub datasets stay
in Arrow memory and are converted a chunk at a time; JSON lines are parsed eagerly so that a
malformed line fails at load time with its file and line number.

Not here: streaming datasets larger than memory (the whole source is held as Arrow or Python
objects), remote filesystems other than what `datasets.load_dataset` itself reaches.
"""

from __future__ import annotations

import abc
import dataclasses
import glob
import gzip
import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dew_lib.data.errors import DataError

PathLike = str | os.PathLike


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFOptions:
    """Arguments passed on to `datasets.load_dataset` for a Hub id or a dataset directory.

    name: the dataset configuration (e.g. "main" for gsm8k). data_dir, data_files: pick files
    inside the dataset. revision: a branch, tag or commit. cache_dir: where `datasets` caches.
    """

    name: str | None = None
    data_dir: str | None = None
    data_files: str | Sequence[str] | Mapping[str, Any] | None = None
    revision: str | None = None
    cache_dir: str | None = None

    def __post_init__(self):
        for field in ("name", "data_dir", "revision", "cache_dir"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"HFOptions.{field} must be a string or None, got {type(value).__name__}")

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


class Rows(abc.ABC):
    """Records of one source: `len`, `get(indices) -> list[dict]`, `where(i)`, `columns`."""

    columns: tuple[str, ...]
    source: str

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def get(self, indices: Sequence[int]) -> list[dict]: ...

    @abc.abstractmethod
    def where(self, index: int) -> str:
        """Where record `index` comes from, for error messages (file and line, or item)."""

    def column(self, name: str) -> list[Any]:
        """One column for every record (None where a record lacks it)."""
        return [row.get(name) for row in self.get(range(len(self)))]


class ListRows(Rows):
    """Records held as Python dicts, each with its file and line (or item) number."""

    def __init__(self, records: list[dict], files: list[str], file_of: np.ndarray,
                 line_of: np.ndarray, unit: str, source: str):
        self.records, self.files, self.file_of, self.line_of = records, files, file_of, line_of
        self.unit, self.source = unit, source
        names: dict[str, None] = {}
        for record in records:
            names.update(dict.fromkeys(record))
        self.columns = tuple(names)

    def __len__(self) -> int:
        return len(self.records)

    def get(self, indices):
        return [self.records[i] for i in indices]

    def where(self, index):
        return f"{self.files[self.file_of[index]]} {self.unit} {self.line_of[index]}"

    def column(self, name):
        return [record.get(name) for record in self.records]


class ArrowRows(Rows):
    """Records held in one Arrow table (Parquet files or a Hub dataset), converted on demand."""

    def __init__(self, table: pa.Table, files: list[str], starts: list[int], source: str):
        self.table, self.files, self.starts, self.source = table, files, np.asarray(starts), source
        self.columns = tuple(table.column_names)

    def __len__(self) -> int:
        return self.table.num_rows

    def get(self, indices):
        indices = list(indices)
        if not indices:
            return []
        return self.table.take(pa.array(indices, type=pa.int64())).to_pylist()

    def where(self, index):
        file = int(np.searchsorted(self.starts, index, side="right") - 1)
        return f"{self.files[file]} row {index - int(self.starts[file])}"

    def column(self, name):
        if name not in self.table.column_names:
            return [None] * len(self)
        return self.table.column(name).to_pylist()


# ----- JSON -----------------------------------------------------------------------------------


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _parse_json_file(path: Path) -> tuple[list[dict], list[int], str]:
    """Records of a JSON-lines file (or a file holding one JSON array), with their line numbers."""
    with _open_text(path) as handle:
        text = handle.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(f"{path} line {error.lineno}: not valid JSON ({error.msg})") from None
        records, numbers = [], []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise DataError(f"{path} item {i}: expected a JSON object, got {type(item).__name__}")
            records.append(item)
            numbers.append(i)
        return records, numbers, "item"
    records, numbers = [], []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno}); "
                "each line of a .jsonl file must hold one complete JSON object"
            ) from None
        if not isinstance(item, dict):
            raise DataError(f"{path} line {number}: expected a JSON object, got {type(item).__name__}")
        records.append(item)
        numbers.append(number)
    return records, numbers, "line"


def rows_from_json_files(paths: Sequence[Path], threads: int = 1) -> ListRows:
    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        parsed = list(pool.map(_parse_json_file, paths))
    records: list[dict] = []
    file_of, line_of, unit = [], [], "line"
    for index, (path, (items, numbers, kind)) in enumerate(zip(paths, parsed, strict=True)):
        if not items:
            raise DataError(f"{path}: the file holds no records; give a file with at least one JSON object")
        records.extend(items)
        file_of.extend([index] * len(items))
        line_of.extend(numbers)
        unit = kind
    return ListRows(records, [str(p) for p in paths], np.asarray(file_of, np.int32),
                    np.asarray(line_of, np.int64), unit, ", ".join(map(str, paths)))


def rows_from_records(records: Sequence[str | Mapping], name: str = "records") -> ListRows:
    """In-memory records: JSON strings (one object each) or mappings."""
    if isinstance(records, (str, bytes)) or not isinstance(records, Sequence):
        raise DataError(f"{name} must be a tuple of JSON strings, got {type(records).__name__}")
    if not records:
        raise DataError(f"{name} is empty; give at least one record")
    parsed = []
    for i, record in enumerate(records):
        if isinstance(record, (str, bytes)):
            try:
                record = json.loads(record)
            except json.JSONDecodeError as error:
                raise DataError(f"{name}[{i}]: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, Mapping):
            raise DataError(f"{name}[{i}]: expected a JSON object, got {type(record).__name__}")
        parsed.append(dict(record))
    count = len(parsed)
    return ListRows(parsed, [name], np.zeros(count, np.int32), np.arange(count), "item", name)


# ----- Parquet and Hugging Face datasets ---------------------------------------------------------


def rows_from_parquet(paths: Sequence[Path], threads: int = 1) -> ArrowRows:
    def read(path: Path) -> pa.Table:
        try:
            return pq.read_table(path, use_threads=threads > 1)
        except (pa.ArrowInvalid, OSError) as error:
            raise DataError(f"{path}: not a readable Parquet file ({error})") from None

    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        tables = list(pool.map(read, paths))
    starts, total = [], 0
    for path, table in zip(paths, tables, strict=True):
        if table.num_rows == 0:
            raise DataError(f"{path}: the file holds no records; give a file with at least one row")
        starts.append(total)
        total += table.num_rows
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except pa.ArrowInvalid as error:
        raise DataError(f"the Parquet files {', '.join(map(str, paths))} have incompatible schemas: {error}") from None
    return ArrowRows(table, [str(p) for p in paths], starts, ", ".join(map(str, paths)))


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (
        (path / "state.json").exists() or (path / "dataset_dict.json").exists()
    )


def rows_from_hub(path: str, split: str | None, options: HFOptions | None) -> ArrowRows:
    """A dataset through `datasets`: `load_from_disk` for `save_to_disk` output, else `load_dataset`."""
    import datasets  # imported here: it is slow to import and only this source needs it

    split_name = split or "train"
    where = Path(path)
    try:
        if _is_saved_dataset(where):
            loaded = datasets.load_from_disk(str(where))
            if isinstance(loaded, datasets.DatasetDict):
                if split_name not in loaded:
                    raise DataError(f"{path}: no split {split_name!r}; it has {sorted(loaded)}")
                loaded = loaded[split_name]
        else:
            loaded = datasets.load_dataset(path, split=split_name, **(options or HFOptions()).kwargs())
    except DataError:
        raise
    except Exception as error:  # datasets raises many types; the message is what matters
        raise DataError(
            f"datasets could not load {path!r} (split {split_name!r}): {type(error).__name__}: {error}"
        ) from None
    if not isinstance(loaded, datasets.Dataset):
        raise DataError(f"{path}: expected one split as a datasets.Dataset, got {type(loaded).__name__}")
    if len(loaded) == 0:
        raise DataError(f"{path} split {split_name!r} holds no records")
    table = loaded.with_format("arrow")[0:len(loaded)]
    return ArrowRows(table, [f"{path}[{split_name}]"], [0], f"{path}[{split_name}]")


# ----- dispatch -------------------------------------------------------------------------------

_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")


def _expand(path: PathLike | Sequence[PathLike]) -> list[str]:
    items = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not items:
        raise DataError("path is an empty list; give at least one file")
    out = []
    for item in items:
        text = os.fspath(item)
        if any(c in text for c in "*?["):
            matches = sorted(glob.glob(text))
            if not matches:
                raise DataError(f"{text}: the pattern matches no files")
            out.extend(matches)
        else:
            out.append(text)
    return out


def read_rows(path: PathLike | Sequence[PathLike], *, split: str | None = None,
              options: HFOptions | None = None, threads: int = 1) -> Rows:
    """Open a source by its name: `.parquet`, `.jsonl`/`.json` (optionally `.gz`), else `datasets`."""
    names = _expand(path)
    files = [Path(n) for n in names]
    if all(n.endswith(".parquet") for n in names):
        missing = [n for n, f in zip(names, files, strict=True) if not f.is_file()]
        if missing:
            raise DataError(f"{missing[0]}: no such file")
        return rows_from_parquet(files, threads)
    if all(n.endswith(_JSON_SUFFIXES) for n in names):
        missing = [n for n, f in zip(names, files, strict=True) if not f.is_file()]
        if missing:
            raise DataError(f"{missing[0]}: no such file")
        return rows_from_json_files(files, threads)
    if len(names) == 1:
        name = names[0]
        if Path(name).is_file():
            raise DataError(
                f"{name}: unknown file type; use .parquet, .jsonl or .json (optionally gzipped), "
                "or a Hugging Face dataset id or directory"
            )
        if name.startswith((".", "/", "~")) and not Path(name).expanduser().exists():
            raise DataError(f"{name}: no such file or directory")
        return rows_from_hub(str(Path(name).expanduser()) if Path(name).expanduser().exists() else name,
                             split, options)
    raise DataError(f"cannot mix file types in one source: {names}; give all .parquet or all .jsonl files")


def open_source(records, path, *, split, options, threads, owner: str) -> Rows:
    """Rows from exactly one of in-memory `records` and a `path`."""
    if (records is None) == (path is None):
        raise ValueError(f"{owner} takes exactly one source: records= (JSON strings) or path=, not "
                         f"{'both' if records is not None else 'neither'}")
    if records is not None:
        return rows_from_records(records, f"{owner}.records")
    return read_rows(path, split=split, options=options, threads=threads)


def require_columns(rows: Rows, needed: Sequence[str], what: str) -> None:
    """Refuse a columnar source that lacks a column every record needs."""
    if isinstance(rows, ArrowRows):
        missing = [c for c in needed if c not in rows.columns]
        if missing:
            raise DataError(
                f"{rows.source}: missing column {missing[0]!r} needed for {what}; the columns are "
                f"{list(rows.columns)}"
            )


def token_ids(value: Any, field: str, where: str) -> np.ndarray:
    """A list of token ids as int32, refusing booleans, non-integers, negatives and int32 overflow."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise DataError(f"{where}: field {field!r} must be a flat list of integer token ids, got "
                            f"an array of {value.dtype} with shape {value.shape}")
        items = value.tolist()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise DataError(f"{where}: field {field!r} must be a list of token ids, got {type(value).__name__}")
    for j, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            raise DataError(
                f"{where}: field {field!r} item {j} is {item!r} ({type(item).__name__}); token ids "
                "must be integers"
            )
        if item < 0 or item > 2**31 - 1:
            raise DataError(
                f"{where}: field {field!r} item {j} is {item}; token ids must be non-negative "
                "integers below 2**31"
            )
    return np.asarray(items, np.int32)


def json_text(value: Any) -> str:
    """A string as itself, anything else as JSON text (`json.dumps`), None as the empty string."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=_jsonable)


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


__all__ = ["ArrowRows", "DataError", "HFOptions", "ListRows", "Rows", "json_text", "read_rows",
           "open_source", "require_columns", "rows_from_records", "token_ids"]
