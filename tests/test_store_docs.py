"""The run store's documentation stays true: every SQL example runs, every column is described."""

import os
import re

import numpy as np
import pytest

from dew_lib.diffusion.flow_rollout import FlowRolloutRecord
from dew_lib.records.episodes import Action, Episode, EpisodeId, EpisodeStatus, Observation, Transition
from dew_lib.records.sessions import Call, Session, Status, Task
from dew_lib.rollouts.episodes import session_of
from dew_lib.store import TABLES, Evaluation, Prompt, Store, Verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "store.md")]


def sql_examples():
    for path in DOCS:
        with open(path, encoding="utf-8") as f:
            for block in re.findall(r"```sql\n(.*?)```", f.read(), re.S):
                for statement in filter(None, (s.strip() for s in block.split(";"))):
                    yield pytest.param(statement, id=f"{os.path.basename(path)}:{statement[:40]}")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("docs"))
    with store.writer("demo-1") as run:
        run.start()
        with run.stage("sft", kind="sft") as stage:
            stage.metrics(10, {"loss": 1.5})
            stage.evaluations([Evaluation(item=0, prompt="1+1=", answer="2", score=1.0)], step=10)
        with run.stage("grpo", kind="grpo") as stage:
            call = Call(prompt_ids=[5, 6], sampled_ids=[7, 8], behavior_log_probs=[-0.5, -0.5], version=39)
            stage.prompts([Prompt(task="17", prompt="5 6", prompt_ids=[5, 6], ground_truth="2")], update=40)
            stage.sessions([Session(task="17", sample=s, calls=(call,), reward=float(s),
                                    status=Status.COMPLETED if s else Status.INFRA_ERROR) for s in range(3)],
                           update=40, latencies=[0.5, 2.0, 1.0], causes="admitted",
                           verdicts=[[], [Verdict(program=0, name="case 0", status="completed", passed=True,
                                                  score=1.0, seconds=0.05, exit_code=0)], []])
            stage.evaluations([Evaluation(item=0, prompt="1+1=", answer="3", score=0.0)], step=40,
                              verdicts=[[Verdict(program=0, name="tests", status="failed", exit_code=1,
                                                 detail="exit 1; passed 0 of 3")]])
        with run.stage("flow_grpo", kind="flow_grpo") as stage:
            rewards = np.array([0.1, 0.3, 0.2, 0.2])
            stage.samples(FlowRolloutRecord(
                step=0, images=np.zeros((4, 2, 2, 3), np.float32), group=np.array([0, 0, 1, 1]),
                rewards=rewards, group_mean=np.array([0.2, 0.2, 0.2, 0.2]),
                group_std=np.array([0.1, 0.1, 0.0, 0.0]),
                advantages=np.array([-1.0, 1.0, 0.0, 0.0], np.float32),
                kept=np.array([True, True, False, False]), captions=("",) * 4))
    with store.writer("demo-2") as run:  # an asynchronous GRPO stage: what the scheduler settled
        run.start()
        with run.stage("grpo", kind="grpo") as stage:
            for updates, version, resubmitted, cancelled, waited in (
                    (0, 0, {"infra_error": 1}, 1, 1.5), (1, 0, {"timeout": 1, "stale": 2}, 0, 0.25)):
                stage.record(dict(updates=updates, version=version, lag=updates - version, groups=1,
                                  resubmitted=resubmitted, cancelled=cancelled, abandoned=0, cut=0,
                                  waited=waited, metrics={"sessions/reused": 0.0}))
            call = Call(prompt_ids=[5, 6], sampled_ids=[7, 8], behavior_log_probs=[-0.5, -0.5], version=0)
            settled = [(0, "3", 0, 0, Status.INFRA_ERROR, "resubmitted", 0.5),
                       (0, "3", 0, 1, Status.COMPLETED, "admitted", 1.25),
                       (0, "3", 1, 0, Status.COMPLETED, "admitted", 0.75),
                       (1, "4", 0, 0, Status.COMPLETED, "discarded", 4.0),
                       (1, "4", 1, 0, Status.CANCELLED, "cancelled", 2.5)]
            for update, task, sample, attempt, status, cause, latency in settled:
                done = status is Status.COMPLETED
                stage.prompts([Prompt(task=task, prompt_ids=[5, 6], ground_truth=task)], update=update,
                              decode=lambda ids: " ".join(map(str, ids)))
                stage.sessions([Session(task=task, sample=sample, attempt=attempt, status=status,
                                        calls=(call,) if done else (), reward=1.0 if done else None)],
                               update=update, latencies=[latency], causes=cause,
                               trained=cause == "admitted")
    with store.writer("demo-3") as run:  # tool episodes: a turn per action, one tool error
        run.start()
        with run.stage("tools", kind="grpo") as stage:
            first = Observation([5, 6])
            call = Action(context=[5, 6], tokens=[7, 2], terminated=True, step=0,
                          behavior_log_probs=[-0.5, -0.5])
            answer = Action(context=[5, 6, 7, 2, 9], tokens=[8, 2], terminated=True, step=1,
                            behavior_log_probs=[-0.5, -0.5])
            episodes = [Episode(Task("1"), EpisodeId("1", 0, 0, 0, 0), EpisodeStatus.COMPLETED, "answered", first,
                                (Transition(call, Observation([5, 6, 7, 2, 9]), 0.25),
                                 Transition(answer, Observation(status="completed", detail="answered"), 0.5))),
                        Episode(Task("1"), EpisodeId("1", 0, 1, 0, 0), EpisodeStatus.ERROR, "tool error", first,
                                (Transition(call, Observation(status="error", detail="division by zero"), 1.5),))]
            stage.sessions([session_of(e, group=0, reward=1.0 if e.status is EpisodeStatus.COMPLETED else None)
                            for e in episodes], update=0, episodes=episodes)
    return store


