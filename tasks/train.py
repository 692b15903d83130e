"""The training task every stage runs: build the stage's objective and data, fit, save the policy.

Two kinds of resume meet here:
  * a retry (an exception, or the process killed and the flow run again) continues from the
    stage's last checkpoint: `Trainer.fit` restores it from the stage directory, and the store
    drops what earlier attempts recorded after that checkpoint;
  * a rerun with the same inputs skips the stage: `result.json`, written last, records a
    fingerprint of the stage's parameters, data and starting policy, and a match returns the
    saved result without touching the model.
"""

from __future__ import annotations

import json
import os
import time

import jax
import optax
from prefect import get_run_logger, task

from dew_lib.data import ChatMessages, Loading, PreferencePairs, Prompts
from dew_lib.data.chat import Role
from dew_lib.objectives import DPOObjective, GRPOObjective, LMObjective
from dew_lib.rollouts import SampledRollout
from dew_lib.sampling import Sampling
from dew_lib.store import Store
from dew_lib.train.checkpoint import Checkpoints
from dew_lib.train.sinks import JsonlSink
from dew_lib.train.trainer import Trainer
from tasks.manifests import DataManifest, PolicyRef, StageResult, fingerprint
from tasks.params import DPOParams, GRPOParams, RewardParams, SFTParams, StageParams
from tasks.policy import load_policy, save_policy
from tasks.records import open_stage
from tasks.rewards import TaskReward, verdicts
from tasks.scheduled import ScheduledRollout
from tasks.storage import read_json, write_json
from tasks.ui import Deadline, LogSink, ProgressSink, plot_curves, publish_stage

SHOWN = ("loss", "reward", "rewards/accuracy", "rewards/margin", "kl", "accuracy", "val/loss",
         "grad_norm", "steps_per_second")


class RecordedRollout:
    """Runs a SampledRollout and writes every session it drew to the run store, with the verdict
    of every program a code reward ran for it (the rollout's `last_reward_details`)."""

    def __init__(self, rollout: SampledRollout, stage):
        self.rollout, self.stage = rollout, stage

    def __call__(self, state, batch, key):
        started = time.perf_counter()
        packed = self.rollout(state, batch, key)
        seconds = time.perf_counter() - started
        sessions = self.rollout.last_sessions
        runs = self.rollout.last_reward_details
        update = int(jax.device_get(state.updates))
        self.stage.sessions(sessions, update=update, latencies=[seconds] * len(sessions),
                            causes="admitted", truncation="score",
                            verdicts=[verdicts(r or ()) for r in runs] if runs else None)
        return packed


def _loading(seed: int) -> Loading:
    return Loading(workers=0, seed=seed)


