"""Damaged files of the run store: how one is recognised, remembered and routed around.

A file is damaged when pyarrow cannot read its footer, its columns are not its table's, or DuckDB
cannot decode every row of it (a truncated file, garbled bytes, a part overwritten with something
else); a stream is damaged when its link names a generation directory that is gone. Whoever finds
one (`dew store check`, or a `dew`/`Store` query that failed the way a damaged file makes it fail,
store.py) records it in `store/.damaged.json`, and the next snapshot routes around it
(snapshot.view_statements): the stream's generation is listed file by file without it, and the
table's view gains a branch that raises an error naming it (path, table, run, stage) in every
query that does not leave that run and stage out. `WHERE run = 'other'` prunes the branch at
planning; `count(*)` over the whole table meets it. So one damaged file fails only the scans
that would have read it, and never a snapshot's publication (views bind from a schema file,
schema.schema_file, not from a part).

An entry stays while its file is where it was, unchanged or still damaged, and (for a part) in
its stream's current generation; it goes once the file is repaired (moved aside, health.py),
replaced by a healthy one, or left behind by a new generation.

Not here: finding and moving files (health.py), snapshots (snapshot.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import duckdb
import pyarrow.parquet as pq

from dew_lib.store.parts import _COMPACTED, KEYS_METADATA, FileLock, _decode_keys, replace_file, write_json
from dew_lib.store.schema import TABLES, empty, schema_file

REGISTRY = ".damaged.json"
REPAIR = "`dew store repair` moves it aside"  # every message of a damaged file ends so
MISSING = "its generation directory is missing (deleted?)"


def quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def owner(store_dir: str, path: str) -> tuple[str, str, str | None] | None:
    """(table, run, stage) of a file under the store: a part `.gens/<table>/<run>/<stage>/g*/x`, or
    a `runs`/`stages` row file `<table>/<run>/<stage>/x` (stage None for `runs`)."""
    parts = os.path.relpath(path, store_dir).split(os.sep)
    if len(parts) == 6 and parts[0] == ".gens" and parts[1] in TABLES:
        return parts[1], parts[2], parts[3]
    if len(parts) == 5 and parts[0] == ".gens" and parts[1] in TABLES:  # a generation directory
        return parts[1], parts[2], parts[3]
    if len(parts) == 4 and parts[0] in ("runs", "stages") and parts[1] != "_":
        return parts[0], parts[1], None if parts[0] == "runs" else parts[2]
    return None


def check_file(path: str, table: str) -> str | None:
    """Why `path`, a part of `table`, is damaged, or None when it reads whole: its footer (what
    writers read), its columns, and every row decoded by DuckDB (what queries read)."""
    try:
        meta = pq.read_metadata(path)
        found = meta.schema.to_arrow_schema()
        if _COMPACTED.match(os.path.basename(path)):
            _decode_keys(meta.metadata[KEYS_METADATA])
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - whatever pyarrow raises, the file is unreadable
        return f"unreadable Parquet ({type(error).__name__}: {_line(error)})"
    expected = TABLES[table].schema
    if not found.remove_metadata().equals(expected):
        return (f"its columns ({', '.join(f'{f.name} {f.type}' for f in found)[:300]}) are not the "
                f"{table} table's")
    connection = duckdb.connect(":memory:", config={"threads": 1, "memory_limit": "1GB"})
    try:
        for _ in connection.sql("SELECT * FROM read_parquet(?)", params=[path]).to_arrow_reader(65536):
            pass
    except duckdb.Error as error:
        return f"DuckDB cannot decode it ({_line(error)})"
    finally:
        connection.close()
    return None


def _line(error: BaseException) -> str:
    text = "".join(c if c.isprintable() else "?" for c in " ".join(str(error).split()))
    return text[:300]


def entry(store_dir: str, path: str, reason: str) -> dict[str, Any] | None:
    """The registry entry of a damaged file or missing generation under the store."""
    found = owner(store_dir, path)
    if found is None:
        return None
    table, run, stage = found
    try:
        stat = os.stat(path)
        size, mtime = stat.st_size, stat.st_mtime_ns
    except OSError:
        size = mtime = None
    return {"path": os.path.relpath(path, store_dir), "table": table, "run": run, "stage": stage,
            "reason": reason, "size": size, "mtime_ns": mtime}


def message(store_dir: str, found: dict[str, Any]) -> str:
    """The one line that names a damaged file (what a query that meets it raises)."""
    where = f"table {found['table']}, run {found['run']}" + (
        f", stage {found['stage']}" if found.get("stage") is not None else "")
    leave_out = f"run = '{found['run']}'" + (
        f" AND stage = '{found['stage']}'" if found.get("stage") is not None else "")
    return (f"damaged file {os.path.join(store_dir, found['path'])} ({where}): {found['reason']}; "
            f"queries that leave {leave_out} out still read, {REPAIR}")


def schema_problem(path: str, table: str) -> str | None:
    try:
        found = pq.read_metadata(path).schema.to_arrow_schema().remove_metadata()
    except Exception as error:  # noqa: BLE001 - whatever pyarrow raises, the file is unreadable
        return f"unreadable Parquet ({type(error).__name__})"
    return None if found.equals(TABLES[table].schema) else f"its columns are not the {table} table's"


def restore_schema_files(store_dir: str) -> None:
    """Write every table's schema file that is missing or damaged (they hold no rows)."""
    for table in TABLES:
        path = schema_file(store_dir, table)
        if not os.path.isfile(path) or schema_problem(path, table) is not None:
            replace_file(empty(table), path, os.path.join(store_dir, ".gens", "_tmp"))


