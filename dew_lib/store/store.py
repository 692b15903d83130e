"""The run store of a project directory: where it lives, its views, and queries over it.

A project directory (default `runs/`) holds `store/` (the Parquet parts, see parts.py) and
`dew.duckdb`, a link to the current snapshot: a DuckDB database of views over those parts for the
`duckdb` client and any other DuckDB user (snapshot.py). No process ever opens a snapshot for
writing once it is published, so any number of processes can query while runs write.

`Store.connect()` gives a fresh in-memory DuckDB connection with the same views (over the snapshot
current when it connected, attached read-only) and a memory limit (DuckDB's default, 80% of RAM,
would compete with JAX); use one connection or cursor per thread. `Store.sql` runs a query and
returns an Arrow table, each query on the snapshot current when it starts. `sql` (with `rows`,
`dew sql` and `dew runs`) reads only: it refuses every statement but one query, and runs it on a
connection that reaches no file outside the store's parts and snapshots and cannot change its
settings (readonly.py). A `connect()` connection is the caller's own, like the duckdb client.

A query that fails the way a damaged file makes it fail has the parts it read checked; what is
damaged is recorded and the query runs again on a snapshot that routes around it (damage.py), so
it fails with `StoreDamaged` naming the file (path, table, run, stage) only if it needs that
file's run and stage. A damaged snapshot is replaced by a new one (health.py).

Not here: writing (writer.py), the command line (cli.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import weakref
from typing import Any, NamedTuple

import duckdb
import pyarrow as pa

from dew_lib.store import damage, health, snapshot
from dew_lib.store import rows as _rows
from dew_lib.store.parts import FileLock, StoreError, held, replace_file, write_json
from dew_lib.store.readonly import NotAQuery, lock_down, only_queries
from dew_lib.store.schema import FORMAT, TABLES, empty, placeholder

__all__ = ["NotAQuery", "Store", "StoreDamaged", "StoreNotFound", "StoredSession", "only_queries"]

DEFAULT_MEMORY_LIMIT = "1GB"


class StoreNotFound(StoreError):
    """There is no run store at the given path."""


class StoreDamaged(StoreError):
    """A query needs a damaged file (the message names it: path, table, run and stage); queries
    that leave its run and stage out still read. `dew store repair` moves it aside."""


# Errors a damaged file never causes: the query's own (its SQL, its types, its size).
_QUERY_ERRORS = (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException,
                 duckdb.ConversionException, duckdb.OutOfMemoryException, duckdb.InterruptException,
                 duckdb.PermissionException, duckdb.SyntaxException, duckdb.NotImplementedException,
                 duckdb.OutOfRangeException, duckdb.TypeMismatchException, duckdb.InvalidTypeException)


def _release(held: list) -> None:
    if held[0] is not None:
        snapshot.release(held[0])
        held[0] = None


class _Reader:
    """One thread's connection for Store.sql, and the snapshot it has attached."""

    def __init__(self, connection):
        self.connection, self.held, self.link = connection, [None], None
        self.clean: set[tuple[str, str]] = set()  # (snapshot, table) checked whole after a failure
        self.listed, self.bad = None, set()  # row files the snapshot names one by one, damaged files
        weakref.finalize(self, _release, self.held)


class StoredSession(NamedTuple):
    """A session read back from the store with what was recorded beside it."""

    update: int
    session: Any  # dew_lib.records.Session
    trained: bool
    cause: str | None
    latency: float | None