def completion_text(tokenizer):
    """How a GRPO completion's ids become the text its reward reads."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _needs(path: str | None, kind: str, what: str) -> str:
    if path is None:
        raise ValueError(f"the {kind} stage needs {what}, and this run's data has none; give it in "
                         "DataParams or leave the stage out of PipelineParams.stages")
    return path


def build(kind: str, params: StageParams, pretrained, variables, data: DataManifest, tokenizer_dir: str,
          seed: int, stage_writer, reward: TaskReward | None = None):
    """(objective, dataset, rollout, eval_every) of one stage, starting from `variables`.

    reward: what grades GRPO's completions (default: TaskReward with default RewardParams).
    """
    model, tokenizer = pretrained.model, pretrained.tokenizer
    if kind == "sft":
        assert isinstance(params, SFTParams)
        spec = ChatMessages(path=_needs(data.chat_path, kind, "conversations (chat_path)"),
                            tokenizer=tokenizer_dir, seq_len=params.seq_len,
                            val_path=data.chat_val_path, loading=_loading(seed))
        objective = LMObjective(model, params.seq_len, pretrained=variables,
                                loss_role=Role.ASSISTANT, ema_decay=None)
        return objective, spec.load(batch=params.batch), None, (
            max(params.steps // 2, 1) if data.chat_val_path else None)
    if kind == "dpo":
        assert isinstance(params, DPOParams)
        spec = PreferencePairs(path=_needs(data.pairs_path, kind, "preference pairs (pairs_path)"),
                               seq_len=params.seq_len,
                               pad_id=tokenizer.pad_token_id or 0, loading=_loading(seed))
        objective = DPOObjective(model, params.seq_len - 1, beta=params.beta, pretrained=variables,
                                 nll_weight=params.nll_weight)
        return objective, spec.load(batch=params.batch), None, None
    assert isinstance(params, GRPOParams)
    spec = Prompts(path=_needs(data.prompts_path, kind, "prompts (prompts_path)"),
                   max_prompt_len=params.max_prompt_len,
                   tokenizer=tokenizer_dir, pad_id=tokenizer.pad_token_id or 0, loading=_loading(seed))
    reward = TaskReward() if reward is None else reward
    if params.mode == "async":  # the RolloutScheduler on the native server (tasks/scheduled.py)
        scheduled = ScheduledRollout(params, model, tokenizer, variables, reward,
                                     completion_text(tokenizer), stage_writer)
        return scheduled.objective, scheduled.dataset(spec.load(batch=params.batch)), scheduled, None
    objective = GRPOObjective(model, params.max_prompt_len + params.max_new_tokens - 1,
                              beta=params.beta, pretrained=variables,
                              sampling_temperature=params.temperature)
    rollout = SampledRollout(
        objective, reward=reward, groups=params.groups, max_new_tokens=params.max_new_tokens,
        sampling=Sampling(temperature=params.temperature, eos_id=tokenizer.eos_token_id),
        decode=completion_text(tokenizer), reward_details=reward.last_runs)
    return objective, spec.load(batch=params.batch), RecordedRollout(rollout, stage_writer), None


def optimizer_for(kind: str, params: StageParams) -> optax.GradientTransformation:
    rate = params.learning_rate
    if kind == "sft":
        rate = optax.warmup_cosine_decay_schedule(0.0, rate, min(50, params.steps // 10 + 1),
                                                  params.steps, rate / 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(rate))


def _history(path: str) -> list[tuple[int, dict]]:
    """Logged windows of every attempt; a window logged again after a resume replaces the old."""
    windows: dict[tuple[int, bool], dict] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                row = json.loads(line)
                step = row.pop("step")
                values = {k: v for k, v in row.items() if v is not None}
                windows[(step, any(k.startswith("val/") for k in values))] = values
    return sorted(((step, values) for (step, _), values in windows.items()), key=lambda x: x[0])


def final_metrics(history) -> dict[str, float]:
    """The last training window merged with the last validation, if any."""
    train = [m for _, m in history if not any(k.startswith("val/") for k in m)]
    val = [m for _, m in history if any(k.startswith("val/") for k in m)]
    return {**(train[-1] if train else {}), **(val[-1] if val else {})}


@task(retries=2, retry_delay_seconds=1, task_run_name="train-{stage}")
def train_stage(stage: str, kind: str, params: StageParams, data: DataManifest, start: PolicyRef,
                directory: str, store_root: str, run: str, seed: int,
                reward: RewardParams | None = None) -> StageResult:
    """Train one stage from `start` and save its final policy under `directory`/policy.

    reward: how GRPO grades its completions (tasks/rewards.py); part of a GRPO stage's fingerprint.
    """
    logger = get_run_logger()
    relevant = params.model_copy(update={"log_every": 1, "max_minutes": None})
    graded = [reward or RewardParams()] if kind == "grpo" else []
    key = fingerprint(kind, relevant, data.fingerprint, start.fingerprint, seed, *graded)
    done = read_json(os.path.join(directory, "result.json"))
    with (open_stage(store_root, run, stage, kind, params.model_dump(mode="json")) as writer,
          TaskReward(reward or RewardParams()) as grader):
        if done is not None and done.get("fingerprint") == key:
            result = StageResult(**done["result"]).model_copy(update={"cached": True})
            logger.info("%s already finished with these inputs; reusing %s", stage, result.policy.path)
            writer.finish("completed", result.metrics)
            return result
        pretrained, variables = load_policy(start, data.tokenizer)
        tokenizer_dir = data.tokenizer or start.path
        objective, dataset, rollout, eval_every = build(kind, params, pretrained, variables, data,
                                                        tokenizer_dir, seed, writer, grader)
        trainer = Trainer(objective, optimizer_for(kind, params), key=jax.random.key(seed),
                          rollout=rollout)
        checkpoints = os.path.join(directory, "checkpoints")
        resumed = None
        if os.path.isdir(checkpoints):
            existing = Checkpoints(checkpoints)
            resumed = existing.latest()
            existing.close()
        if resumed is not None:
            logger.info("%s resumes from its checkpoint at step %d", stage, resumed)
            if isinstance(rollout, ScheduledRollout):  # before the killed attempt's rows go
                earlier, offered = rollout.reuse_from(Store(store_root), run, stage, resumed,
                                                      os.path.join(existing.directory, str(resumed)))
                logger.info("%s reuses up to %d finished rollouts that run %s did not train on",
                            stage, offered, earlier)
            writer.discard_after(resumed)
        log_path = os.path.join(directory, "metrics.jsonl")
        sinks = [LogSink(stage, SHOWN), ProgressSink(stage, params.steps), writer.sink(),
                 JsonlSink(log_path), Deadline(stage, params.max_minutes)]  # last: a window is
        # recorded everywhere before a deadline stops the stage
        try:
            state = trainer.fit(dataset, steps=params.steps, log_every=params.log_every,
                                eval_every=eval_every, directory=checkpoints,
                                checkpoint_every=params.checkpoint_every, sinks=sinks)
        finally:
            if isinstance(rollout, ScheduledRollout):
                rollout.close()
        policy = save_policy(pretrained, state.params, os.path.join(directory, "policy"), key)
        history = _history(log_path)
        metrics = final_metrics(history)
        plot = plot_curves(history, os.path.join(directory, "curves.png"), f"{stage} ({kind})")
        publish_stage(stage, metrics, plot)
        writer.checkpoint(params.steps, policy.path, kind="policy")
        writer.finish("completed", metrics)
    result = StageResult(stage=stage, kind=kind, policy=policy, metrics=metrics, directory=directory)
    write_json(os.path.join(directory, "result.json"), {"fingerprint": key, "result": result.model_dump()})
    logger.info("%s done: %s", stage, {k: round(v, 4) for k, v in metrics.items() if k in SHOWN})
    return result
