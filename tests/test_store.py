"""The run store in one process: every table, round trips, retries, compaction, bad input.

Real processes (a reader while a writer writes, SIGKILL, two runs at once) are in
test_store_processes.py; the `dew` command in test_cli.py.
"""

import contextlib
import json
import os
import threading
import time

import duckdb
import jax
import numpy as np
import optax
import pytest
from conftest import lm_batches, tiny_model

from dew_lib import Dataset, LMObjective, Trainer
from dew_lib.diffusion.flow_rollout import FlowRolloutRecord
from dew_lib.records.sessions import Call, Session, Status
from dew_lib.store import Evaluation, Store, StoreBusy, StoreError, StoreNotFound, Verdict, session_uid
from dew_lib.store.parts import Stream, announced_swap, swap_count, swaps_since


def call(seed, prompt=4, sampled=3, version=0, **extra):
    rng = np.random.default_rng(seed)
    return Call(prompt_ids=rng.integers(1, 50, prompt), sampled_ids=rng.integers(1, 50, sampled),
                behavior_log_probs=-rng.random(sampled), version=version, **extra)


def group(update, task="t", samples=4, status=Status.COMPLETED):
    return [Session(task=task, group=0, sample=s, calls=(call(update * 10 + s, version=update),),
                    status=status, reward=float(s % 2), components={"format": 1.0}) for s in range(samples)]


def count(store, sql, *params):
    return store.sql(sql, list(params)).column(0).to_pylist()


def test_sessions_and_calls_round_trip_exactly(tmp_path):
    rng = np.random.default_rng(0)
    first = call(1, prompt=5, sampled=4, version=3, raw_log_probs=-rng.random(4), finish_reason="length")
    second = Call(prompt_ids=np.concatenate([first.prompt_ids, first.sampled_ids, [7, 8]]),
                  sampled_ids=[9, 2], behavior_log_probs=[-0.5, -0.25], version=4,
                  routed_experts=rng.integers(0, 8, (13, 2, 2)).astype(np.int16),
                  support=[np.array([9, 1]), np.array([2])])
    sessions = [
        Session(task="17", group=2, sample=1, attempt=1, calls=(first, second), reward=0.75,
                components={"format": 1.0, "answer": 0.5}, detail="two turns"),
        Session(task="17", group=2, sample=2, calls=(call(2),), status=Status.INFRA_ERROR, detail="engine down"),
        Session(task="18", group=3, sample=0, calls=(), status=Status.CANCELLED),
    ]
    store = Store(tmp_path)
    with store.writer("run-a") as run, run.stage("grpo", kind="grpo") as stage:
        stage.sessions(sessions, update=40, latencies=[1.5, 0.25, None], causes="admitted")
    back = store.read_sessions("run-a", "grpo")
    assert [b.update for b in back] == [40, 40, 40]
    assert [b.trained for b in back] == [True, False, False]  # trained=None: what pack trains on
    assert [b.latency for b in back] == [1.5, 0.25, None]
    for original, (_, restored, _, cause, _) in zip(sessions, back, strict=True):
        assert cause == "admitted"
        for field in ("task", "group", "sample", "attempt", "status", "reward", "detail"):
            assert getattr(restored, field) == getattr(original, field), field
        assert dict(restored.components) == dict(original.components)
        assert len(restored.calls) == len(original.calls)
        for a, b in zip(original.calls, restored.calls, strict=True):
            for field in ("prompt_ids", "sampled_ids", "behavior_log_probs", "raw_log_probs", "routed_experts"):
                x, y = getattr(a, field), getattr(b, field)
                assert (x is None) == (y is None), field
                if x is not None:
                    np.testing.assert_array_equal(x, y)
                    assert x.dtype == y.dtype, field
            assert (a.finish_reason, a.version) == (b.finish_reason, b.version)
            assert (a.support is None) == (b.support is None)
            for x, y in zip(a.support or (), b.support or (), strict=True):
                np.testing.assert_array_equal(x, y)
    columns, rows = store.rows("SELECT num_calls, prompt_tokens, sampled_tokens, min_version, max_version, "
                               "finish_reason, status FROM sessions ORDER BY task, sample")
    assert rows == [(2, 5, 6, 3, 4, "stop", "completed"), (1, 4, 3, 0, 0, "stop", "infra_error"),
                    (0, 0, 0, None, None, None, "cancelled")]
    uid = session_uid("run-a", "grpo", 40, "17", 2, 1, 1, True)
    assert count(store, "SELECT count(*) FROM calls WHERE session_uid = ?", uid) == [2]