class Store:
    """The run store of one project directory.

    path: the project directory (`runs`), its `dew.duckdb` or its `store/` directory.
    memory_limit and threads: DuckDB settings of the connections this Store opens (threads
    None: DuckDB's default, one per core). Writers are opened with `writer(run)`.
    """

    def __init__(self, path: str | os.PathLike = "runs", *, memory_limit: str | None = None,
                 threads: int | None = None):
        path = os.path.abspath(os.fspath(path))
        if "?" in path:  # DuckDB's ATTACH reads what follows a `?` as options
            raise StoreError(f"the run store's path {path!r} holds a '?', which DuckDB cannot open; "
                             "use a project directory without one")
        if path.endswith(".duckdb"):
            path = os.path.dirname(path)
        elif os.path.basename(path) == "store" and os.path.isfile(os.path.join(path, "format.json")):
            path = os.path.dirname(path)
        self.project = path
        self.directory = os.path.join(path, "store")
        self.database = os.path.join(path, "dew.duckdb")
        self.memory_limit = memory_limit or os.environ.get("DEW_DUCKDB_MEMORY_LIMIT", DEFAULT_MEMORY_LIMIT)
        self.threads = threads
        self._code_version: str | None = None
        self.retries = 0  # kept for callers that print it: snapshots need no reruns
        self._local = threading.local()  # Store.sql's connection and its snapshot, one per thread
        self._tidied = 0.0  # when this Store last collected what writers left past its grace

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state):
        self.__dict__.update(state, _local=threading.local())

    def __repr__(self) -> str:
        return f"Store({self.project!r})"

    # ----- layout ------------------------------------------------------------------------------
    def exists(self) -> bool:
        return os.path.isfile(os.path.join(self.directory, "format.json"))

    def lock_path(self, run: str, stage: str | None = None) -> str:
        return os.path.join(self.directory, ".locks", run, f"{stage or '_run'}.lock")

    def tmp_dir(self, run: str) -> str:
        return os.path.join(self.directory, ".gens", "_tmp", run)

    def create(self) -> None:
        """Create the directory layout, a zero-row placeholder part for `runs` and `stages` (their
        views glob their directories), and a current snapshot (`dew.duckdb`); remove what killed
        writers left. A no-op when they are current."""
        try:
            os.makedirs(os.path.join(self.directory, ".locks"), exist_ok=True)
        except OSError as error:
            raise StoreError(f"cannot create the run store at {self.directory}: {error}; pass a "
                             "writable directory") from error
        try:
            guard = FileLock(os.path.join(self.directory, ".locks", "_layout.lock"), blocking=True)
            try:
                format_path = os.path.join(self.directory, "format.json")
                if os.path.exists(format_path):
                    self._check_format()
                for table, spec in TABLES.items():
                    os.makedirs(os.path.join(self.directory, table), exist_ok=True)
                    path = placeholder(self.directory, table)
                    if spec.key is None and not os.path.exists(path):
                        replace_file(empty(table), path, os.path.join(self.directory, ".gens", "_tmp"))
                if not os.path.exists(format_path):
                    write_json(format_path, {"format": FORMAT})
                damage.restore_schema_files(self.directory)
                snapshot.sweep(self.directory)
                snapshot.publish(self.directory)
            finally:
                guard.release()
        except OSError as error:
            raise StoreError(f"cannot write the run store at {self.directory}: {error}; pass a writable "
                             "directory, or fix the permissions of this one") from error

    def _check_format(self) -> None:
        path = os.path.join(self.directory, "format.json")
        try:
            with open(path, encoding="utf-8") as f:
                found = json.load(f)
            found = found["format"] if isinstance(found, dict) else found
        except (ValueError, KeyError, TypeError) as error:
            raise StoreError(f"{path} is damaged ({type(error).__name__}: {error}); it should hold "
                             f'{{"format": {FORMAT}}}: restore that content if the store was written by '
                             "this Dew version") from None
        except OSError as error:
            raise StoreError(f"cannot read {path}: {error}; fix its permissions") from error
        if found != FORMAT:
            raise StoreError(f"the run store at {self.directory} has format {found}; this Dew reads "
                             f"format {FORMAT}. Use the Dew version that wrote it, or a new directory")

    def code_version(self) -> str:
        """The git commit of the code (with `+dirty` for local changes) or the package version."""
        if self._code_version is None:
            here = os.path.dirname(os.path.abspath(__file__))
            try:
                commit = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                                        text=True, timeout=5, check=True).stdout.strip()
                dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                       capture_output=True, text=True, timeout=5, check=True).stdout.strip()
                self._code_version = commit + ("+dirty" if dirty else "")
            except (OSError, subprocess.SubprocessError):
                from importlib.metadata import PackageNotFoundError, version

                try:
                    self._code_version = f"dew {version('dew')}"
                except PackageNotFoundError:
                    self._code_version = "unknown"
        return self._code_version

    # ----- writing -----------------------------------------------------------------------------
    def writer(self, run: str, **options):
        """A RunWriter for `run` (see writer.py); creates the store if needed."""
        from dew_lib.store.writer import RunWriter

        return RunWriter(self, run, **options)

    # ----- reading -----------------------------------------------------------------------------
    def connect(self) -> duckdb.DuckDBPyConnection:
        """A new in-memory DuckDB connection with a view per table over the current snapshot (one
        per thread). It sees parts appended to the generations that snapshot names; open a new one
        (or use `sql`) to see later compactions and stages."""
        connection, held = self._open(locked=False), [None]
        weakref.finalize(connection, _release, held)
        self._bind(connection, held)
        return connection

    def _open(self, *, locked: bool = True) -> duckdb.DuckDBPyConnection:
        if not self.exists():
            raise StoreNotFound(
                f"no run store at {self.project} (expected {self.directory}/format.json); run a "
                "stage first, or point --store at a project directory such as runs/"
            )
        self._check_format()
        config = {"memory_limit": self.memory_limit, "autoinstall_known_extensions": False,
                  "autoload_known_extensions": False}
        if self.threads:
            config["threads"] = self.threads
        connection = duckdb.connect(":memory:", config=config)
        if locked:
            lock_down(connection, self.directory)
        return connection

    def _current(self) -> str | None:
        """The snapshot to read: the current one, published first when it is missing, was made for
        another directory or format, or lags the stages' links (a writer killed before it
        published); None where no snapshot can be written (a read-only store)."""
        path = snapshot.current(self.directory)
        found = snapshot.manifest(path) if path else None
        fits = snapshot.fits(found, self.directory)
        if fits and snapshot.named(found) == snapshot.state(self.directory):
            return path
        try:
            if fits:
                snapshot.publish(self.directory)
            else:
                self.create()  # an older store, a moved one, or one that lacks a table
        except (StoreError, OSError):
            return None
        return snapshot.current(self.directory)

    def _bind(self, connection, held: list) -> None:
        """Point `connection`'s views at the current snapshot, attached read-only (DuckDB's lock
        on it keeps it from being collected), and detach the one in `held` ([path or None]).
        Where no snapshot can be published (a read-only store), the views read the store's
        current generations directly."""
        for _ in range(3):
            path = self._current()
            if path is None:
                now = snapshot.state(self.directory)
                statements = snapshot.view_statements(connection, self.directory, now["gens"], now["damaged"],
                                                      now["listed"])
                break
            if path == held[0]:
                return
            alias = "dew_" + os.path.basename(path)[: -len(".duckdb")]
            try:
                connection.execute(f"ATTACH {snapshot.quote(path)} AS {alias} (READ_ONLY)")
            except duckdb.Error as error:
                if os.path.exists(path):  # not collected since we read the link: damaged
                    why = " ".join(str(error).split())
                    try:
                        health.replace_snapshot(self.directory, path, why)
                    except (StoreError, OSError) as failed:
                        raise StoreError(f"the snapshot {path} is damaged ({why}) and no new one can be "
                                         f"published ({failed}); run `dew store repair` where the store "
                                         "is writable") from None
                continue
            snapshot.hold(path)
            statements = [f"CREATE OR REPLACE VIEW main.{t} AS SELECT * FROM {alias}.{t}" for t in TABLES]
            break
        else:
            raise StoreError(f"the snapshot of the run store at {self.directory} kept changing; try again")
        for statement in statements:
            connection.execute(statement)
        old, held[0] = held[0], path
        if old is not None:
            connection.execute(f"DETACH dew_{os.path.basename(old)[: -len('.duckdb')]}")
            snapshot.release(old)

    def _reader(self) -> _Reader:
        """This thread's query connection, bound to the current snapshot."""
        reader = getattr(self._local, "reader", None)
        link = snapshot.current(self.directory)
        if reader is None:
            reader = self._local.reader = _Reader(self._open())
        moved = reader.link is None or link != reader.link[0]
        if moved or (reader.listed and reader.listed != self._listed(reader)):  # a new run, listed
            reader.link = [link]  # views bind their globs at every query: new parts show at once
            self._bind(reader.connection, reader.held)
            found = (snapshot.manifest(reader.held[0]) if reader.held[0] else None) or {}
            reader.listed, reader.bad = found.get("listed"), {d["path"] for d in found.get("damaged") or []}
        if time.monotonic() - self._tidied > snapshot.GRACE_SECONDS / 2:
            self._tidied = time.monotonic()  # the last writer may be gone: collect in its place
            snapshot.tidy(self.directory)
        return reader

    def _listed(self, reader: _Reader) -> dict:
        """The row files the bound snapshot's `runs`/`stages` views would name now (damage.py)."""
        return {t: [f for f in snapshot.row_files(self.directory, t) if f not in reader.bad] for t in reader.listed}

    def _run(self, query: str, parameters, fetch):
        statement = only_queries(query) or query
        for attempt in range(2):
            reader = self._reader()
            try:
                return fetch(reader.connection.sql(statement, params=parameters))
            except duckdb.Error as error:
                if damage.REPAIR in str(error):  # a view's branch for a damaged file
                    if attempt == 0:  # restored since, or repaired? The rebind republishes then
                        reader.link = None
                        continue
                    raise StoreDamaged(str(error).split("Error: ", 1)[-1]) from None
                if attempt or isinstance(error, _QUERY_ERRORS) or not self._find_damage(query, error, reader):
                    raise
                reader.link = None  # rebind: the new snapshot routes around what was found
        raise AssertionError("unreachable")

    def _find_damage(self, query: str, error: duckdb.Error, reader: _Reader) -> bool:
        """Check the files a failed query may have read: those its error names, else every part
        of the tables it names (once per snapshot). Record what is damaged and publish a snapshot
        that routes around it; False when nothing was."""
        bound = snapshot.manifest(reader.held[0]) if reader.held[0] else None
        if bound is not None and snapshot.named(bound) != snapshot.state(self.directory):
            return True  # the store changed under the bound snapshot (a generation deleted): rebind
        found = health.failed_reads(self.directory, query, str(error), reader.held[0], reader.clean)
        if not found:
            return False
        try:
            damage.record(self.directory, found)
            snapshot.publish(self.directory)
        except (StoreError, OSError):  # a read-only store: name them, route around none
            raise StoreDamaged("; ".join(damage.message(self.directory, f) for f in found)) from error
        return True

    def damaged(self) -> list[dict[str, Any]]:
        """The damaged files queries route around now (damage.py): path (absolute), table, run,
        stage and reason of each."""
        held_now = self._reader().held[0]
        found = snapshot.manifest(held_now) if held_now else snapshot.state(self.directory)
        return [{**d, "path": os.path.join(self.directory, d["path"])} for d in (found or {}).get("damaged") or []]

    def sql(self, query: str, parameters: Any = None) -> pa.Table:
        """Run one query and return its result as an Arrow table."""
        return self._run(query, parameters,
                         lambda result: pa.table({}) if result is None else result.to_arrow_table())

    def rows(self, query: str, parameters: Any = None) -> tuple[list[str], list[tuple]]:
        """Run one query and return (column names, rows as Python tuples)."""
        return self._run(query, parameters,
                         lambda result: ([], []) if result is None else (result.columns, result.fetchall()))

    def read_sessions(self, run: str, stage: str, *, where: str = "TRUE",
                      parameters: list | None = None) -> list[StoredSession]:
        """Sessions of one stage as `Session` objects (calls included), in update order.

        where: an extra SQL condition on the `sessions` view (s.*), with `?` parameters.
        """
        columns, found = self.rows(
            f"SELECT * FROM sessions s WHERE run = ? AND stage = ? AND ({where}) "
            "ORDER BY update, task, group_id, sample, attempt",
            [run, stage, *(parameters or [])])
        sessions = [dict(zip(columns, row, strict=True)) for row in found]
        if not sessions:
            return []
        call_columns, call_rows = self.rows(
            "SELECT * FROM calls WHERE run = ? AND stage = ? AND session_uid IN "
            "(SELECT unnest(?::BIGINT[])) ORDER BY session_uid, call",
            [run, stage, [s["session_uid"] for s in sessions]])
        calls: dict[int, list[dict]] = {}
        for row in call_rows:
            call = dict(zip(call_columns, row, strict=True))
            calls.setdefault(call["session_uid"], []).append(call)
        return [StoredSession(s["update"], _rows.session_from_rows(s, calls.get(s["session_uid"], [])),
                              s["trained"], s["cause"], s["latency"]) for s in sessions]

    def resumable_sessions(self, run: str, stage: str, *, updates: int, max_lag: int
                           ) -> list[StoredSession]:
        """Sessions a resumed asynchronous stage may train instead of drawing again: every
        session of the stage whose calls all came from weights the resumed state descends from
        (max_version <= updates, the checkpoint's optimizer updates) and within the staleness
        bound of them (min_version >= updates - max_lag). Read them before `discard_after`
        drops the killed attempt's rows; `RolloutScheduler.reuse` keeps the admissible ones
        (docs/rl.md, "Resume")."""
        return self.read_sessions(run, stage, where="max_version <= ? AND min_version >= ?",
                                  parameters=[int(updates), int(updates) - int(max_lag)])

    def untrained_sessions(self, run: str, stage: str) -> list[StoredSession]:
        """Sessions recorded as pending (finished, waiting for their group) that no later record
        of the same task, group, sample and attempt admitted, discarded or trained: what a resumed
        scheduler can still train on."""
        return self.read_sessions(run, stage, where=(
            "cause = 'pending' AND NOT EXISTS (SELECT 1 FROM sessions o WHERE o.run = s.run AND "
            "o.stage = s.stage AND o.task = s.task AND o.group_id = s.group_id AND o.sample = s.sample "
            "AND o.attempt = s.attempt AND (o.trained OR o.cause IS DISTINCT FROM 'pending'))"))

    def runs(self) -> tuple[list[str], list[tuple]]:
        """One row per stage of every run (runs without stages get one row), newest run first,
        with the run's status and attempts (starts: a run continued after a kill counts two), the
        stage's status, steps and headline metrics: the last logged loss, training accuracy
        (`train_accuracy`, of the training batches' tokens) and reward, and the held-out ones: the
        greedy accuracy of the stage's last evaluation (`accuracy`) and that of its sampled answers
        (`sampled`), never a training figure. A run or stage recorded as running whose writer no
        longer holds its lock shows as interrupted; such a stage's `seconds` run until its last
        record."""
        for attempt in range(2):  # a damaged file found by the first is routed around by the second
            damaged = self.damaged()
            try:
                columns, found = self.rows(runs_query(damaged))
                break
            except StoreDamaged:
                if attempt:
                    raise
        run_at, stage_at = columns.index("status"), columns.index("stage_status")
        seconds_at, until_last = columns.index("seconds"), columns.index("until_last")
        out = []
        for row in found:
            row = list(row)
            if row[run_at] == "running" and not held(self.lock_path(row[0])):
                row[run_at] = "interrupted"
            if row[stage_at] == "running" and not held(self.lock_path(row[0], row[columns.index("stage")])):
                row[stage_at] = "interrupted"
                row[seconds_at] = row[until_last]
            del row[until_last]
            out.append(tuple(row))
        return columns[:until_last] + columns[until_last + 1:], out


