"""Snapshots: what `dew.duckdb`, `dew` and `Store.sql` read, so every client sees whole generations.

A snapshot is a small DuckDB database `store/.snaps/s<n>.duckdb` of views that name, for every
stream (one table of one stage, parts.py), the concrete generation directory that was current
when it was published: `read_parquet(['<store>/.gens/<table>/<run>/<stage>/g000012/*.parquet', ...])`.
`dew.duckdb` is a symbolic link to the newest snapshot, moved with one rename. A generation
directory only ever gains files (each renamed in whole), so a snapshot's globs list a growing,
never shrinking set of whole parts: a client sees the parts appended to those generations since
it connected, and nothing it listed disappears while it reads. `runs` and `stages` are globs over
their one-file directories (replaced by rename, never removed). A table without parts is a typed
empty query, so no view needs a placeholder file.

Compaction writes a new generation and moves the stream's link (parts.py); the writer then
publishes a new snapshot (at the end of its write when its queue is empty, at least every
PUBLISH_EVERY seconds while it stays busy, and on flush). A superseded snapshot, and every
generation only it names, is removed by a later publish once it is older than GRACE_SECONDS
(the time a client has between opening `dew.duckdb` and taking DuckDB's lock on it) and no
process holds it open: DuckDB holds a POSIX read lock on a database file while a connection has
it open, visible in /proc/locks and to an OFD lock probe. A client that keeps a connection open
keeps its snapshot, and the parts it names, on disk until it disconnects.

Each snapshot has a manifest `s<n>.json` (the store directory, format, tables, generations, and
the damaged files its views route around: damage.py). All of it happens under an exclusive lock
on `store/.locks/_snapshot.lock`. A published snapshot file is read-only (mode 0444): no process
writes it again, and the `duckdb` client opens it only with `-readonly` (root excepted).

Not here: the parts and generations themselves (parts.py), queries (store.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import struct
import threading
import time
import uuid

import duckdb

from dew_lib.store import damage
from dew_lib.store.parts import GEN, FileLock, StoreBusy, fsync_dir, write_json
from dew_lib.store.schema import FORMAT, TABLES, empty, schema_file
from dew_lib.store.schema import glob as table_glob

VIEWS = 2  # how views are built: 2 binds them from schema files and routes around damaged files
GRACE_SECONDS = 10.0
PUBLISH_EVERY = 1.0  # a busy writer publishes at least this often
_SNAP = re.compile(r"^s(\d{8})\.(duckdb|json)$")
_TMP = re.compile(r"^tmp-[0-9a-f]{32}\.duckdb(\.wal)?$")

_held_here: dict[str, int] = {}  # snapshots this process's Store connections have attached
_held_lock = threading.Lock()
_builder: list = [None, -1]  # one in-memory DuckDB per process that builds snapshots, and its pid
_builder_lock = threading.Lock()
_empty_sql: dict[str, str] = {}


def database(store_dir: str) -> str:
    return os.path.join(os.path.dirname(store_dir), "dew.duckdb")


def directory(store_dir: str) -> str:
    return os.path.join(store_dir, ".snaps")


def current(store_dir: str) -> str | None:
    """The snapshot `dew.duckdb` points at, or None (missing, or a file of an older Dew)."""
    link = database(store_dir)
    try:
        target = os.readlink(link)
    except OSError:
        return None
    path = os.path.normpath(os.path.join(os.path.dirname(link), target))
    if os.path.dirname(path) != directory(store_dir) or not _SNAP.match(os.path.basename(path)):
        return None
    return path


def manifest(path: str) -> dict | None:
    try:
        with open(path[: -len(".duckdb")] + ".json", encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def fits(found: dict | None, store_dir: str) -> bool:
    """Whether a manifest was published for this store directory by this format."""
    return (found is not None and found.get("store") == store_dir and found.get("format") == FORMAT
            and found.get("tables") == sorted(TABLES) and found.get("views") == VIEWS)


def hold(path: str) -> None:
    """Count a connection of this process on snapshot `path` (collect never removes it)."""
    with _held_lock:
        _held_here[path] = _held_here.get(path, 0) + 1


def release(path: str) -> None:
    with _held_lock:
        left = _held_here.get(path, 0) - 1
        if left > 0:
            _held_here[path] = left
        else:
            _held_here.pop(path, None)


# ----- what a snapshot names -------------------------------------------------------------------
def live(store_dir: str, missing: list | None = None) -> dict[str, list[str]]:
    """Per keyed table, the current generation of every stream that has a part, relative to the
    store directory (links are read once; a generation never loses a file). A link whose
    generation directory is gone goes to `missing` as a damage entry (damage.py)."""
    out: dict[str, list[str]] = {}
    for table, spec in TABLES.items():
        if spec.key is None:
            continue
        gens = []
        for run in _entries(os.path.join(store_dir, table)):
            for stage in _entries(os.path.join(store_dir, table, run)):
                link = os.path.join(store_dir, table, run, stage)
                if not os.path.islink(link):
                    continue
                gen = os.path.realpath(link)
                if _has_part(gen):
                    gens.append(os.path.relpath(gen, store_dir))
                elif missing is not None and not os.path.isdir(gen):
                    missing.append(damage.entry(store_dir, gen, damage.MISSING))
        out[table] = sorted(gens)
    return out


def _entries(path: str) -> list[str]:
    try:
        return sorted(name for name in os.listdir(path) if not name.startswith(("_", ".")))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _has_part(gen: str) -> bool:
    try:
        with os.scandir(gen) as entries:
            return any(e.name.endswith(".parquet") for e in entries)
    except FileNotFoundError:
        return False


def quote(text: str) -> str:
    """`text` as a SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _literal(path: str) -> str:
    """`path` as a glob that matches only itself."""
    return re.sub(r"([\[*?])", r"[\1]", path)