def test_trained_flags_follow_truncation_or_are_given(tmp_path):
    sessions = group(0, samples=2, status=Status.TRUNCATED)
    store = Store(tmp_path)
    with store.writer("r") as run, run.stage("grpo") as stage:
        stage.sessions(sessions, update=0)                       # truncation="mask": not trained
        stage.sessions(sessions, update=1, truncation="score")   # trained
        stage.sessions(sessions, update=2, trained=[True, False])
    assert count(store, "SELECT count(*) FILTER (trained) FROM sessions GROUP BY update ORDER BY update") == [0, 2, 1]


def test_every_table_lands_and_dew_duckdb_opens_in_the_duckdb_client(tmp_path):
    store = Store(tmp_path)
    model = tiny_model()
    trainer = Trainer(LMObjective(model, seq_len=8, ema_decay=None), optax.sgd(0.1), key=jax.random.key(0))
    data = Dataset(train=lambda partition: lm_batches(0, 4, 9), batch=4)
    with store.writer("run-1") as run:
        run.start(params={"lr": 0.1, "steps": 4}, code_version="test")
        with run.stage("sft", kind="sft") as stage:
            trainer.fit(data, steps=4, log_every=2, directory=str(tmp_path / "ckpt"), checkpoint_every=2,
                        sinks=[stage.sink()])
            stage.evaluations([Evaluation(item=i, prompt=f"{i}+1=", answer=str(i + 1 - i % 2), reference=str(i + 1),
                                          score=float(i % 2 == 0), correct=i % 2 == 0) for i in range(4)], step=4)
        with run.stage("grpo", kind="grpo") as stage:
            sessions = group(5)
            stage.sessions(sessions, update=5, latencies=[0.1, 0.2, 0.3, 0.4], causes="admitted")
            stage.record({"updates": 5, "version": 4, "lag": 1, "groups": 1, "resubmitted": {"timeout": 2},
                          "cancelled": 1, "abandoned": 0, "cut": 0, "waited": 0.5, "metrics": {"reward/mean": 0.5}})
            stage.verdicts(sessions[0], [Verdict(program=0, name="test_add", status="passed", passed=True,
                                                 seconds=0.01, exit_code=0)], update=5)
        with run.stage("flow_grpo", kind="flow_grpo") as stage:
            stage.samples(FlowRolloutRecord(
                step=2, images=np.zeros((2, 1, 1, 3), np.float32), group=np.zeros(2, int),
                rewards=np.array([0.0, 1.0]), group_mean=np.full(2, 0.5), group_std=np.full(2, 0.5),
                advantages=np.array([-1.0, 1.0], np.float32), kept=np.ones(2, bool), captions=("", "")))
        run.finish("completed")
    database = duckdb.connect(str(tmp_path / "dew.duckdb"), read_only=True)
    views = {row[0] for row in database.sql("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    assert views == {"runs", "stages", "sessions", "calls", "prompts", "turns", "verdicts", "scheduler_records",
                     "metrics", "evaluations", "samples", "checkpoints", "trackers"}
    counts = {v: database.sql(f"SELECT count(*) FROM {v}").fetchall()[0][0] for v in sorted(views)}
    assert counts["runs"] == 1 and counts["stages"] == 3 and counts["sessions"] == 4 and counts["calls"] == 4
    assert counts["samples"] == 2
    assert counts["verdicts"] == 1 and counts["scheduler_records"] == 1 and counts["evaluations"] == 4
    assert database.sql("SELECT DISTINCT step FROM metrics ORDER BY step").fetchall() == [(2,), (4,)]
    assert database.sql("SELECT step, path FROM checkpoints ORDER BY step").fetchall() == [
        (2, str(tmp_path / "ckpt" / "2")), (4, str(tmp_path / "ckpt" / "4"))]
    assert database.sql("SELECT resubmitted['timeout'], metrics['reward/mean'] FROM scheduler_records"
                        ).fetchall() == [(2, 0.5)]
    assert database.sql("SELECT status, attempts, params, code_version FROM runs").fetchall() == [
        ("completed", 1, '{"lr": 0.1, "steps": 4}', "test")]
    database.close()
    columns, rows = store.runs()
    summary = {row[columns.index("stage")]: dict(zip(columns, row)) for row in rows}
    assert summary["sft"]["stage_status"] == "completed" and summary["sft"]["steps"] == 4
    assert summary["sft"]["accuracy"] == 0.5 and summary["sft"]["loss"] is not None
    assert summary["grpo"]["status"] == "completed"


def test_a_retry_replaces_what_the_failed_attempt_wrote_at_the_same_steps(tmp_path):
    store = Store(tmp_path)
    compaction = dict(compact_after=3, keep_loose=1, merge_after=2)  # rewritten steps sit in compacted parts
    with store.writer("r", **compaction) as run:
        stage = run.stage("grpo")
        for update in range(6):
            stage.sessions(group(update), update=update, causes="admitted")
            stage.metrics(update, {"loss": 1.0})
        stage.sessions(group(5, task="late"), update=5, trained=False, causes="pending")  # a second part at 5
        stage.close()  # the attempt dies here: no finish
    with store.writer("r", **compaction) as run:
        stage = run.stage("grpo")
        for update in range(3, 8):  # the retry resumes after step 3's checkpoint... and redoes 3 onwards
            stage.sessions(group(update, samples=2), update=update, causes="admitted")
            stage.metrics(update, {"loss": 2.0})
        stage.finish()
    per_update = store.rows("SELECT update, count(*), sum(value) FROM sessions JOIN "
                            "(SELECT step AS update, value FROM metrics) USING (update) "
                            "GROUP BY update ORDER BY update")[1]
    assert per_update == [(0, 4, 4.0), (1, 4, 4.0), (2, 4, 4.0), (3, 2, 4.0), (4, 2, 4.0), (5, 2, 4.0),
                          (6, 2, 4.0), (7, 2, 4.0)]
    assert count(store, "SELECT attempt FROM stages") == [2]
    files = os.listdir(os.path.realpath(tmp_path / "store" / "sessions" / "r" / "grpo"))
    assert len(files) == 1  # finish compacts the stage into one part


def test_discard_after_drops_the_failed_attempts_later_steps(tmp_path):
    store = Store(tmp_path)
    with store.writer("r", compact_after=2, keep_loose=0) as run:
        stage = run.stage("sft")
        for step in range(1, 9):
            stage.metrics(step, {"loss": float(step)})
        stage.close()
    with store.writer("r") as run, run.stage("sft") as stage:
        stage.discard_after(4)
        stage.metrics(5, {"loss": 50.0})
    assert store.rows("SELECT step, value FROM metrics ORDER BY step")[1] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]


