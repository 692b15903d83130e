"""`dew sql` and `Store.sql` read and nothing else: an adversarial session against a real store.

Every attack a user (or a pasted query) could make through the query path: writing a part,
`format.json` or any file with COPY or EXPORT, attaching the snapshot or another database to
change or create something, DDL, settings, extensions, and reading files outside the store. Each
must be refused (exit 1 and one line naming the statement's kind, or DuckDB's permission error)
and leave every file of the project, and every file outside it, byte for byte and mtime as it was.
Then the same attacks with the parser wall taken away, to show the connection's own wall.
"""

import hashlib
import os
import shutil
import subprocess
import sys

import duckdb
import pytest
from store_worker import two_runs

from dew_lib import cli
from dew_lib.store import NotAQuery, Store, StoreError, readonly, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree(root):
    """Every file under `root`: size, mtime and a digest of its bytes."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                out[path] = ("link", os.readlink(path))
                continue
            with open(path, "rb") as f:
                out[path] = (os.path.getsize(path), os.stat(path).st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return out


@pytest.fixture
def project(tmp_path, monkeypatch):
    """Two runs of a GRPO stage; one snapshot left (the grace set to 0), so nothing changes later."""
    monkeypatch.setattr(snapshot, "GRACE_SECONDS", 0.0)
    path = tmp_path / "runs"
    store = two_runs(path)
    Store(path).sql("SELECT count(*) FROM sessions")  # publish and collect what the writers left
    snapshot.tidy(store.directory)
    return path


def dew_sql(capsys, project, query):
    code = cli.main(["--store", str(project), "sql", query])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def attacks(store_dir, outside):
    part = os.path.realpath(os.path.join(store_dir, "sessions", "a", "grpo"))
    part = os.path.join(part, sorted(os.listdir(part))[0])
    snap = snapshot.current(store_dir)
    fmt = os.path.join(store_dir, "format.json")
    return [  # (query, what the refusal names)
        (f"COPY (SELECT 1 AS a WHERE false) TO '{part}' (FORMAT parquet)", "COPY"),
        (f"COPY (SELECT 1 AS a) TO '{fmt}'", "COPY"),
        (f"COPY (SELECT * FROM sessions) TO '{outside}/stolen.csv'", "COPY"),
        (f"COPY sessions TO '{outside}/stolen.parquet'", "COPY"),
        (f"ATTACH '{snap}' AS w; DROP VIEW w.sessions", "2 statements"),
        (f"ATTACH '{snap}' AS w", "ATTACH"),
        (f"ATTACH '{outside}/elsewhere.duckdb' AS e", "ATTACH"),
        (f"ATTACH '{store_dir}/planted.duckdb' AS e", "ATTACH"),
        ("CREATE TABLE e.t AS SELECT 1", "CREATE"),
        (f"EXPORT DATABASE '{outside}/exported'", "EXPORT"),
        (f"EXPORT DATABASE '{store_dir}/exported'", "EXPORT"),
        ("DROP VIEW sessions", "DROP"),
        ("CREATE TABLE t AS SELECT * FROM sessions", "CREATE"),
        ("CREATE OR REPLACE VIEW sessions AS SELECT 1", "CREATE"),
        ("INSERT INTO sessions SELECT * FROM sessions", "INSERT"),
        ("DELETE FROM sessions", "DELETE"),
        ("SET memory_limit = '100GB'", "SET"),
        ("SET enable_external_access = true", "SET"),
        ("RESET lock_configuration", "RESET"),
        ("SET VARIABLE x = 1", "SET"),
        ("PRAGMA threads = 64", "PRAGMA"),
        ("PRAGMA show_tables", "PRAGMA"),
        ("PRAGMA enable_profiling", "PRAGMA"),
        ("CALL pragma_show_tables()", "CALL"),
        ("INSTALL httpfs", "INSTALL"),
        ("LOAD httpfs", "LOAD"),
        ("CHECKPOINT", "CHECKPOINT"),
        ("BEGIN TRANSACTION", "BEGIN"),
        ("USE memory", "USE"),
        ("DETACH memory", "DETACH"),
        ("PREPARE p AS SELECT 1", "PREPARE"),
        (f"EXPLAIN ANALYZE COPY sessions TO '{outside}/x.csv'", "EXPLAIN"),
        (f"SELECT 1; COPY sessions TO '{outside}/x.csv'", "2 statements"),
    ]


# Queries (SELECT to DuckDB's parser) that only the connection's wall stops: files outside the
# store's parts and snapshots, and the side-effect table functions.
def reads(store_dir, outside):
    return [
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/hostname')",
        f"SELECT * FROM read_text('{outside}/secret.txt')",
        f"SELECT * FROM read_text('{store_dir}/format.json')",
        f"SELECT * FROM read_text('{store_dir}/.locks/_snapshot.lock')",
        f"SELECT * FROM read_parquet('{store_dir}/.gens/../../outside.parquet')",
        "SELECT * FROM glob('/*')",
        f"FROM enable_logging(storage = 'file', storage_path = '{store_dir}/.gens/log')",
        "FROM enable_profiling()",
        f"FROM json_execute_serialized_sql(json_serialize_sql('COPY sessions TO ''{outside}/x.csv'''))",
    ]


def test_every_attack_is_refused_and_changes_no_file(project, tmp_path, capsys):
    store = Store(project)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the store's readers")
    counts = store.rows("SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM metrics)")[1]
    before, before_outside = tree(project), tree(outside)
    refused = []
    for query, kind in attacks(store.directory, outside):
        code, out, err = dew_sql(capsys, project, query)
        assert code == 1 and out == "", (query, out, err)
        assert len(err.splitlines()) == 1 and kind in err, (query, err)
        with pytest.raises(NotAQuery):
            store.sql(query)
        refused.append(kind)
    for query in reads(store.directory, outside):
        code, out, err = dew_sql(capsys, project, query)
        assert code == 1 and out == "", (query, out)
        assert "Permission Error" in err or "configuration has been locked" in err or "Only SELECT" in err, (query, err)
    assert tree(project) == before  # every byte and mtime of the store, snapshot and link
    assert tree(outside) == before_outside  # and nothing written outside it
    assert store.rows("SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM metrics)")[1] == counts
    print(f"\n{len(refused)} statements refused, {len(reads(store.directory, outside))} reads denied")


def test_queries_in_every_read_form_still_run(project, capsys):
    for query in ("SELECT count(*) AS n FROM sessions", "WITH s AS (SELECT * FROM sessions) SELECT count(*) FROM s",
                  "FROM metrics SELECT count(*)", "VALUES (1)", "DESCRIBE sessions", "SHOW TABLES",
                  "SUMMARIZE metrics", "EXPLAIN SELECT count(*) FROM sessions",
                  "EXPLAIN ANALYZE SELECT count(*) FROM sessions", "-- a comment\nSELECT 1",
                  "FROM pragma_table_info('sessions')", "SELECT current_setting('threads') AS threads"):
        code, out, err = dew_sql(capsys, project, query)
        assert code == 0, (query, err)
    code, out, _ = dew_sql(capsys, project, "SELECT current_setting('enable_external_access') AS e")
    assert "false" in out.lower()


def test_the_parser_wall_alone_is_not_what_stops_writes_outside_the_store(project, tmp_path, monkeypatch):
    """With only_queries bypassed, the connection still refuses every path outside the store's
    parts and snapshots, and every setting; inside them it cannot stop a write (docs/store.md)."""
    monkeypatch.setattr("dew_lib.store.store.only_queries", lambda query: None)
    store = Store(project)
    outside = tmp_path / "outside"
    outside.mkdir()
    fmt = os.path.join(store.directory, "format.json")
    before = tree(project)
    for query in (f"COPY (SELECT 1 AS a) TO '{fmt}'", f"COPY sessions TO '{outside}/x.csv'",
                  f"ATTACH '{outside}/e.duckdb' AS e", f"EXPORT DATABASE '{outside}/exported'",
                  f"COPY (SELECT 1) TO '{store.directory}/.locks/x.csv'", "SET enable_external_access = true",
                  "SET memory_limit = '100GB'", "SET allowed_directories = ['/']", "INSTALL httpfs",
                  "LOAD httpfs", "SET temp_directory = '/tmp'"):
        with pytest.raises(duckdb.Error, match="Permission|locked|disabled"):
            store.sql(query)
    snap = snapshot.current(store.directory)
    with pytest.raises(duckdb.Error):  # the snapshot is attached read-only already: not again for writing
        store.sql(f"ATTACH '{snap}' AS w")
    assert os.listdir(outside) == []
    assert tree(project) == before


def test_snapshots_are_read_only_files_and_writers_still_replace_and_collect_them(project, monkeypatch):
    store = Store(project)
    current = snapshot.current(store.directory)
    assert os.stat(current).st_mode & 0o777 == 0o444
    with store.writer("c", background=False, compact_after=2, keep_loose=0) as writer, writer.stage("grpo") as stage:
        for update in range(4):  # every write compacts: new generations, new snapshots
            stage.metrics(update, {"loss": 1.0})
    assert snapshot.current(store.directory) != current and not os.path.exists(current)  # collected
    assert all(os.stat(os.path.join(snapshot.directory(store.directory), n)).st_mode & 0o777 == 0o444
               for n in os.listdir(snapshot.directory(store.directory)) if n.endswith(".duckdb"))
    assert store.rows("SELECT count(*) FROM metrics WHERE run = 'c'")[1] == [(4,)]


def test_a_client_without_root_powers_cannot_open_dew_duckdb_for_writing(tmp_path):
    """The raw duckdb client on dew.duckdb: read-only works, read-write is refused by the file's
    mode (root ignores modes: docs/store.md says so). As root, the probe runs without the
    capabilities that let root ignore them (setpriv)."""
    drop = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot drop root's file powers")
        drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--inh-caps", "-all", "--"]
    project = tmp_path / "runs"
    store = Store(project)
    with store.writer("r", background=False) as writer, writer.stage("s") as stage:
        stage.metrics(0, {"loss": 1.0})
    probe = ("import duckdb, sys\n"
             "print(duckdb.connect(sys.argv[1], read_only=True).sql('SELECT count(*) FROM metrics').fetchall())\n"
             "try:\n    duckdb.connect(sys.argv[1]).sql('DROP VIEW metrics')\n    print('WROTE')\n"
             "except duckdb.Error as e:\n    print('refused', type(e).__name__)\n")
    out = subprocess.run([*drop, sys.executable, "-c", probe, str(project / "dew.duckdb")], capture_output=True,
                         text=True, cwd="/", timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[(1,)]", "refused IOException"], out.stdout
    assert Store(project).rows("SELECT count(*) FROM metrics")[1] == [(1,)]


@pytest.mark.parametrize("name", ["it's here", "x'; DROP VIEW metrics; --", "a[1]", "b*c"])
def test_a_project_under_a_quote_or_a_glob_character_is_written_and_queried_alone(tmp_path, capsys, name):
    if "*" in name:  # a project `b*c` globbed as a pattern would read `bxc` too
        neighbour = Store(tmp_path / name.replace("*", "x") / "runs")
        with neighbour.writer("n", background=False) as writer, writer.stage("s") as stage:
            stage.metrics(0, {"loss": 5.0})
    project = tmp_path / name / "runs"
    store = Store(project)
    with store.writer("r", background=False) as writer, writer.stage("s") as stage:
        stage.metrics(0, {"loss": 1.0})
    assert store.rows("SELECT count(*) FROM metrics")[1] == [(1,)]
    code, out, err = dew_sql(capsys, project, "SELECT count(*) AS n FROM metrics")
    assert code == 0 and out.splitlines()[2].strip() == "1", err
    assert duckdb.connect(str(project / "dew.duckdb"), read_only=True).sql(
        "SELECT count(*) FROM metrics").fetchall() == [(1,)]


def test_a_project_path_with_a_question_mark_is_refused_saying_why(tmp_path):
    with pytest.raises(StoreError, match="holds a '\\?', which DuckDB cannot open"):
        Store(tmp_path / "what?" / "runs")


def test_refusals_name_the_kind_the_user_wrote():
    with pytest.raises(NotAQuery, match=r"PRAGMA \(SET\) statements are refused"):
        readonly.only_queries("PRAGMA threads = 4")
    with pytest.raises(NotAQuery, match="COPY statements are refused"):
        readonly.only_queries("/* x */ COPY t TO 'f'")
    with pytest.raises(NotAQuery, match="no statement"):
        readonly.only_queries("-- nothing")
    assert readonly.only_queries("SELEC 1") is None  # DuckDB's own syntax error, where it runs