@pytest.mark.parametrize("statement", list(sql_examples()))
def test_every_sql_example_in_the_docs_runs(store, statement):
    columns, rows = store.rows(statement)
    assert columns and rows, "the example returned nothing on a store that has what it asks for"


def test_docs_store_describes_every_column_of_every_table():
    with open(DOCS[1], encoding="utf-8") as f:
        lines = {re.match(r"\| `(\w+)` \|", line)[1]: line for line in f if re.match(r"\| `\w+` \|", line)}
    assert set(lines) == set(TABLES)
    for name, table in TABLES.items():
        missing = [c for c, _, _ in table.columns if c not in ("run", "stage") and f"`{c}`" not in lines[name]]
        assert not missing, f"docs/store.md does not describe {name}.{missing}"


def test_session_columns_hold_what_the_docs_say(store):
    rows = store.rows("SELECT sample, trained, latency, sampled_tokens FROM sessions "
                      "WHERE run = 'demo-1' ORDER BY sample")[1]
    assert rows == [(0, False, 0.5, 2), (1, True, 2.0, 2), (2, True, 1.0, 2)]
    assert np.isclose(store.rows("SELECT avg(score) FROM evaluations")[1][0][0], 0.5)


def test_the_scheduler_queries_answer_from_what_the_scheduler_recorded(store):
    causes = store.rows("SELECT cause, sum(n) FROM (SELECT unnest(map_keys(resubmitted)) AS cause, "
                        "unnest(map_values(resubmitted)) AS n FROM scheduler_records) GROUP BY ALL "
                        "ORDER BY ALL")[1]
    assert causes == [("infra_error", 1), ("stale", 2), ("timeout", 1)]
    settled = store.rows("SELECT cause, count(*), bool_or(trained) FROM sessions WHERE run = 'demo-2' "
                         "GROUP BY ALL ORDER BY ALL")[1]
    assert settled == [("admitted", 2, True), ("cancelled", 1, False), ("discarded", 1, False),
                       ("resubmitted", 1, False)]


def test_the_prompts_view_joins_sessions_by_task_once_per_task(store):
    joined = store.rows("SELECT s.run, s.task, count(*), any_value(p.prompt), any_value(p.ground_truth) "
                        "FROM sessions s JOIN prompts p USING (run, stage, task) GROUP BY ALL ORDER BY ALL")[1]
    assert joined == [("demo-1", "17", 3, "5 6", "2"), ("demo-2", "3", 3, "5 6", "3"), ("demo-2", "4", 2, "5 6", "4")]
    assert store.rows("SELECT run, task, update FROM prompts ORDER BY ALL")[1] == [
        ("demo-1", "17", 40), ("demo-2", "3", 0), ("demo-2", "4", 1)]
