"""Read-only queries: what `Store.sql`, `Store.rows`, `dew sql` and `dew runs` let through, and the
connection they run on.

Two walls, so that a statement that slips past one still meets the other:

1. `only_queries` asks DuckDB's own parser what the SQL is and lets through one query (run as the
   statement it parsed, so what runs is what was checked): a SELECT
   in DuckDB's sense (SELECT, WITH, FROM-first, VALUES, DESCRIBE, SHOW, SUMMARIZE, PIVOT's
   SELECT forms) or an EXPLAIN [ANALYZE] of one. Everything else is refused with its kind
   named: COPY, EXPORT, ATTACH, DETACH, CREATE, DROP, ALTER, INSERT, UPDATE, DELETE, SET, RESET,
   PRAGMA (it mixes reads with setting changes; `SHOW TABLES`, `DESCRIBE t` and
   `FROM pragma_table_info('t')` are the read forms), CALL, INSTALL, LOAD, transactions,
   PREPARE/EXECUTE and several statements at once.
2. `lock_down` turns the connection's file access off except for reads of the directories the
   views name (`store/.gens`, `store/.snaps`, `store/runs`, `store/stages`; not `format.json`, not
   `.locks`, nothing outside the store), sends DuckDB's spill files to a private temporary
   directory, leaves extensions uninstallable and unloadable (parquet and json are built in), and
   locks the configuration, so no later statement can undo it. Snapshots are attached READ_ONLY
   (store.py) and are read-only files (snapshot.py).

What a query can still do: read every file in those directories (`read_blob`, `glob`) and use
the memory and threads the Store allows. What the second wall does not stop: DuckDB has no
read-only file access, so a writing statement that got past the first could write inside those
four directories (nothing else); DuckDB has no SELECT that writes a file, and the table
functions with side effects (`enable_logging`, `enable_profiling`, grammar extensions) need a
setting the locked configuration refuses.

Not here: the views (snapshot.py), the connection's life (store.py).
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid

import duckdb

from dew_lib.store.damage import quote
from dew_lib.store.parts import StoreError

READ_DIRECTORIES = (".gens", ".snaps", "runs", "stages")  # under the store: what views read
_EXPLAIN = re.compile(r"^(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*EXPLAIN\s*(?:\([^)]*\)\s*)?(?:ANALY[SZ]E\b)?",
                      re.IGNORECASE | re.DOTALL)


class NotAQuery(StoreError):
    """`Store.sql` and `dew sql` read: a statement that is not one query is refused."""


def _kind(statement) -> str:
    """The statement's kind as its user wrote it: `PRAGMA threads=1` is DuckDB's SET."""
    words = re.sub(r"(--[^\n]*|/\*.*?\*/)", " ", statement.query, flags=re.DOTALL).split()
    first = words[0].upper() if words else statement.type.name
    return first if first == statement.type.name else f"{first} ({statement.type.name})"


def only_queries(sql: str):
    """Refuse anything but one query (see the module docstring), naming the statement's kind:
    the store is written by runs, never through a query. Returns the parsed statement, to be run
    as it is (no second parse can differ from what was checked), or None for SQL DuckDB cannot
    parse (running it raises the syntax error with its position)."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error:
        return None
    if not statements:
        raise NotAQuery("the SQL holds no statement; give one query, e.g. SELECT * FROM runs")
    if len(statements) > 1:
        raise NotAQuery(f"the SQL holds {len(statements)} statements ({', '.join(map(_kind, statements))}); "
                        "the store takes one query at a time")
    statement, = statements
    if statement.type == duckdb.StatementType.SELECT:
        return statement
    if statement.type == duckdb.StatementType.EXPLAIN and (found := _EXPLAIN.match(statement.query)):
        try:
            inner = duckdb.extract_statements(statement.query[found.end():])
        except duckdb.Error:
            inner = []
        if [s.type for s in inner] == [duckdb.StatementType.SELECT]:
            return statement
        raise NotAQuery("the store is read-only here: EXPLAIN runs only of a query (EXPLAIN SELECT ...)")
    raise NotAQuery(f"the store is read-only here: {_kind(statement)} statements are refused; only queries "
                    "(SELECT, WITH, FROM, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN of one) run. Runs write the "
                    "store; to save a result, `dew sql --csv ... > file` or Store.sql(...) in Python")


def lock_down(connection: duckdb.DuckDBPyConnection, store_dir: str) -> None:
    """Restrict `connection` to reading the store (see the module docstring); irreversible."""
    places = []
    for root in dict.fromkeys((os.path.abspath(store_dir), os.path.realpath(store_dir))):
        for form in dict.fromkeys((root, re.sub(r"([\[*?])", r"[\1]", root))):  # views name it as a glob
            places += [os.path.join(form, name) + os.sep for name in READ_DIRECTORIES]
    spill = os.path.join(tempfile.gettempdir(), f"dew-duckdb-{uuid.uuid4().hex}")  # made only to spill
    connection.execute(f"SET temp_directory = {quote(spill)}")
    connection.execute(f"SET allowed_directories = [{', '.join(map(quote, places))}]")
    connection.execute("SET enable_external_access = false")
    connection.execute("SET lock_configuration = true")
