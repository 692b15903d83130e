"""Finding and moving aside damaged files of the run store: `dew store check` and `dew store repair`.

`check` reads what a query or a writer may read: every part of every stream's current generation
(footer, columns, every row: damage.check_file), every stream's link (its generation directory
may be gone), the `runs` and `stages` row files, the schema files, the current snapshot (attached
read-only, its views listed) and its manifest, and `format.json`. It records the damaged parts, row
files and missing generations (damage.py) and publishes a snapshot that routes around them, so
other runs and tables read at once. It reads every part in full: minutes on a store of many GB.

`repair` moves every damaged file aside and never deletes one: it goes to
`store/.quarantine/<UTC time>/<its path in the store>` (a hard link when the file stays in an
older generation until that is collected), and `store/.quarantine/log.jsonl` records its path,
where it went, its table, run, stage, the reason and its size. A damaged part leaves its stream
through a new generation without it (hard links to the other parts and one link swap, as
compaction does), under the stage's writer lock: a stage being written is left for later and
said so. Its rows are gone from the views (they are in the quarantine). A missing generation
directory is replaced by an empty one. A damaged `runs` or `stages` row file is moved aside (the
run or stage leaves that table until its writer writes the row again). A damaged snapshot or
manifest is moved aside and a new snapshot published; a damaged schema file is rewritten (it
holds no rows). A damaged `format.json` is only reported: what it should hold depends on the Dew
that wrote the store (its message says what to do).

Not here: how damage is recognised and routed around in views (damage.py), snapshots (snapshot.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from typing import Any

import duckdb

from dew_lib.store import damage, snapshot
from dew_lib.store.damage import quote
from dew_lib.store.parts import GEN, FileLock, StoreBusy, StoreError, announced_swap, fsync_dir
from dew_lib.store.schema import TABLES, schema_file

QUARANTINE = ".quarantine"
ROUTED = ("part", "rows", "generation")  # kinds the views route around (damage.py)


def _found(store_dir: str, kind: str, path: str, reason: str) -> dict[str, Any]:
    found = damage.entry(store_dir, path, reason) or {
        "path": os.path.relpath(path, store_dir), "table": None, "run": None, "stage": None, "reason": reason}
    return {**found, "kind": kind}


def snapshot_problem(path: str) -> str | None:
    """Why the snapshot database `path` cannot be used, or None: it attaches read-only and holds
    a view of every table."""
    connection = duckdb.connect(":memory:")
    try:
        connection.execute(f"ATTACH {quote(path)} AS checked (READ_ONLY)")
        views = {row[0] for row in connection.execute(
            "SELECT view_name FROM duckdb_views() WHERE database_name = 'checked'").fetchall()}
    except duckdb.Error as error:
        return f"DuckDB cannot open it ({' '.join(str(error).split())[:300]})"
    finally:
        connection.close()
    if missing := sorted(set(TABLES) - views):
        return f"it lacks the views {', '.join(missing)}"
    return None


def check(store) -> list[dict[str, Any]]:
    """Every damaged file of `store` (a Store), as dicts: kind (part, rows, generation, schema,
    snapshot, manifest, format), path (relative to the store directory), table, run, stage and
    reason. Records the routable ones and publishes (where the store is writable)."""
    store_dir, out = store.directory, []
    try:
        store._check_format()
    except StoreError as error:
        out.append(_found(store_dir, "format", os.path.join(store_dir, "format.json"), str(error)))
    current = snapshot.current(store_dir)
    if current is not None and os.path.exists(current):
        if snapshot.manifest(current) is None:
            out.append(_found(store_dir, "manifest", current[: -len(".duckdb")] + ".json", "unreadable JSON"))
        if (why := snapshot_problem(current)) is not None:
            out.append(_found(store_dir, "snapshot", current, why))
    for table in TABLES:
        path = schema_file(store_dir, table)
        if os.path.exists(path) and (why := damage.schema_problem(path, table)) is not None:
            out.append(_found(store_dir, "schema", path, why))
    missing: list = []
    gens = snapshot.live(store_dir, missing)
    out += [{**m, "kind": "generation"} for m in missing]
    for table, names in gens.items():
        for gen in names:
            for name in sorted(os.listdir(os.path.join(store_dir, gen))):
                path = os.path.join(store_dir, gen, name)
                if name.endswith(".parquet") and (why := damage.check_file(path, table)) is not None:
                    out.append(_found(store_dir, "part", path, why))
    for table in ("runs", "stages"):
        for name in snapshot.row_files(store_dir, table):
            path = os.path.join(store_dir, name)
            if (why := damage.check_file(path, table)) is not None:
                out.append(_found(store_dir, "rows", path, why))
    with contextlib.suppress(OSError, StoreError):  # a read-only store: reported, not recorded
        damage.record(store_dir, [_registry(f) for f in out if f["kind"] in ("part", "rows")], replace=True)
        if not any(f["kind"] in ("format", "snapshot", "manifest") for f in out):  # repair's to replace
            snapshot.publish(store_dir)
    return out


def failed_reads(store_dir: str, query: str, error: str, bound: str | None, clean: set) -> list[dict[str, Any]]:
    """The damaged files among those a query that failed with `error` may have read: the parts
    its error names, else every part of the tables its text names (each table once per bound
    snapshot: `clean` remembers the ones found whole). As registry entries (damage.py)."""
    named = set(re.findall(re.escape(store_dir) + r"/[^'\"\s]+\.parquet", error))
    candidates = [(path, found[0]) for path in named if (found := damage.owner(store_dir, path))]
    if not candidates:
        gens = snapshot.live(store_dir)
        for table in TABLES:
            if (bound, table) in clean or not re.search(rf"\b{table}\b", query, re.IGNORECASE):
                continue
            clean.add((bound, table))
            files = snapshot.row_files(store_dir, table) if table in ("runs", "stages") else [
                os.path.join(g, n) for g in gens.get(table, ()) for n in os.listdir(os.path.join(store_dir, g))
                if n.endswith(".parquet")]
            candidates += [(os.path.join(store_dir, f), table) for f in files]
    return [damage.entry(store_dir, path, why) for path, table in candidates
            if (why := damage.check_file(path, table)) is not None]


def _registry(found: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in found.items() if k != "kind"}


# ----- repair ----------------------------------------------------------------------------------
class _Quarantine:
    """Where this repair moves files: `store/.quarantine/<UTC time>/`, logged in log.jsonl."""

    def __init__(self, store_dir: str):
        self.store_dir = store_dir
        self.root = os.path.join(store_dir, QUARANTINE)
        self.here = os.path.join(self.root, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6])

    def keep(self, found: dict[str, Any], *, move: bool) -> str:
        """Put the file of `found` in the quarantine (moved, or a hard link beside it); log it."""
        source = os.path.join(self.store_dir, found["path"])
        target = os.path.join(self.here, found["path"])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        size = os.path.getsize(source) if os.path.isfile(source) else None
        if move:
            os.replace(source, target)
        else:
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
        fsync_dir(os.path.dirname(target))
        record = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "path": found["path"],
                  "moved_to": os.path.relpath(target, self.store_dir), "kind": found["kind"],
                  "table": found.get("table"), "run": found.get("run"), "stage": found.get("stage"),
                  "reason": found["reason"], "bytes": size}
        with open(os.path.join(self.root, "log.jsonl"), "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")
            log.flush()
            os.fsync(log.fileno())
        return target


def _new_generation(store_dir: str, table: str, run: str, stage: str, leave: set[str]) -> None:
    """Point the stream at a new generation: its current one's files less `leave` (all of them
    when the current one is gone). Call under the stage's lock."""
    link = os.path.join(store_dir, table, run, stage)
    home = os.path.join(store_dir, ".gens", table, run, stage)
    old = os.path.realpath(link)
    os.makedirs(home, exist_ok=True)
    number = 1 + max((int(m[1]) for m in map(GEN.match, os.listdir(home)) if m), default=0)
    new = os.path.join(home, f"g{number:06d}")
    os.makedirs(new)
    for name in sorted(os.listdir(old)) if os.path.isdir(old) else []:
        if os.path.join(old, name) not in leave:
            os.link(os.path.join(old, name), os.path.join(new, name))
    fsync_dir(new)
    os.makedirs(os.path.join(home, "tmp"), exist_ok=True)
    staged = os.path.join(home, "tmp", f"link-{uuid.uuid4().hex}")
    os.symlink(os.path.relpath(new, os.path.dirname(link)), staged)
    with announced_swap(store_dir):
        os.replace(staged, link)
        fsync_dir(os.path.dirname(link))


