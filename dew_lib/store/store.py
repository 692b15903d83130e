"""The run store of a project directory: where it lives, its views, and queries over it.

A project directory (default `runs/`) holds `store/` (the Parquet parts, see parts.py) and
`dew.duckdb`, a DuckDB database of views over those parts for the `duckdb` client and any other
DuckDB user. No process ever keeps `dew.duckdb` open for writing: writers only append parts, and
the database is rebuilt (under a temporary name, then renamed into place) only when it is
missing or the directory moved. So any number of processes can query while runs write.

`Store.connect()` gives a fresh in-memory DuckDB connection with the same views and a memory
limit (DuckDB's default, 80% of RAM, would compete with JAX); use one connection or cursor per
thread. `Store.sql` runs a query and returns an Arrow table, rerunning it when a compaction moved a
stream's parts while it ran (so it never answers from half a listing).

Not here: writing (writer.py), the command line (cli.py).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import threading
import time
import uuid
from typing import Any, NamedTuple

import duckdb
import pyarrow as pa

from dew_lib.store import rows as _rows
from dew_lib.store.parts import (FileLock, StoreError, fsync_dir, held, replace_file, swap_count, swaps_since,
                                 write_json)
from dew_lib.store.schema import FORMAT, TABLES, empty, placeholder, view_sql
from dew_lib.store.schema import glob as _glob

DEFAULT_MEMORY_LIMIT = "1GB"
RETRY_SECONDS = 60.0  # how long a query keeps rerunning while compactions overlap it


class StoreNotFound(StoreError):
    """There is no run store at the given path."""


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
        self.retries = 0  # queries rerun because a compaction overlapped them
        self._local = threading.local()  # Store.sql's connection, one per thread

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
        """Create the directory layout, a zero-row placeholder part for every table without parts
        (so every view has a file to bind to) and `dew.duckdb`; a no-op when they are current."""
        try:
            os.makedirs(os.path.join(self.directory, ".locks"), exist_ok=True)
        except OSError as error:
            raise StoreError(f"cannot create the run store at {self.directory}: {error}; pass a "
                             "writable directory") from error
        guard = FileLock(os.path.join(self.directory, ".locks", "_layout.lock"), blocking=True)
        try:
            format_path = os.path.join(self.directory, "format.json")
            if os.path.exists(format_path):
                self._check_format()
            for table in TABLES:
                path = placeholder(self.directory, table)
                if not os.path.exists(path) and not glob.glob(_glob(self.directory, table)):
                    replace_file(empty(table), path, os.path.join(self.directory, ".gens", "_tmp"))
            if not os.path.exists(format_path):
                write_json(format_path, {"format": FORMAT})
            self._views_file()
        finally:
            guard.release()

    def _check_format(self) -> None:
        with open(os.path.join(self.directory, "format.json"), encoding="utf-8") as f:
            found = json.load(f).get("format")
        if found != FORMAT:
            raise StoreError(f"the run store at {self.directory} has format {found}; this Dew reads "
                             f"format {FORMAT}. Use the Dew version that wrote it, or a new directory")

    def _views_file(self) -> None:
        marker = os.path.join(self.directory, "views.json")
        wanted = {"format": FORMAT, "store": self.directory, "tables": sorted(TABLES)}
        if os.path.exists(self.database) and os.path.exists(marker):
            with open(marker, encoding="utf-8") as f:
                if json.load(f) == wanted:
                    return
        tmp = os.path.join(self.project, f".dew-{uuid.uuid4().hex}.duckdb.tmp")
        try:
            connection = duckdb.connect(tmp)
            try:
                for table in TABLES:
                    connection.execute(view_sql(self.directory, table))
            finally:
                connection.close()
            os.replace(tmp, self.database)  # a new file: readers holding the old one keep it
            fsync_dir(self.project)
        finally:
            for leftover in (tmp, tmp + ".wal"):
                if os.path.exists(leftover):
                    os.remove(leftover)
        write_json(marker, wanted)

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
        """A new in-memory DuckDB connection with a view per table (one per thread)."""
        if not self.exists():
            raise StoreNotFound(
                f"no run store at {self.project} (expected {self.directory}/format.json); run a "
                "stage first, or point --store at a project directory such as runs/"
            )
        self._check_format()
        if not all(os.path.isdir(os.path.join(self.directory, t)) for t in TABLES):
            self.create()  # a store written before a table was added gains its empty part
        config = {"memory_limit": self.memory_limit}
        if self.threads:
            config["threads"] = self.threads
        connection = duckdb.connect(":memory:", config=config)
        for table in TABLES:
            connection.execute(view_sql(self.directory, table))
        return connection

    def _run(self, query: str, parameters, fetch):
        connection = getattr(self._local, "connection", None)
        if connection is None:  # views bind their globs at every query, so one connection sees new parts
            connection = self._local.connection = self.connect()
        deadline, pause = time.monotonic() + RETRY_SECONDS, 0.002
        while True:
            # A compaction that moves a stream's link while the query lists its parts can hide
            # parts from it (see parts.py), so a query that overlapped one runs again.
            swaps = swap_count(self.directory)
            try:
                result = fetch(connection.sql(query, params=parameters))
                if not swaps_since(self.directory, swaps):
                    return result
            except duckdb.IOException as error:  # a part, or every part, vanished from its listing
                vanished = "No such file" in str(error) or "No files found" in str(error)
                if not (vanished and swaps_since(self.directory, swaps)):
                    raise
            if time.monotonic() > deadline:
                raise StoreError(f"a query kept overlapping compactions for {RETRY_SECONDS:.0f} s; "
                                 "run it again once the writers are idle")
            self.retries += 1
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

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
        with status, steps and headline metrics. A run or stage recorded as running whose writer
        no longer holds its lock shows as interrupted."""
        columns, found = self.rows(RUNS_QUERY)
        run_at, stage_at = columns.index("status"), columns.index("stage_status")
        out = []
        for row in found:
            row = list(row)
            if row[run_at] == "running" and not held(self.lock_path(row[0])):
                row[run_at] = "interrupted"
            if row[stage_at] == "running" and not held(self.lock_path(row[0], row[columns.index("stage")])):
                row[stage_at] = "interrupted"
            out.append(tuple(row))
        return columns, out


RUNS_QUERY = """
WITH last AS (
    SELECT run, stage, max(step) AS steps,
           arg_max(value, step) FILTER (name = 'loss') AS loss,
           arg_max(value, step) FILTER (name = 'reward/mean') AS reward
    FROM metrics GROUP BY run, stage),
last_eval AS (
    SELECT run, stage, max(step) AS step FROM evaluations GROUP BY run, stage),
accuracy AS (
    SELECT e.run, e.stage, avg(e.score) AS accuracy
    FROM evaluations e JOIN last_eval l USING (run, stage, step) GROUP BY e.run, e.stage)
SELECT r.run, r.status, r.started_at, s.stage, s.kind, s.status AS stage_status, s.attempt,
       l.steps, round(coalesce(l.loss, s.metrics['loss']), 4) AS loss,
       round(coalesce(l.reward, s.metrics['reward/mean']), 4) AS reward,
       round(coalesce(a.accuracy, s.metrics['accuracy']), 4) AS accuracy,
       round(epoch(coalesce(s.finished_at, now()) - s.started_at), 1) AS seconds
FROM runs r
LEFT JOIN stages s USING (run)
LEFT JOIN last l USING (run, stage)
LEFT JOIN accuracy a USING (run, stage)
ORDER BY r.started_at DESC, r.run, s.started_at
"""