# The last record of a running stage: its newest row in any table that stamps rows.
_STAMPED = " UNION ALL ".join(f"SELECT run, stage, written_at FROM {t}" for t, spec in TABLES.items()
                              if spec.key is not None and "written_at" in spec.schema.names)

# `accuracy` and `sampled` are held-out figures only: an evaluation's answers, or the
# `greedy_accuracy` and `sampled_accuracy` an evaluation stage finished with. A training stage's
# `accuracy` metric (its batches' token accuracy) is `train_accuracy`, never shown as held-out.
RUNS_QUERY = f"""
WITH last AS (
    SELECT run, stage, max(step) AS steps,
           arg_max(value, step) FILTER (name = 'loss') AS loss,
           arg_max(value, step) FILTER (name = 'accuracy') AS train_accuracy,
           coalesce(arg_max(value, step) FILTER (name = 'reward'),
                    arg_max(value, step) FILTER (name = 'reward/mean')) AS reward
    FROM metrics GROUP BY run, stage),
last_eval AS (
    SELECT run, stage, max(step) AS step FROM evaluations GROUP BY run, stage),
accuracy AS (
    SELECT e.run, e.stage,
           avg(coalesce(e.correct::DOUBLE, e.score)) FILTER (e.sample = 0) AS greedy,
           avg(coalesce(e.correct::DOUBLE, e.score)) FILTER (e.sample > 0) AS sampled
    FROM evaluations e JOIN last_eval l USING (run, stage, step) GROUP BY e.run, e.stage),
written AS (
    SELECT w.run, w.stage, max(w.written_at) AS at
    FROM ({_STAMPED}) w SEMI JOIN (SELECT run, stage FROM stages WHERE status = 'running') USING (run, stage)
    GROUP BY w.run, w.stage)
SELECT r.run, r.status, r.attempts, r.started_at, s.stage, s.kind, s.status AS stage_status, s.attempt,
       l.steps, round(coalesce(l.loss, s.metrics['loss']), 4) AS loss,
       -- A stage with evaluation answers is an evaluation: stores before `greedy_accuracy` kept
       -- its held-out score as the stage metric `accuracy`, which is not a training accuracy.
       round(coalesce(l.train_accuracy, CASE WHEN a.greedy IS NULL THEN s.metrics['accuracy'] END), 4)
           AS train_accuracy,
       round(coalesce(l.reward, s.metrics['reward'], s.metrics['reward/mean']), 4) AS reward,
       round(coalesce(a.greedy, s.metrics['greedy_accuracy']), 4) AS accuracy,
       round(coalesce(a.sampled, s.metrics['sampled_accuracy']), 4) AS sampled,
       round(greatest(epoch(coalesce(s.finished_at, now()) - s.started_at), 0), 1) AS seconds,
       round(greatest(epoch(greatest(s.updated_at, w.at) - s.started_at), 0), 1) AS until_last
FROM runs r
LEFT JOIN stages s USING (run)
LEFT JOIN last l USING (run, stage)
LEFT JOIN accuracy a USING (run, stage)
LEFT JOIN written w USING (run, stage)
ORDER BY r.started_at DESC, r.run, s.started_at
"""


def runs_query(damaged: list[dict[str, Any]]) -> str:
    """RUNS_QUERY reading every table without the streams of `damaged` files (whose view branches
    would fail it): `dew runs` lists what it can and names what it left out."""
    def keep(match: re.Match) -> str:
        condition = damage.leave_out(damaged, match[2])
        return match[0] if condition == "TRUE" else f"{match[1]} (SELECT * FROM {match[2]} WHERE {condition})"

    return re.sub(rf"\b(FROM|JOIN)\s+({'|'.join(TABLES)})\b", keep, RUNS_QUERY)