def test_compaction_bounds_the_parts_and_keeps_every_row(tmp_path):
    store = Store(tmp_path)
    with store.writer("r", compact_after=4, keep_loose=2, merge_after=3) as run:
        stage = run.stage("sft")
        for step in range(60):
            stage.metrics(step, {"loss": float(step), "accuracy": 0.5})
        stage.flush()
        files = os.listdir(os.path.realpath(tmp_path / "store" / "metrics" / "r" / "sft"))
        assert len(files) <= 4 + 3 * 3, files  # loose parts plus at most merge_after - 1 per size tier
        assert count(store, "SELECT count(*) FROM metrics") == [120]
        assert count(store, "SELECT sum(value) FROM metrics WHERE name = 'loss'") == [float(sum(range(60)))]
        stage.finish()
    assert len(os.listdir(os.path.realpath(tmp_path / "store" / "metrics" / "r" / "sft"))) == 1
    assert count(store, "SELECT count(DISTINCT step) FROM metrics") == [60]


def test_a_killed_writers_leftovers_are_cleared_on_open(tmp_path):
    store = Store(tmp_path)
    store.create()
    stream = Stream(store.directory, "metrics", "r", "sft", "step")
    from dew_lib.store.rows import metrics_table, now

    stream.write(1, metrics_table({"loss": 1.0}, run="r", stage="sft", step=1, when=now()))
    home = os.path.dirname(stream.gen)
    os.makedirs(os.path.join(home, "g000099"))  # a swap that died before moving the link
    with open(os.path.join(home, "g000099", "000000000001-0000.parquet"), "wb") as f:
        f.write(b"garbage")
    with open(os.path.join(stream.tmp, "half.tmp"), "wb") as f:
        f.write(b"half a part")
    reopened = Stream(store.directory, "metrics", "r", "sft", "step")
    assert sorted(os.listdir(home)) == ["g000001", "tmp"] and os.listdir(reopened.tmp) == []
    assert count(store, "SELECT value FROM metrics") == [1.0]


