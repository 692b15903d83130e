"""What `dew runs` and the `sessions` table report about time and accuracy: held-out accuracy kept
apart from the training batches' token accuracy, an evaluation's real duration, and each
synchronous session's own latency (docs/store.md)."""

import datetime
import json
import time
import types

import jax
import numpy as np
import optax
import pytest

from dew_lib import Trainer, models
from dew_lib.inference import TextGeneration
from dew_lib.objectives import GRPOObjective
from dew_lib.recipes import RecordedRollout, episode_sessions, sampled_sessions
from dew_lib.records.episodes import Observation
from dew_lib.rollouts import EpisodeRollout, SampledRollout
from dew_lib.sampling import Sampling
from dew_lib.store import Evaluation, Store

EOS = 2
MODEL = models.build("causal_transformer", vocab_size=16, emb_features=32, num_layers=2,
                     num_heads=4, mlp_features=64, max_seq_len=16)


def runs_by_stage(store):
    columns, rows = store.runs()
    return {row[columns.index("stage")]: dict(zip(columns, row, strict=True)) for row in rows}


def graded(correct):
    return [Evaluation(item=i, prompt=f"{i}+{i}=", answer="x", score=float(ok), correct=ok)
            for i, ok in enumerate(correct)]


def test_dew_runs_keeps_training_token_accuracy_apart_from_held_out_accuracy(tmp_path):
    """The pipeline's layout: a training stage logs its batches' `accuracy`, and its evaluation,
    a stage of its own, finishes with the greedy and sampled held-out accuracies."""
    store = Store(tmp_path)
    with store.writer("r") as run:
        run.start()
        with run.stage("sft", kind="sft") as stage:
            stage.metrics(10, {"loss": 0.5, "accuracy": 0.9})
            stage.metrics(20, {"loss": 0.25, "accuracy": 0.9928})
            stage.finish("completed", {"loss": 0.25, "accuracy": 0.9928})
        with run.stage("eval-sft", kind="evaluate") as stage:
            stage.evaluations(graded([True, True, True, False]), step=20)
            stage.finish("completed", {"greedy_accuracy": 0.75})
        with run.stage("dpo", kind="dpo") as stage:  # reused: what it finished with, nothing logged
            stage.finish("completed", {"loss": 0.125, "accuracy": 0.7367})
        with run.stage("eval-dpo", kind="evaluate") as stage:  # as stores before greedy_accuracy wrote it
            stage.evaluations(graded([True, False]), step=0)
            stage.finish("completed", {"accuracy": 0.5})
        run.finish()
    rows = runs_by_stage(store)
    figures = {stage: (row["loss"], row["train_accuracy"], row["accuracy"]) for stage, row in rows.items()}
    assert figures == {"sft": (0.25, 0.9928, None), "eval-sft": (None, None, 0.75), "dpo": (0.125, 0.7367, None),
                       "eval-dpo": (None, None, 0.5)}
    columns, _ = store.runs()
    assert columns[columns.index("loss"):columns.index("seconds")] == [
        "loss", "train_accuracy", "reward", "accuracy", "sampled"]


def test_an_evaluation_recorded_once_it_is_done_counts_its_seconds_from_when_it_began(tmp_path):
    store = Store(tmp_path)
    began = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=90)
    with store.writer("r") as run:
        run.start()
        with run.stage("eval-start", kind="evaluate", started_at=began) as stage:
            stage.evaluations(graded([True, False]), step=0)
        with pytest.raises(ValueError, match="timezone-aware"):
            run.stage("eval-sft", started_at=datetime.datetime.now())
        with pytest.raises(ValueError, match="in the future"):
            run.stage("eval-sft", started_at=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1))
    row = runs_by_stage(store)["eval-start"]
    assert 90.0 <= row["seconds"] < 100.0 and row["accuracy"] == 0.5