def repair(store) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Move every damaged file of `store` aside (see the module docstring) and republish.
    Returns (repaired, left): each a finding of `check`, `left` with `why` it was left."""
    store_dir = store.directory
    found = check(store)
    quarantine, repaired, left = _Quarantine(store_dir), [], []
    streams: dict[tuple[str, str, str], list[dict]] = {}
    for f in found:
        if f["kind"] in ("part", "generation"):
            streams.setdefault((f["table"], f["run"], f["stage"]), []).append(f)
    for (table, run, stage), entries in sorted(streams.items()):
        try:
            guard = FileLock(store.lock_path(run, stage), wait=0.5, what=f"stage {stage!r} of run {run!r}")
        except StoreBusy as busy:
            left += [{**f, "why": f"{busy}; repair again once it stops"} for f in entries]
            continue
        try:
            paths = set()
            for f in entries:
                if f["kind"] == "part":
                    f["moved_to"] = quarantine.keep(f, move=False)  # its generation keeps it until collected
                    paths.add(os.path.join(store_dir, f["path"]))
                else:
                    f["moved_to"] = None  # nothing to keep: the stream gets an empty generation
            _new_generation(store_dir, table, run, stage, paths)
            repaired += entries
        finally:
            guard.release()
    for f in found:
        if f["kind"] == "rows":
            lock = store.lock_path(f["run"], "_row" if f["table"] == "runs" else f["stage"])
            try:
                guard = FileLock(lock, wait=0.5, what=f"the {f['table']} row of run {f['run']!r}")
            except StoreBusy as busy:
                left.append({**f, "why": f"{busy}; repair again once it stops"})
                continue
            try:
                f["moved_to"] = quarantine.keep(f, move=True)
                repaired.append(f)
            finally:
                guard.release()
        elif f["kind"] in ("snapshot", "manifest"):
            f["moved_to"] = quarantine.keep(f, move=False)  # superseded by the publish below, then collected
            repaired.append(f)
        elif f["kind"] == "schema":
            f["moved_to"] = quarantine.keep(f, move=True)
            repaired.append(f)
        elif f["kind"] == "format":
            left.append({**f, "why": "format.json is not rewritten by repair; restore it as its message says"})
    damage.restore_schema_files(store_dir)
    damage.record(store_dir, [_registry(f) for f in left if f["kind"] in ("part", "rows")], replace=True)
    if not any(f["kind"] == "format" for f in found):
        snapshot.publish(store_dir, force=any(f["kind"] in ("snapshot", "manifest") for f in repaired))
    return repaired, left


def replace_snapshot(store_dir: str, path: str, reason: str) -> None:
    """A reader found the current snapshot `path` damaged: keep it in the quarantine and publish
    a new one (snapshots are rebuilt from the parts; nothing is lost)."""
    guard = FileLock(os.path.join(store_dir, ".locks", "_snapshot.lock"), blocking=True)
    try:
        if snapshot.current(store_dir) != path or not os.path.exists(path):
            return  # someone replaced it already
        _Quarantine(store_dir).keep(_found(store_dir, "snapshot", path, reason), move=False)
    finally:
        guard.release()
    snapshot.publish(store_dir, force=True)