def row_files(store_dir: str, table: str) -> list[str]:
    """Every row file of `runs` or `stages` (what their glob matches), relative to the store."""
    root, out = os.path.join(store_dir, table), []
    for run in _entries(root):
        for stage in _entries(os.path.join(root, run)):
            out += [os.path.join(table, run, stage, n) for n in _entries(os.path.join(root, run, stage))
                    if n.endswith(".parquet")]
    return out


def state(store_dir: str) -> dict:
    """What a snapshot of the store must name now: the live generations, the damaged files to
    route around and, only while a row file of `runs` or `stages` is damaged, that table's row
    files (named one by one instead of globbed)."""
    missing: list = []
    gens = live(store_dir, missing)
    damaged = damage.relevant(store_dir, gens, missing)
    bad = {d["path"] for d in damaged}
    listed = {t: [f for f in row_files(store_dir, t) if f not in bad]
              for t in sorted({d["table"] for d in damaged} & {"runs", "stages"})}
    return {"gens": gens, "damaged": damaged, "listed": listed}


def named(found: dict | None) -> dict:
    """The `state` a manifest was published for."""
    return {key: (found or {}).get(key) for key in ("gens", "damaged", "listed")}


def view_statements(connection, store_dir: str, gens: dict[str, list[str]], damaged=(),
                    listed: dict | None = None) -> list[str]:
    """`CREATE OR REPLACE VIEW` of every table over the generations `gens` (see `live`), routing
    around `damaged` files (damage.py); `listed`: row files of `runs`/`stages` to name instead of
    their glob. A view binds from its table's schema file, so building one opens no part."""
    statements = []
    for table, spec in TABLES.items():
        bad = {d["path"] for d in damaged if d["table"] == table}
        root = _literal(store_dir)  # DuckDB globs every name: a `[`, `*` or `?` in the path is literal
        files = [schema_file(root, table)] if os.path.isfile(schema_file(store_dir, table)) else []
        if spec.key is None:
            rows = (listed or {}).get(table)
            files += [table_glob(root, table)] if rows is None else [os.path.join(root, _literal(f)) for f in rows]
        for gen in gens.get(table, ()):
            if any(os.path.dirname(b) == gen for b in bad):  # its parts one by one, less the damaged
                files += [os.path.join(root, _literal(gen), n) for n in sorted(os.listdir(os.path.join(store_dir, gen)))
                          if n.endswith(".parquet") and os.path.join(gen, n) not in bad]
            else:
                files.append(os.path.join(root, _literal(gen), "*.parquet"))
        if files:
            source = f"read_parquet([{', '.join(map(quote, files))}])"
        else:  # a store without schema files (an older Dew's, read-only) and no parts yet
            if table not in _empty_sql:
                types = connection.from_arrow(empty(table)).types
                _empty_sql[table] = ", ".join(f'CAST(NULL AS {kind}) AS "{name}"' for name, kind
                                              in zip(empty(table).column_names, types, strict=True))
            source = f"(SELECT {_empty_sql[table]} WHERE false)"
        if branches := damage.branches(store_dir, table, list(damaged)):
            source = f"(SELECT * FROM {source} UNION ALL {' UNION ALL '.join(branches)})"
        if spec.unique:  # one row per unique columns: the first by key (schema.Table.unique)
            columns = ", ".join(f'"{c}"' for c in spec.unique)
            source = (f"(SELECT * FROM {source} QUALIFY row_number() OVER (PARTITION BY {columns} "
                      f'ORDER BY "{spec.key}", written_at) = 1)')
        statements.append(f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM {source}")
    return statements


# ----- publishing ------------------------------------------------------------------------------
def publish(store_dir: str, *, force: bool = False) -> str:
    """Make `dew.duckdb` name the store's current generations (a new snapshot unless the current
    one already does, or `force`: it is damaged), then collect what no reader can still use.
    Returns the snapshot's path."""
    snaps = directory(store_dir)
    os.makedirs(snaps, exist_ok=True)
    guard = FileLock(os.path.join(store_dir, ".locks", "_snapshot.lock"), blocking=True)
    try:
        now = state(store_dir)
        previous = current(store_dir)
        before = manifest(previous) if previous else None
        if not force and previous and os.path.exists(previous) and fits(before, store_dir) and named(before) == now:
            collect(store_dir)  # another writer published it: what is past its grace can still go
            return previous
        number = 1 + max((int(m[1]) for m in map(_SNAP.match, os.listdir(snaps)) if m), default=0)
        path = os.path.join(snaps, f"s{number:08d}.duckdb")
        write_json(path[: -len(".duckdb")] + ".json",
                   {"format": FORMAT, "store": store_dir, "tables": sorted(TABLES), "views": VIEWS, **now})
        tmp = os.path.join(snaps, f"tmp-{uuid.uuid4().hex}.duckdb")
        try:
            try:
                _build(tmp, store_dir, now)
            except duckdb.Error:  # views bind from the schema files alone: one must be damaged
                for leftover in (tmp, tmp + ".wal"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(leftover)
                damage.restore_schema_files(store_dir)
                _build(tmp, store_dir, now)
            os.chmod(tmp, 0o444)  # published snapshots are never written again, by anyone
            os.replace(tmp, path)
        finally:
            for leftover in (tmp, tmp + ".wal"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
        fsync_dir(snaps)
        link = database(store_dir)
        staged = os.path.join(os.path.dirname(link), f".dew-{uuid.uuid4().hex}.link")
        os.symlink(os.path.relpath(path, os.path.dirname(link)), staged)
        os.replace(staged, link)  # one rename: a client opens the old snapshot or the new one
        fsync_dir(os.path.dirname(link))
        collect(store_dir, before)
        return path
    finally:
        guard.release()


def _build(path: str, store_dir: str, now: dict) -> None:
    """Write the snapshot database `path` for `state` `now` (attached to one long-lived in-memory
    DuckDB: a third of the CPU time of starting a database per snapshot). A failure is raised as
    it happened; a connection it left unusable is dropped, so the next publish starts afresh."""
    with _builder_lock:
        if _builder[1] != os.getpid():  # none yet, or inherited through fork()
            _builder[:] = [duckdb.connect(":memory:", config={"threads": 1}), os.getpid()]
        connection = _builder[0]
        connection.execute(f"ATTACH {quote(path)} AS dew_snapshot")
        try:
            connection.execute("USE dew_snapshot")
            statements = view_statements(connection, store_dir, now["gens"], now["damaged"], now["listed"])
            connection.execute("BEGIN; " + "; ".join(statements) + "; COMMIT")
        except BaseException:
            with contextlib.suppress(duckdb.Error):
                connection.execute("ROLLBACK")
            raise
        finally:
            try:
                connection.execute("USE memory")
                connection.execute("DETACH dew_snapshot")
            except duckdb.Error:  # never mask what failed above; a fresh connection next time
                with contextlib.suppress(duckdb.Error):
                    connection.close()
                _builder[:] = [None, -1]


# ----- collecting ------------------------------------------------------------------------------
def _locked_inodes() -> set[int] | None:
    """Inodes some process holds a lock on (Linux /proc/locks), or None where unreadable."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inodes = set()
    for line in lines:
        fields = [f for f in line.split() if f != "->"]
        if len(fields) >= 6:
            with contextlib.suppress(ValueError, IndexError):
                inodes.add(int(fields[5].rsplit(":", 1)[1]))
    return inodes


def _held(path: str, locked: set[int] | None) -> bool:
    """Whether some connection has snapshot `path` open (DuckDB locks a database it opens)."""
    if path in _held_here:
        return True
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        return False
    if locked is not None and inode in locked:
        return True
    if hasattr(fcntl, "F_OFD_GETLK"):  # sees every other lock, also this process's
        try:
            fd = os.open(path, os.O_RDONLY)  # published snapshots are read-only files
        except OSError:
            return True  # cannot probe: keep it
        try:
            probe = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            return struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK
        except OSError:
            return True
        finally:
            os.close(fd)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return True  # cannot probe: keep it
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def collect(store_dir: str, previous: dict | None = None, *, sweep: bool = False) -> None:
    """Remove superseded snapshots no reader can hold any more and the generations none of the
    remaining ones names. Generations are checked in the streams `previous` (the manifest just
    superseded) and the removed snapshots name, or in every stream when `sweep`. Call under the
    snapshot lock (publish, sweep)."""
    snaps = directory(store_dir)
    try:
        names = os.listdir(snaps)
    except FileNotFoundError:
        return
    live_path = current(store_dir)
    now, locked = time.time(), _locked_inodes()
    numbers = sorted({int(m[1]) for m in map(_SNAP.match, names) if m})
    keep: list[dict | None] = []
    homes: set[str] = set()
    for index, number in enumerate(numbers):
        path = os.path.join(snaps, f"s{number:08d}.duckdb")
        found = manifest(path)
        if path == live_path:
            keep.append(found)
            continue
        later = [os.path.join(snaps, f"s{n:08d}.json") for n in numbers[index + 1:]] + [path[:-7] + ".json"]
        retired = next((os.path.getmtime(p) for p in later if os.path.exists(p)), now)
        if now - retired < GRACE_SECONDS or _held(path, locked):
            keep.append(found)
            continue
        for leftover in (path, path + ".wal", path[:-7] + ".json"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        homes.update(os.path.dirname(g) for gens in (found or {}).get("gens", {}).values() for g in gens)
    for name in names:
        if _TMP.match(name):  # a publish killed while building (none runs now: we hold the lock)
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(snaps, name))
    if any(found is None for found in keep):
        return  # a kept snapshot without its manifest: no way to tell what it names
    named = {g for found in keep for gens in found.get("gens", {}).values() for g in gens}
    homes.update(os.path.dirname(g) for gens in (previous or {}).get("gens", {}).values() for g in gens)
    if sweep:
        gens_root = os.path.join(store_dir, ".gens")
        for table in _entries(gens_root):
            for run in _entries(os.path.join(gens_root, table)):
                homes.update(os.path.join(".gens", table, run, stage)
                             for stage in _entries(os.path.join(gens_root, table, run)))
    for home in sorted(homes):
        _collect_home(store_dir, home, named)


def _collect_home(store_dir: str, home: str, named: set[str]) -> None:
    """Remove a stream's generations older than its current one that no kept snapshot names."""
    parts = home.split(os.sep)
    if len(parts) != 4 or parts[0] != ".gens":
        return
    link = os.path.join(store_dir, *parts[1:])
    if not os.path.islink(link):
        return
    match = GEN.match(os.path.basename(os.path.realpath(link)))
    if match is None:
        return
    newest = int(match[1])
    try:
        names = os.listdir(os.path.join(store_dir, home))
    except FileNotFoundError:
        return
    for name in names:
        found = GEN.match(name)
        if found and int(found[1]) < newest and os.path.join(home, name) not in named:
            shutil.rmtree(os.path.join(store_dir, home, name), ignore_errors=True)


def sweep(store_dir: str) -> None:
    """Collect over every stream (a writer opening the store: what killed writers left), and clear
    what killed writers left in streams no live writer holds: generations they built but never
    linked, and half-written temporary files (a stage that is never reopened keeps none)."""
    if not os.path.isdir(directory(store_dir)):
        return
    guard = FileLock(os.path.join(store_dir, ".locks", "_snapshot.lock"), blocking=True)
    try:
        collect(store_dir, sweep=True)
        gens_root = os.path.join(store_dir, ".gens")
        for table in _entries(gens_root):
            for run in _entries(os.path.join(gens_root, table)):
                for stage in _entries(os.path.join(gens_root, table, run)):
                    _tidy_home(store_dir, table, run, stage)
    finally:
        guard.release()


def tidy(store_dir: str) -> None:
    """Collect what is past its grace, when more than one snapshot is left and no publish is
    under way: a reader's turn, since the last writer may be gone (a read-only store: nothing)."""
    try:
        if len(os.listdir(directory(store_dir))) <= 2:  # one snapshot and its manifest
            return
        guard = FileLock(os.path.join(store_dir, ".locks", "_snapshot.lock"), wait=0.0)
    except (StoreBusy, OSError):
        return
    try:
        collect(store_dir)
    finally:
        guard.release()


def _tidy_home(store_dir: str, table: str, run: str, stage: str) -> None:
    """Remove a stream's generations newer than its link and its temporary files, under its
    stage's lock (a writer that holds it may be building them now: then leave them)."""
    home = os.path.join(store_dir, ".gens", table, run, stage)
    link = os.path.join(store_dir, table, run, stage)
    newest = GEN.match(os.path.basename(os.path.realpath(link))) if os.path.islink(link) else None
    try:
        names = os.listdir(home)
    except FileNotFoundError:
        return
    stale = [n for n in names if (m := GEN.match(n)) and newest is not None and int(m[1]) > int(newest[1])]
    try:
        leftovers = os.listdir(os.path.join(home, "tmp"))
    except (FileNotFoundError, NotADirectoryError):
        leftovers = []
    if not stale and not leftovers:
        return
    try:
        guard = FileLock(os.path.join(store_dir, ".locks", run, f"{stage}.lock"), wait=0.0)
    except (StoreBusy, OSError):
        return
    try:
        for name in stale:
            shutil.rmtree(os.path.join(home, name), ignore_errors=True)
        for name in leftovers:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(home, "tmp", name))
    finally:
        guard.release()