def test_the_pipelines_evaluation_stage_spans_generating_and_grading(tmp_path, monkeypatch):
    """evaluate_policy records its stage after grading; the stage still starts when the task did."""
    pytest.importorskip("prefect")
    import logging

    import tasks.evaluate as evaluate
    from tasks.manifests import DataManifest, PolicyRef
    from tasks.params import EvalParams

    def slow_answers(model, variables, tokenizer, prompts, params):
        time.sleep(0.5)  # what generating the answers costs
        return ["#### 4", "#### 5"]

    tokenizer = types.SimpleNamespace(encode=lambda text: [ord(c) for c in text])
    monkeypatch.setattr(evaluate, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(evaluate, "load_policy", lambda policy, tokenizer_dir: (
        types.SimpleNamespace(model=None, tokenizer=tokenizer), None))
    monkeypatch.setattr(evaluate, "answer_all", slow_answers)
    eval_path = tmp_path / "eval.jsonl"
    eval_path.write_text("".join(json.dumps({"prompt": p, "ground_truth": t}) + "\n"
                                 for p, t in (("2+2=", "4"), ("2+3=", "4"))))
    data = DataManifest(directory=str(tmp_path), tokenizer=None, chat_path=None, chat_val_path=None,
                        pairs_path=None, prompts_path=None, eval_path=str(eval_path), fingerprint="d")
    with Store(tmp_path).writer("r") as run:  # the pipeline's run, started before its stages
        run.start()
    result = evaluate.evaluate_policy.fn("sft", PolicyRef(path=str(tmp_path), fingerprint="p"), data,
                                         EvalParams(samples=0), str(tmp_path), str(tmp_path), "r", step=4)
    assert result.accuracy == 0.5
    store = Store(tmp_path)
    row = runs_by_stage(store)["eval-sft"]
    assert row["seconds"] >= 0.5 and (row["accuracy"], row["train_accuracy"]) == (0.5, None)
    assert store.rows("SELECT metrics FROM stages")[1] == [({"greedy_accuracy": 0.5},)]


def two_prompts():
    """Row 0 asks for 'fast', row 1 for 'slow' (the reward's ground truths)."""
    truths = np.zeros((2, 4), np.int32)
    truths[0] = np.frombuffer(b"fast", np.uint8)
    truths[1] = np.frombuffer(b"slow", np.uint8)
    return {"prompt": np.array([[0, 0, 3, 4], [0, 5, 6, 7]], np.int32),
            "prompt_length": np.array([2, 3], np.int32),
            "data_source": np.tile(np.frombuffer(b"toy", np.uint8).astype(np.int32), (2, 1)),
            "ground_truth": truths, "extra_info": np.zeros((2, 0), np.int32)}


def slow_reward(data_source, completion, ground_truth, extra_info):
    if ground_truth == "slow":
        time.sleep(0.3)  # a sandbox that takes its time on this prompt's programs
    return 1.0


def test_each_session_of_a_synchronous_update_records_its_own_latency(tmp_path):
    objective = GRPOObjective(MODEL, seq_len=9)
    rollout = SampledRollout(objective, reward=slow_reward, groups=3, max_new_tokens=6,
                             sampling=Sampling(temperature=1.0, eos_id=EOS), workers=6)
    state = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0)).initial_state()
    with Store(tmp_path).writer("r") as run, run.stage("grpo", kind="grpo") as stage:
        recorded = RecordedRollout(rollout, sampled_sessions(rollout, stage))
        started = time.perf_counter()
        recorded(state, two_prompts(), jax.random.key(1))
        call = time.perf_counter() - started
    slowest = Store(tmp_path).rows("SELECT group_id, latency FROM sessions ORDER BY latency DESC")[1]
    assert [group for group, _ in slowest] == [1, 1, 1, 0, 0, 0]  # the slow prompt's sessions first
    latencies = [latency for _, latency in slowest]
    assert min(latencies[:3]) - max(latencies[3:]) >= 0.25 and max(latencies) <= call


class EndsAtReset:
    """An environment whose episode ends as it starts; task 2's takes 0.3 s to say so."""

    def __init__(self, task, identity):
        self.task = task

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def reset(self):
        if self.task.id == "2":
            time.sleep(0.3)
        return Observation(status="completed", detail="done")

    def step(self, action):
        raise AssertionError("no turn is drawn: every episode ended at reset")


def test_each_tool_episode_records_its_own_latency(tmp_path):
    variables = jax.jit(MODEL.init)(jax.random.key(0), np.zeros((1, 8), np.int32))
    rollout = EpisodeRollout(TextGeneration(MODEL), EndsAtReset, lambda task, episode: 1.0,
                             max_prompt_tokens=8, max_new_tokens=3, max_turns=2, groups=2,
                             sampling=Sampling(temperature=1.0, eos_id=EOS), workers=4)
    state = types.SimpleNamespace(params=variables, step=np.int32(0), updates=np.int32(0))
    with Store(tmp_path).writer("r") as run, run.stage("tools", kind="grpo") as stage:
        RecordedRollout(rollout, episode_sessions(rollout, stage))(
            state, {"task_id": np.array([1, 2], np.int32), "prompt": np.array([[0, 3], [0, 4]], np.int32),
                    "prompt_length": np.array([1, 1], np.int32)}, jax.random.key(1))
    found = Store(tmp_path).rows("SELECT task, latency FROM sessions ORDER BY latency DESC")[1]
    assert [task for task, _ in found] == ["2", "2", "1", "1"]
    assert found[1][1] - found[2][1] >= 0.25
