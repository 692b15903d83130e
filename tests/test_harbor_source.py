"""HarborSource over real HTTP on 127.0.0.1: trials whose harness chats with `dew serve` through a
recording gateway, and asynchronous GRPO trained on them with every update pushed.

The engine is `dew serve` on the tiny Qwen3 fixture (its chat template); the gateway is the
stand-in in standin_gateway.py (rllm-model-gateway's session, trace and admin routes at 9beb6e0f);
`harbor trials start` is the stand-in in standin_harbor.py (Harbor's flags and TrialResult, its
harness the real `openai` client). Harbor and the real gateway are not installable here (Harbor
needs Python 3.12 and a container runtime).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import jax
import numpy as np
import optax
import pytest
from fastapi import FastAPI
from standin_gateway import Recorder, gateway_router

from dew_lib import Dataset, Trainer
from dew_lib.inference.gateway import Gateway
from dew_lib.inference.publish import Publication, SafetensorsReload
from dew_lib.models.pretrained import load_pretrained
from dew_lib.objectives import GRPOObjective
from dew_lib.records.sessions import Status, Task
from dew_lib.rollouts import Harbor, HarborSource, RolloutScheduler, task_ids
from dew_lib.rollouts.harbor import BASE_URL_VARIABLES, session_name, trace_calls, trial_outcome
from dew_lib.sampling import Sampling
from dew_lib.serve import ServedPolicy, create_app, running

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "hf", "qwen3")
STANDIN = (sys.executable, os.path.join(HERE, "standin_harbor.py"))
MODEL = "policy"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`dew serve` on a copy of the fixture, and the recording gateway in front of it."""
    launch = tmp_path_factory.mktemp("engine") / "policy"
    shutil.copytree(FIXTURE, launch)
    policy = ServedPolicy.load(launch, slots=8, capacity=64, sampling=Sampling(temperature=1.0), steps=4,
                               served_model_name=MODEL)
    try:
        with running(create_app(policy, dev_endpoints=True)) as engine:
            recorder = Recorder(engine, MODEL)
            gateway_app = FastAPI()
            gateway_app.include_router(gateway_router(recorder))
            with running(gateway_app) as gateway:
                yield {"engine": engine, "gateway": gateway, "recorder": recorder, "policy": policy,
                       "launch": launch}
    finally:
        policy.close()


def task_directory(root, name, mode=""):
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "instruction.md").write_text("hello world")
    if mode:
        (directory / "mode").write_text(mode)
    return directory


def source(served, tmp_path, **harbor):
    gateway = Gateway(served["gateway"])
    gateway.stamp(0)
    return HarborSource(gateway, harbor=Harbor(command=STANDIN, agent="chatter", **harbor), model=MODEL,
                        trials=tmp_path / "trials", workers=4)


def test_a_trial_is_one_session_of_the_calls_its_harness_made(served, tmp_path):
    directory = task_directory(tmp_path, "greet")
    recorder = served["recorder"]
    with source(served, tmp_path, agent_kwargs={"turns": 2}, environment="docker") as harbor:
        harbor.gateway.stamp(3)
        session = harbor.submit(Task("greet", {"path": str(directory)}), group=1, sample=2, attempt=0,
                                seed=0).result(timeout=120)

    assert (session.task, session.group, session.sample, session.attempt) == ("greet", 1, 2, 0)
    assert session.status is Status.COMPLETED and session.detail == ""
    (trial,) = [path for path in (tmp_path / "trials").iterdir() if path.is_dir()]
    result = json.loads((trial / "result.json").read_text())
    assert session.reward == result["verifier_result"]["rewards"]["reward"]
    assert session.components == {"reward": session.reward}
    # The harness got the session's URL under every base-URL name, and Harbor the flags given.
    config = json.loads((trial / "config.json").read_text())
    assert config["agent_env"] == {name: f"{served['gateway']}/sessions/{trial.name}/v1" for name in BASE_URL_VARIABLES}
    assert (config["agent"], config["model"], config["environment"], config["agent_kwargs"]) == (
        "chatter", MODEL, "docker", {"turns": "2"})
    # Two calls, each exactly what the gateway recorded, stamped with the version it held.
    assert trial.name in recorder.deleted  # read, then removed from the gateway
    assert len(session.calls) == 2 and all(call.version == 3 for call in session.calls)
    for call in session.calls:
        assert call.prompt_ids.size > 0 and call.sampled_ids.size == call.behavior_log_probs.size > 0
        assert call.raw_log_probs is None and np.all(call.behavior_log_probs <= 0)
    assert session.calls[1].prompt_ids.size > session.calls[0].prompt_ids.size  # the conversation grew