def test_untrained_sessions_are_the_pending_ones_nothing_consumed(tmp_path):
    store = Store(tmp_path)
    pending = group(3, task="a") + group(3, task="b")
    with store.writer("r") as run, run.stage("grpo") as stage:
        stage.sessions(pending, update=3, trained=False, causes="pending")
        stage.sessions(pending[:4], update=4, causes="admitted")  # task a's group trained at 4
        stage.sessions(pending[4:5], update=4, trained=False, causes="discarded")
    left = store.untrained_sessions("r", "grpo")
    assert [(s.session.task, s.session.sample) for s in left] == [("b", 1), ("b", 2), ("b", 3)]
    np.testing.assert_array_equal(left[0].session.calls[0].sampled_ids, pending[5].calls[0].sampled_ids)


def test_one_writer_per_stage_and_runs_show_interrupted_writers(tmp_path):
    store = Store(tmp_path)
    run = store.writer("r")
    run.start()
    stage = run.stage("sft")
    with pytest.raises(StoreBusy, match="stage 'sft' of run 'r' is being written"):
        run.stage("sft")
    other = store.writer("r")  # a second writer of the same run may open other stages
    other.stage("dpo").close()
    other.close()
    columns, rows = store.runs()
    assert {(r[columns.index("status")], r[columns.index("stage")], r[columns.index("stage_status")])
            for r in rows} == {("running", "sft", "running"), ("running", "dpo", "interrupted")}
    stage.close()
    run.close()
    columns, rows = store.runs()
    assert {r[columns.index("status")] for r in rows} == {"interrupted"}
    assert {r[columns.index("stage_status")] for r in rows} == {"interrupted"}


def test_a_stage_that_raises_is_marked_failed_with_its_error(tmp_path):
    store = Store(tmp_path)
    with store.writer("r") as run:
        with pytest.raises(RuntimeError), run.stage("sft"):
            raise RuntimeError("out of data")
    assert store.rows("SELECT status, error FROM stages")[1] == [("failed", "RuntimeError: out of data")]


def test_bad_input_is_refused_with_the_field_and_the_fix(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(ValueError, match="run '../x' is not a valid name"):
        store.writer("../x")
    with store.writer("r") as run, run.stage("grpo") as stage:
        with pytest.raises(ValueError, match="update must be >= 0"):
            stage.sessions(group(0), update=-1)
        with pytest.raises(ValueError, match="latencies has 1 entries for 4 sessions"):
            stage.sessions(group(0), update=0, latencies=[1.0])
        with pytest.raises(ValueError, match="cause must be one of"):
            stage.sessions(group(0), update=0, causes="lost")
        with pytest.raises(ValueError, match="scheduler record lacks"):
            stage.record({"updates": 1})
        with pytest.raises(ValueError, match="status must be one of"):
            stage.finish("done")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="cannot create the run store"):
        Store(blocker / "runs").writer("r")
    with pytest.raises(StoreNotFound, match="no run store at"):
        Store(tmp_path / "nowhere").sql("SELECT 1")


def test_a_write_that_fails_on_the_writer_thread_is_raised_by_the_next_call(tmp_path):
    store = Store(tmp_path)
    run = store.writer("r")
    stage = run.stage("grpo")
    stage.sessions([object()], update=0, trained=True)  # not a Session: fails on the thread
    with pytest.raises(StoreError, match="writing to the run store failed"):
        stage.flush()
    with pytest.raises(StoreError):
        stage.metrics(1, {"loss": 1.0})
    with pytest.raises(StoreError):
        run.close()


def test_a_query_knows_when_a_generation_swap_overlapped_it(tmp_path):
    store = Store(tmp_path)
    run = store.writer("r", background=False, compact_after=2, keep_loose=0)
    stage = run.stage("sft")
    stage.metrics(0, {"a": 1.0})
    before = swap_count(store.directory)
    assert not swaps_since(store.directory, before)
    stage.metrics(1, {"a": 1.0})  # the second loose part: folded, one swap
    assert swap_count(store.directory) == before + 1 and swaps_since(store.directory, before)
    with announced_swap(store.directory):  # a swap in flight has not counted itself yet
        assert swaps_since(store.directory, before + 1)
    run.close()