# ----- the registry ----------------------------------------------------------------------------
def read(store_dir: str) -> list[dict[str, Any]]:
    try:
        with open(os.path.join(store_dir, REGISTRY), encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return []
    return [e for e in found if isinstance(e, dict) and {"path", "table", "run", "reason"} <= set(e)] \
        if isinstance(found, list) else []


def record(store_dir: str, entries: list[dict[str, Any]], *, replace: bool = False) -> None:
    """Add `entries` to the registry (or make it exactly them when `replace`)."""
    guard = FileLock(os.path.join(store_dir, ".locks", "_damaged.lock"), blocking=True)
    try:
        known = {} if replace else {e["path"]: e for e in read(store_dir)}
        known.update((e["path"], e) for e in entries)
        path = os.path.join(store_dir, REGISTRY)
        if known or os.path.exists(path):
            write_json(path, sorted(known.values(), key=lambda e: e["path"]), indent=1)
    finally:
        guard.release()


def relevant(store_dir: str, gens: dict[str, list[str]], missing: list[dict[str, Any]]) -> list[dict]:
    """What the next snapshot must route around: the registry's entries that still hold (see the
    module docstring), plus `missing` generations (snapshot.live), as manifest entries."""
    out = {e["path"]: e for e in missing}
    live = {g for table in gens.values() for g in table}
    for found in read(store_dir):
        path = os.path.join(store_dir, found["path"])
        try:
            stat = os.stat(path)
        except OSError:
            continue
        if found["table"] not in ("runs", "stages") and os.path.dirname(found["path"]) not in live:
            continue
        if (stat.st_size, stat.st_mtime_ns) != (found.get("size"), found.get("mtime_ns")) \
                and check_file(path, found["table"]) is None:
            continue  # restored since
        out[found["path"]] = found
    return [{k: e.get(k) for k in ("path", "table", "run", "stage", "reason")}
            for _, e in sorted(out.items())]


# ----- views -----------------------------------------------------------------------------------
def branches(store_dir: str, table: str, damaged: list[dict[str, Any]]) -> list[str]:
    """One `SELECT` per damaged stream of `table`: a row whose identity columns are the stream's
    and whose other columns raise the error naming its damaged files, so that a filter on any of
    them evaluates the error and only a filter on run or stage prunes it."""
    streams: dict[tuple, list[dict]] = {}
    for found in damaged:
        if found["table"] == table:
            streams.setdefault((found["run"], found.get("stage")), []).append(found)
    out = []
    for (run, stage), entries in sorted(streams.items(), key=str):
        error = f"error({quote(' | '.join(message(store_dir, e) for e in entries))})"
        columns = [quote(run) if name == "run" else quote(stage) if name == "stage" and stage is not None
                   else error for name in TABLES[table].schema.names]
        out.append(f"SELECT {', '.join(columns)} WHERE {error} IS NULL")
    return out


def leave_out(damaged: list[dict[str, Any]], table: str) -> str:
    """A condition that keeps `table`'s rows out of every damaged stream (TRUE when none), which
    also prunes their error branches: what `dew runs` reads through."""
    conditions = []
    for found in damaged:
        if found["table"] != table:
            continue
        if found.get("stage") is None:
            conditions.append(f"run <> {quote(found['run'])}")
        else:
            conditions.append(f"NOT (run = {quote(found['run'])} AND stage = {quote(found['stage'])})")
    return " AND ".join(sorted(set(conditions))) or "TRUE"