def test_each_way_a_trial_ends_has_its_status(served, tmp_path):
    tasks = {mode: task_directory(tmp_path, mode, mode) for mode in ("timeout", "crash", "unscored", "silent")}
    with source(served, tmp_path) as harbor:
        futures = {mode: harbor.submit(Task(mode, {"path": str(path)}), group=0, sample=0, attempt=1, seed=0)
                   for mode, path in tasks.items()}
        sessions = {mode: future.result(timeout=120) for mode, future in futures.items()}

    timeout = sessions["timeout"]  # the verifier scored what the harness left: it trains
    assert timeout.status is Status.TRUNCATED and timeout.reward in (0.0, 1.0) and len(timeout.calls) == 1
    assert timeout.detail.startswith("AgentTimeoutError")
    crash = sessions["crash"]  # never scored: the scheduler submits it again
    assert crash.status is Status.INFRA_ERROR and crash.reward is None
    assert "wrote no" in crash.detail and "exit status 1" in crash.detail and "the harness crashed" in crash.detail
    unscored = sessions["unscored"]
    assert unscored.status is Status.INFRA_ERROR and unscored.reward is None
    assert "gave no rewards" in unscored.detail and "RuntimeError: unscored after one call" in unscored.detail
    silent = sessions["silent"]  # scored, but nothing reached the model: nothing to train on
    assert silent.status is Status.INFRA_ERROR and silent.calls == () and "no call reached" in silent.detail


def test_cancel_ends_the_trial_process(served, tmp_path):
    directory = task_directory(tmp_path, "slow", "sleep")
    with source(served, tmp_path, stop_grace=5.0) as harbor:
        future = harbor.submit(Task("slow", {"path": str(directory)}), group=0, sample=0, attempt=0, seed=0)
        deadline = time.monotonic() + 60
        while not list((tmp_path / "trials").glob("*/config.json")):
            assert time.monotonic() < deadline, "the trial never started"
            time.sleep(0.05)
        (trial,) = harbor._live.values()
        pid = trial.process.pid
        started = time.monotonic()
        harbor.cancel(future)
        session = future.result(timeout=30)
    assert session.status is Status.CANCELLED and session.calls == ()
    assert time.monotonic() - started < 10  # SIGTERM ended it, not its 120 s sleep
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_gateway_without_versions_stops_the_batch_instead_of_guessing(served, tmp_path):
    directory = task_directory(tmp_path, "greet")
    served["recorder"].drop_versions = True
    try:
        with source(served, tmp_path) as harbor:
            future = harbor.submit(Task("greet", {"path": str(directory)}), group=0, sample=0, attempt=0, seed=0)
            with pytest.raises(ValueError, match="weight_version None.*f83139a1"):
                future.result(timeout=120)
    finally:
        served["recorder"].drop_versions = False