def test_queries_during_constant_compaction_see_whole_steps_only(tmp_path):
    store = Store(tmp_path)
    run = store.writer("r", background=False, compact_after=2, keep_loose=0, merge_after=2)
    stage = run.stage("sft")
    stop = threading.Event()

    def write():
        step = 0
        while not stop.is_set():
            stage.metrics(step, {"a": 1.0, "b": 2.0})  # every write swaps a generation
            step += 1

    writer = threading.Thread(target=write)
    writer.start()
    totals = []
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            rows = store.rows("SELECT step, count(*), sum(value) FROM metrics GROUP BY step")[1]
            assert all(n == 2 and total == 3.0 for _, n, total in rows), rows
            totals.append(len(rows))
    finally:
        stop.set()
        writer.join()
        run.close()
    assert totals == sorted(totals) and totals[-1] > totals[0]


def test_a_table_stays_queryable_before_its_first_part_and_after_its_last(tmp_path):
    store = Store(tmp_path)
    store.create()
    assert count(store, "SELECT count(*) FROM metrics") == [0]  # a zero-row placeholder part
    with store.writer("r") as run:
        stage = run.stage("sft")
        stage.metrics(3, {"loss": 1.0})
        stage.flush()
        assert not (tmp_path / "store" / "metrics" / "_" / "_" / "schema.parquet").exists()
        stage.close()
    with store.writer("r") as run, run.stage("sft") as stage:
        stage.discard_after(0)  # the only part of the table goes
    assert count(store, "SELECT count(*) FROM metrics") == [0]


def test_a_prompt_given_as_messages_is_stored_as_json(tmp_path):
    store = Store(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2= ünd"}]
    with store.writer("r") as run, run.stage("eval") as stage:
        stage.evaluations([Evaluation(item=0, prompt=messages, answer="4", score=1.0),
                           Evaluation(item=1, prompt={"question": "1+1="}, answer="2", score=1.0),
                           Evaluation(item=2, prompt=np.array([5, 6]), answer="3", score=0.0),
                           Evaluation(item=3, prompt="3+3=", answer="6", score=1.0)], step=0)
    stored = count(store, "SELECT prompt FROM evaluations ORDER BY item")
    assert [json.loads(p) for p in stored[:3]] == [messages, {"question": "1+1="}, [5, 6]]
    assert stored[3] == "3+3="  # text stays text
    assert store.rows("SELECT prompt->>'$[1].content' FROM evaluations WHERE item = 0")[1] == [("2+2= ünd",)]


@contextlib.contextmanager
def read_only(path, monkeypatch):
    """Make the tree under `path` unwritable: permissions, or (as root, whom they do not stop) an
    os.open and os.mkdir that refuse writes there."""
    if os.geteuid() != 0:
        modes = {}
        for root, dirs, _ in os.walk(path):
            for d in [root, *(os.path.join(root, d) for d in dirs)]:
                modes[d] = os.stat(d).st_mode
                os.chmod(d, modes[d] & ~0o222)
        try:
            yield
        finally:
            for d, mode in modes.items():
                os.chmod(d, mode)
        return
    inside = str(path)
    real_open, real_mkdir = os.open, os.mkdir
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT

    def guarded_open(file, flags, *args, **kwargs):
        if flags & writes and os.fspath(file).startswith(inside):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, flags, *args, **kwargs)

    def guarded_mkdir(file, *args, **kwargs):
        if os.fspath(file).startswith(inside):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_mkdir(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", guarded_open)
        patch.setattr(os, "mkdir", guarded_mkdir)
        yield


def test_a_read_only_store_is_read_and_refuses_writers_with_a_store_error(tmp_path, monkeypatch):
    store = Store(tmp_path)
    with store.writer("r") as run, run.stage("sft") as stage:
        stage.metrics(1, {"loss": 1.0})
    with read_only(tmp_path, monkeypatch):
        assert Store(tmp_path).rows("SELECT count(*) FROM metrics")[1] == [(1,)]
        with pytest.raises(StoreError, match=f"cannot write the run store at {store.directory}: .*writable"):
            Store(tmp_path).writer("r")
    os.remove(tmp_path / "dew.duckdb")  # no snapshot to read, and none can be published: the links
    with read_only(tmp_path, monkeypatch):
        assert Store(tmp_path).rows("SELECT count(*) FROM metrics")[1] == [(1,)]
    with pytest.raises(StoreError, match="cannot create the run store at"), read_only(tmp_path, monkeypatch):
        Store(tmp_path / "inner" / "runs").writer("r")
