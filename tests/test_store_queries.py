"""The README's run-store queries answer what they are there for, on a store written by short real
GRPO runs: a synchronous stage (SampledRollout through RecordedRollout) and an asynchronous one
(the scheduler on the native server through ScheduledRollout), both built by `build_grpo` from
one set of prompts, one of which the fake reward always fails and one of which meets a flaky
sandbox. The queries are parsed out of README.md and run exactly as written."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from dew_lib import Trainer, models
from dew_lib.data import Prompts
from dew_lib.data.loading import Loading
from dew_lib.recipes import GRPOOptions, build_grpo
from dew_lib.records.sessions import Task
from dew_lib.store import Prompt, Store

README = Path(__file__).resolve().parents[1] / "README.md"
EOS = 2
MODEL = models.build("causal_transformer", vocab_size=16, emb_features=32, num_layers=2,
                     num_heads=4, mlp_features=64, max_seq_len=16)
# Four prompts, two per batch: every prompt is drawn in updates k and k + 2 (two epochs).
PROMPTS = [([3, 4], "7"), ([5, 6, 7], "never"), ([8, 9], "flaky"), ([10, 11, 12], "7")]
STEPS = 4


def readme_query(intro: str) -> str:
    """The one SQL statement of the README block whose introducing paragraph starts with `intro`."""
    text = README.read_text(encoding="utf-8")
    found = [sql for paragraph, sql in re.findall(r"((?:^[^\n`][^\n]*\n)+)\n```sql\n(.*?)```", text, re.S | re.M)
             if paragraph.startswith(intro)]
    assert len(found) == 1, f"README.md has {len(found)} SQL blocks introduced by {intro!r}"
    statements = [s.strip() for s in found[0].split(";") if s.strip()]
    assert len(statements) == 1
    return statements[0]


def task_id(ids, truth):
    return hashlib.sha256(np.asarray(ids, np.int32).tobytes() + b"\0" + truth.encode()).hexdigest()[:16]


class Reward:
    """Fails the `never` prompt always; the `flaky` one's sandbox is down for its first `down`
    calls (a synchronous stage stops on a reward that raises, so only the asynchronous one meets
    it); otherwise a score that varies with the completion."""

    def __init__(self, down: int = 0):
        self.lock, self.flaky_calls, self.down = threading.Lock(), 0, down

    def __call__(self, data_source, completion, ground_truth, extra_info):
        if ground_truth == "never":
            return 0.0
        if ground_truth == "flaky":
            with self.lock:
                self.flaky_calls += 1
                if self.flaky_calls <= self.down:
                    raise RuntimeError("sandbox unavailable")
        return 0.25 + 0.25 * (len(completion.split()) % 4)


def data():
    records = tuple(json.dumps({"prompt": ids, "ground_truth": truth, "data_source": "toy"})
                    for ids, truth in PROMPTS)
    return Prompts(records=records, max_prompt_len=4, loading=Loading(seed=None))


def run_stage(store, run, options, variables, reward):
    with store.writer(run) as writer, writer.stage("grpo", kind="grpo") as stage:
        built = build_grpo(MODEL, variables, data(), options, reward=reward, eos_id=EOS, writer=stage)
        try:
            trainer = Trainer(built.objective, optax.adam(1e-3), key=jax.random.key(0), rollout=built.rollout)
            trainer.fit(built.dataset, steps=STEPS, log_every=1, sinks=[stage.sink()])
        finally:
            built.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("queries"))
    common = dict(steps=STEPS, batch=2, groups=2, max_new_tokens=4, temperature=1.0, beta=0.0)
    variables = jax.jit(MODEL.init)(jax.random.key(1), np.zeros((1, 8), np.int32))
    run_stage(store, "sync-1", GRPOOptions(**common, mode="sync"), variables, Reward())
    run_stage(store, "async-1", GRPOOptions(**common, mode="async", slots=4, max_attempts=3), variables,
              Reward(down=2))
    return store


def rows(store, query):
    columns, found = store.rows(query)
    return [dict(zip(columns, row, strict=True)) for row in found]


@pytest.mark.slow
def test_both_paths_name_sessions_by_the_datasets_task_and_record_each_prompt_once(store):
    ids = {task_id(ids, truth): (ids, truth) for ids, truth in PROMPTS}
    for run in ("sync-1", "async-1"):
        tasks = rows(store, f"SELECT task, count(DISTINCT update) AS updates FROM sessions WHERE run = '{run}' "
                            "AND trained GROUP BY task ORDER BY task")
        assert {t["task"] for t in tasks} == set(ids), run
        assert {t["updates"] for t in tasks} == {2}, run  # two epochs, one task each
        prompts = rows(store, f"SELECT task, prompt, prompt_ids, prompt_tokens, ground_truth, data_source "
                              f"FROM prompts WHERE run = '{run}' ORDER BY task")
        assert [p["task"] for p in prompts] == sorted(ids), run  # once per task, not per epoch
        for p in prompts:
            expected, truth = ids[p["task"]]
            assert p["prompt_ids"] == expected and p["prompt_tokens"] == len(expected)
            assert p["prompt"] == " ".join(map(str, expected))  # the stage's decode: token-id text
            assert (p["ground_truth"], p["data_source"]) == (truth, "toy")
    synced = rows(store, "SELECT update, task, group_id FROM sessions WHERE run = 'sync-1' AND sample = 0 "
                         "ORDER BY update, group_id")
    assert [(s["update"], s["group_id"]) for s in synced] == [(u, g) for u in range(STEPS) for g in range(2)]
    assert [s["task"] for s in synced[:4]] == [s["task"] for s in synced[4:]]  # epoch 2 = epoch 1


@pytest.mark.slow
def test_the_worst_prompt_is_the_one_the_reward_always_fails(store):
    worst = rows(store, readme_query("The worst prompts"))
    assert len(worst) == 2 * len(PROMPTS)
    never = task_id([5, 6, 7], "never")
    assert {(w["run"], w["task"]) for w in worst[:2]} == {("sync-1", never), ("async-1", never)}
    for w in worst[:2]:
        assert w["reward"] == 0.0 and w["sessions"] == 4  # 2 samples in each of 2 epochs
        assert (w["prompt"], w["ground_truth"]) == ("5 6 7", "never")
    assert all(w["reward"] >= 0.25 and w["prompt"] for w in worst[2:])


@pytest.mark.slow
def test_reward_per_update_matches_what_the_trainer_logged(store):
    updates = rows(store, readme_query("Reward per update"))
    assert [(u["run"], u["update"]) for u in updates] == [(r, k) for r in ("async-1", "sync-1")
                                                          for k in range(STEPS)]
    assert all(u["sessions"] == 4 and u["prompts"] == 2 for u in updates)
    logged = dict(store.rows("SELECT step, value FROM metrics WHERE run = 'sync-1' AND name = 'reward'")[1])
    for u in updates:
        assert u["lowest"] <= u["reward"] <= u["highest"]
        if u["run"] == "sync-1":  # the trainer's mean reward of the update's batch, logged at its step
            assert u["reward"] == pytest.approx(logged[u["update"] + 1], abs=1e-6)
        assert (u["lowest"] == 0.0) == (u["update"] % 2 == 0)  # even updates drew the failing prompt


@pytest.mark.slow
def test_tool_errors_by_cause_show_the_flaky_sandbox(store):
    errors = rows(store, readme_query("Tool errors by cause"))
    assert errors, "the asynchronous stage recorded no infra error"
    assert {(e["run"], e["status"], e["cause"]) for e in errors} == {("async-1", "infra_error", "resubmitted")}
    assert sum(e["sessions"] for e in errors) == 2
    assert errors[0]["detail"] == "reward failed: RuntimeError: sandbox unavailable"
    assert errors[0]["tasks"] == 1
    flaky = task_id([8, 9], "flaky")
    assert rows(store, "SELECT DISTINCT task FROM sessions WHERE status = 'infra_error'") == [{"task": flaky}]


def test_a_retry_records_a_prompt_again_and_the_view_keeps_one_row(tmp_path):
    store = Store(tmp_path)
    task = Task("t1", {"prompt_ids": np.array([5, 6], np.int32), "data_source": "toy", "ground_truth": "4",
                       "extra_info": ""})
    for attempt, update in ((1, 3), (2, 1)):  # the retry meets the task at an earlier update
        with store.writer("r") as run, run.stage("grpo") as stage:
            def decode(ids, attempt=attempt):
                return f"attempt {attempt}"

            assert stage.prompts([task, task], update=update, decode=decode) == 1
            assert stage.prompts([task], update=update + 1) == 0 and stage.has_prompt("t1")
            stage.prompts([Prompt(task="t2", prompt="2+2=")], update=update)
    found = rows(store, "SELECT task, update, prompt, prompt_ids FROM prompts ORDER BY task")
    assert found == [{"task": "t1", "update": 1, "prompt": "attempt 2", "prompt_ids": [5, 6]},
                     {"task": "t2", "update": 1, "prompt": "2+2=", "prompt_ids": None}]
    assert store.rows("SELECT count(*) FROM read_parquet(?)",
                      [str(tmp_path / "store" / "prompts" / "r" / "grpo" / "*.parquet")])[1] == [(4,)]


def test_prompts_are_checked_on_the_callers_thread(tmp_path):
    with Store(tmp_path).writer("r") as run, run.stage("grpo") as stage:
        with pytest.raises(TypeError, match="takes Prompt or Task records, got dict"):
            stage.prompts([{"task": "a"}], update=0)
        with pytest.raises(ValueError, match="negative token id"):
            stage.prompts([Prompt(task="a", prompt_ids=[-1])], update=0)
        with pytest.raises(TypeError, match="decode returned int"):
            stage.prompts([Prompt(task="a", prompt_ids=[1])], update=0, decode=len)
        assert not stage.has_prompt("a")  # nothing was recorded by the refused calls
        assert stage.prompts([Prompt(task="a", prompt_ids=[1])], update=0, decode=str) == 1


def test_a_store_written_before_the_prompts_table_loads_with_it_empty(tmp_path, monkeypatch):
    from dew_lib.records.sessions import Call, Session
    from dew_lib.store import TABLES

    call = Call(prompt_ids=[5, 6], sampled_ids=[7], behavior_log_probs=[-0.5])
    with monkeypatch.context() as older:  # the store as a Dew without the table wrote it
        older.delitem(TABLES, "prompts")
        with Store(tmp_path).writer("old") as run, run.stage("grpo") as stage:
            stage.sessions([Session(task="0", calls=(call,), reward=1.0)], update=0)
        assert not (tmp_path / "store" / "prompts").exists()
    store = Store(tmp_path)
    assert store.rows("SELECT (SELECT count(*) FROM sessions), (SELECT count(*) FROM prompts)")[1] == [(1, 0)]
    assert rows(store, readme_query("The worst prompts")) == [
        {"run": "old", "stage": "grpo", "task": "0", "reward": 1.0, "sessions": 1, "prompt": None,
         "ground_truth": None}]
    with store.writer("new") as run, run.stage("grpo") as stage:
        stage.prompts([Prompt(task="0", prompt="5 6")], update=0)
    assert store.rows("SELECT run, prompt FROM prompts")[1] == [("new", "5 6")]