def test_trial_results_and_traces_are_read_strictly(tmp_path):
    def outcome(result):
        (tmp_path / "t").mkdir(exist_ok=True)
        (tmp_path / "t" / "result.json").write_text(json.dumps(result))
        return trial_outcome(tmp_path / "t", "exit status 0")

    assert outcome({"verifier_result": {"rewards": {"reward": 1, "style": 0.5}}}) == (
        Status.COMPLETED, 1.0, {"reward": 1.0, "style": 0.5}, "")
    assert outcome({"verifier_result": {"rewards": {"passed": 0.25}}})[:2] == (Status.COMPLETED, 0.25)
    crashed = outcome({"verifier_result": {"rewards": {"reward": 0}},
                       "exception_info": {"exception_type": "KeyError", "exception_message": "x"}})
    assert crashed == (Status.AGENT_ERROR, 0.0, {"reward": 0.0}, "KeyError: x")
    status, reward, _, detail = outcome({"verifier_result": {"rewards": {"a": 1, "b": 0}}})
    assert (status, reward) == (Status.INFRA_ERROR, None) and "none is named 'reward'" in detail
    assert outcome({"verifier_result": {"rewards": {"reward": float("nan")}}})[0] is Status.INFRA_ERROR
    assert outcome([1, 2])[0] is Status.INFRA_ERROR

    good = {"prompt_token_ids": [1, 2], "completion_token_ids": [3, 2], "logprobs": [-0.5, -0.1],
            "finish_reason": "stop", "weight_version": 4}
    (call,), problem = trace_calls([good], "s")
    assert problem is None and call.version == 4 and call.finish_reason == "stop"
    assert call.sampled_ids.tolist() == [3, 2] and call.behavior_log_probs.tolist() == pytest.approx([-0.5, -0.1])
    assert "has 1 log-probabilities for 2 ids" in trace_calls([{**good, "logprobs": [-0.5]}], "s")[1]
    assert "no prompt or completion token ids" in trace_calls([{**good, "prompt_token_ids": []}], "s")[1]
    assert trace_calls([{**good, "finish_reason": "tool_calls"}], "s")[0][0].finish_reason == "stop"


def test_harbor_options_are_checked_and_names_are_safe():
    with pytest.raises(ValueError, match="OPENAI_BASE_URL"):
        Harbor(agent_env={"OPENAI_BASE_URL": "http://elsewhere"})
    with pytest.raises(ValueError, match="Harbor.command is empty"):
        Harbor(command=())
    harbor = Harbor(tasks=["a", "b"])
    assert str(harbor.task_directory(Task("1", {"task_id": 1}))) == "b"
    with pytest.raises(KeyError, match="lists 2 directories"):
        harbor.task_directory(Task("7", {"task_id": 7}))
    with pytest.raises(KeyError, match="task.data\\['path'\\]"):
        harbor.task_directory(Task("x", {"prompt": "hi"}))
    name = session_name(task="harbor/hello world:0", group=1, sample=2, attempt=3)
    assert name.startswith("harbor-hello-world-0.g1.s2.a3.") and "/" not in name
    with pytest.raises(TypeError, match="must be a Gateway"):
        HarborSource("http://127.0.0.1:1", harbor=harbor, model="m", trials="t")


@pytest.mark.slow
def test_async_grpo_trains_on_harbor_trials_with_every_update_pushed(served, tmp_path):
    """RolloutScheduler over HarborSource: two updates, the engine reloaded and the gateway stamped
    before each batch is drawn, every admitted call within one update of the policy it trains."""
    tasks = [str(task_directory(tmp_path, f"task{i}")) for i in range(4)]
    pretrained, _ = load_pretrained(served["launch"])
    objective = GRPOObjective(pretrained.model, seq_len=63, behavior_importance=2.0)
    gateway = Gateway(served["gateway"])
    publication = Publication(SafetensorsReload(pretrained, served["launch"], [served["engine"]], engine="vllm"),
                              version=0, stamp=gateway.stamp)
    settled = []
    with HarborSource(gateway, harbor=Harbor(tasks=tasks, command=STANDIN, agent="chatter"), model=MODEL,
                      trials=tmp_path / "trials", workers=8) as harbor:
        scheduler = RolloutScheduler(objective, harbor, publication, width=64, rows=8, groups=2,
                                     tasks=task_ids, session_log=settled.append)

        def batches(part):
            for start in range(0, 1000, 2):
                yield {"task_id": np.arange(start, start + 2) % len(tasks)}

        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=scheduler)
        trainer.fit(scheduler.tasks(Dataset(train=batches, batch=2)), steps=2, log_every=1, sinks=[])
        scheduler.close()
    assert publication.version == 1 and served["recorder"].weight_version == 1
    assert served["policy"].weight_version == "1"
    admitted = [(log.update, s) for log in settled for s, cause in zip(log.sessions, log.causes, strict=True)
                if cause == "admitted"]
    assert len(admitted) == 2 * 2 * 2 and all(s.status is Status.COMPLETED for _, s in admitted)
    assert all(update - 1 <= call.version <= update for update, s in admitted for call in s.calls)
    assert {s.task for _, s in admitted} == {"0", "1", "2", "3"}
