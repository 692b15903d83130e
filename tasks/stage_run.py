"""The body of a training stage: load the starting policy, build the stage's objects from its
options (dew_lib/recipes), fit, save the policy, record the stage; and the stage's fingerprint.

`run_stage` runs in the Prefect task's process (tasks/train.py) or, with `processes > 1`, in
every process of the job that task launches (tasks/stage_job.py). Those job processes never
import Prefect, so nothing here does: the run logger, the artifacts and the retries stay in the
task. (tests/test_layout.py checks that importing this module leaves Prefect out.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax

from dew_lib import recipes
from dew_lib.data import ChatMessages, Loading, PreferencePairs, Prompts
from dew_lib.data.prompts import last_turns
from dew_lib.data.tokenizer import load_tokenizer
from dew_lib.models import lora, save_adapter
from dew_lib.objectives import PPOObjective
from dew_lib.recipes import (
    Built,
    EpisodeOptions,
    OneTurn,
    RemoteEngine,
    ScheduledRollout,
    build_distill,
    build_dpo,
    build_episode_grpo,
    build_grpo,
    build_sft,
    remote_server,
)
from dew_lib.recipes.build import load_teacher, remote_teacher
from dew_lib.store import Store
from dew_lib.train import distributed
from dew_lib.train.mesh import MeshSpec
from dew_lib.train.trainer import Trainer
from tasks.job_records import DeferredWriter
from tasks.lifecycle import conclude, stage_sinks, stage_trackers, write_result
from tasks.manifests import DataManifest, PolicyRef, StageResult, fingerprint, keyed
from tasks.memory import check_memory
from tasks.params import (
    DistillParams,
    DPOParams,
    GRPOParams,
    PPOParams,
    RewardParams,
    RolloutServerParams,
    SFTParams,
    StageParams,
    ToolParams,
)
from tasks.policy import checkpoint_fingerprint, load_policy, save_policy
from tasks.records import open_stage
from tasks.refusals import RunRefused
from tasks.rewards import TaskReward, verdicts
from tasks.stage_job import GatheredWriter, StageJob
from tasks.tool_task import EpisodeVerifier, calculator_environment

RL = ("grpo", "ppo")  # the kinds of the RL stage: GRPO, or PPO with a critic (PipelineParams.rl)
SHOWN = ("loss", "reward", "rewards/accuracy", "rewards/margin", "kl", "accuracy", "val/loss",
         "critic/vf_loss", "critic/vf_explained_var", "grad_norm", "steps_per_second")


def _loading(seed: int) -> Loading:
    return Loading(workers=0, seed=seed)


def completion_text(tokenizer):
    """How a GRPO completion's ids become the text its reward reads."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def adapter_key(seed: int) -> jax.Array:
    """What a stage's LoRA adapters are drawn from: the run's seed, apart from the Trainer's key."""
    return jax.random.fold_in(jax.random.key(seed), 1)


def _needs(path: str | None, kind: str, what: str) -> str:
    if path is None:
        raise RunRefused(f"the {kind} stage needs {what}, and this run's data has none; give it in "
                         "DataParams or leave the stage out of PipelineParams.stages")
    return path


def _build_episodes(params: GRPOParams, pretrained, variables, data: DataManifest, tokenizer_dir: str,
                    seed: int, writer, reward: TaskReward, tools: ToolParams | None,
                    ppo: PPOParams | None) -> Built:
    """GRPO (PPO with `ppo`) on episodes: on a tool task each prompt is an episode with its
    calculator worker; otherwise (PPO on one-turn prompts) each prompt is a one-turn episode
    whose reply is graded like a GRPO completion."""
    tokenizer = pretrained.tokenizer
    spec = Prompts(path=_needs(data.prompts_path, "grpo", "prompts (prompts_path)"),
                   max_prompt_len=params.max_prompt_len, tokenizer=tokenizer_dir,
                   pad_id=tokenizer.pad_token_id or 0, loading=_loading(seed))
    shape: EpisodeOptions
    if data.tool is not None:
        shape = tools = tools or ToolParams()
        environment = calculator_environment(tokenizer, tokenizer_dir, tools)
    else:
        shape = EpisodeOptions(max_turns=1, max_prompt_len=params.max_prompt_len)
        environment = OneTurn
    return build_episode_grpo(
        pretrained.model, variables, spec, params, shape, environment=environment,
        verifier=EpisodeVerifier(reward, tokenizer), eos_id=tokenizer.eos_token_id,
        decode=completion_text(tokenizer), writer=writer, ppo=ppo,
        server=_server(params.rollout, pretrained, routing=params.routing_replay != "none"))


def _build(kind: str, params: StageParams, pretrained, variables, data: DataManifest,
           tokenizer_dir: str, seed: int, writer, reward: TaskReward, tools: ToolParams | None = None,
           ppo: PPOParams | None = None) -> Built:
    """The stage's data spec from its parameters, which are its recipe options, built by
    dew_lib.recipes from `variables`; the RL stage grades with `reward`, records its sessions
    with `writer`, on a tool task runs episodes shaped by `tools`, and as PPO trains a critic
    with `ppo`."""
    model, tokenizer = pretrained.model, pretrained.tokenizer
    if kind == "sft":
        assert isinstance(params, SFTParams)
        spec = ChatMessages(path=_needs(data.chat_path, kind, "conversations (chat_path)"),
                            tokenizer=tokenizer_dir, seq_len=params.max_length - 1,
                            val_path=data.chat_val_path, loading=_loading(seed))
        return build_sft(model, variables, spec, params,
                         eval_every=max(params.steps // 2, 1) if data.chat_val_path else None)
    if kind == "dpo":
        assert isinstance(params, DPOParams)
        spec = PreferencePairs(path=_needs(data.pairs_path, kind, "preference pairs (pairs_path)"),
                               seq_len=params.max_length,
                               pad_id=tokenizer.pad_token_id or 0, loading=_loading(seed))
        return build_dpo(model, variables, spec, params)
    if kind == "distill":
        assert isinstance(params, DistillParams)
        return _build_distill(params, pretrained, variables, data, tokenizer_dir, seed, writer)
    assert isinstance(params, GRPOParams)
    if data.tool is not None or kind == "ppo":
        return _build_episodes(params, pretrained, variables, data, tokenizer_dir, seed, writer, reward, tools,
                               (ppo or PPOParams()) if kind == "ppo" else None)
    spec = Prompts(path=_needs(data.prompts_path, kind, "prompts (prompts_path)"),
                   max_prompt_len=params.max_prompt_len,
                   tokenizer=tokenizer_dir, pad_id=tokenizer.pad_token_id or 0, loading=_loading(seed))
    return build_grpo(model, variables, spec, params, reward=reward, eos_id=tokenizer.eos_token_id,
                      decode=completion_text(tokenizer), reward_details=reward.last_runs,
                      writer=writer, verdicts=verdicts,
                      server=_server(params.rollout, pretrained, routing=params.routing_replay != "none"))


def _build_distill(params: DistillParams, pretrained, variables, data: DataManifest, tokenizer_dir: str,
                   seed: int, writer) -> Built:
    """Distillation of the policy from `params.teacher`, or from the teacher served at
    `params.teacher_url`, on the GRPO prompts; with `params.lmbda` < 1 on the SFT conversations
    instead (TRL GKD's dataset), each split at its last assistant turn: the messages before it are
    the prompt, its text (then the tokenizer's eos) the completion the off-policy steps train on.
    A teacher that cannot teach this student (another vocabulary or tokenizer, a served one's
    engine's /tokenize included; a served one whose context is too short for the rows) refuses
    the run."""
    model, tokenizer = pretrained.model, pretrained.tokenizer
    if params.lmbda < 1:
        source = _needs(data.chat_path, "distill", "conversations (chat_path) for lmbda < 1")
    else:
        source = _needs(data.prompts_path, "distill", "prompts (prompts_path)")
    shape = dict(max_prompt_len=params.max_prompt_len, pad_id=tokenizer.pad_token_id or 0)
    try:
        if params.lmbda < 1:
            chat = ChatMessages(path=source, tokenizer=tokenizer_dir,
                                seq_len=params.max_prompt_len + params.max_new_tokens)
            spec = Prompts(records=tuple(last_turns(chat.conversations())), completion="completion",
                           max_completion_len=params.max_new_tokens, completion_eos=tokenizer.eos_token_id,
                           tokenizer=tokenizer_dir, loading=_loading(seed), **shape)
        else:
            spec = Prompts(path=source, tokenizer=tokenizer_dir, loading=_loading(seed), **shape)
        ours = load_tokenizer(tokenizer_dir)
        teacher = remote_teacher(params, ours) if params.remote else load_teacher(params, model, tokenizer=ours)
        return build_distill(model, variables, spec, params, eos_id=tokenizer.eos_token_id,
                             decode=completion_text(tokenizer), teacher=teacher, writer=writer,
                             server=_server(params.rollout, pretrained))
    except ValueError as error:  # an engine that fails to answer raises EngineError, which a retry may pass
        raise RunRefused(f"distill: {error}") from None


def _server(rollout: RolloutServerParams, pretrained, routing: bool = False):
    """The remote engine's server factory when `rollout` names one, else None (drawn in process);
    `routing`: ask the engine for each token's experts (routing replay)."""
    if not rollout.remote:
        return None
    return remote_server(RemoteEngine(url=rollout.server, directory=rollout.directory, provider=rollout.provider,
                                      model=rollout.model, replicas=tuple(rollout.replicas),
                                      processed_logprobs=rollout.processed_logprobs,
                                      routing=routing, timeout=rollout.timeout),
                         pretrained)


def input_labels(stage: str) -> dict[str, str]:
    """How the log names each group of a stage's inputs when they changed."""
    return {"params": f"{stage} parameters", "data": "the data", "start": "the starting policy",
            "seed": "seed", "reward": "reward parameters", "tools": "tool parameters",
            "ppo": "PPO parameters", "teacher": "the teacher"}


def stage_inputs(kind: str, params: StageParams, data: DataManifest, start: PolicyRef, seed: int,
                 reward: RewardParams | None = None, tools: ToolParams | None = None,
                 ppo: PPOParams | None = None) -> tuple[str, dict]:
    """The stage's fingerprint and the inputs it is computed from (inputs.json): its parameters
    (`keyed`) but `log_every` and `max_minutes`, the data, the starting policy, the seed and, for
    the RL stage, the reward, tool and PPO parameters; for distillation, the teacher checkpoint's
    files, or a served teacher's URL and model name (what it serves cannot be fingerprinted)."""
    relevant = params.model_copy(update={"log_every": 1, "max_minutes": None})
    if isinstance(relevant, GRPOParams | DistillParams) and relevant.rollout.remote:
        # Native or remote, the wire format and the log-probabilities decide the rollouts; where
        # the engine runs does not (a restarted engine elsewhere resumes the same stage).
        relevant = relevant.model_copy(update={"rollout": relevant.rollout.model_copy(update={
            "server": "remote", "directory": None, "model": None, "replicas": [], "timeout": 600.0})})
    dumped = keyed(relevant)
    groups: dict = {}
    if kind in RL:
        groups["reward"] = reward or RewardParams()
        if data.tool is not None:
            groups["tools"] = tools or ToolParams()
        if kind == "ppo":
            groups["ppo"] = ppo or PPOParams()
    # The groups enter the key in this order (reward, tools, ppo), as they always have.
    keys = [keyed(group) for group in groups.values()]
    extra = {name: keyed(group) for name, group in groups.items()}
    if isinstance(params, DistillParams) and params.teacher is not None:
        extra["teacher"] = checkpoint_fingerprint(params.teacher)  # a new teacher at the same path too
        keys.append(extra["teacher"])
    elif isinstance(params, DistillParams) and params.remote:
        extra["teacher"] = {"url": params.teacher_url, "model": params.teacher_model}
        keys.append(extra["teacher"])
    key = fingerprint(kind, dumped, data.fingerprint, start.fingerprint, seed, *keys)
    inputs = {"params": dumped, "data": data.fingerprint, "start": start.fingerprint, "seed": seed, **extra}
    return key, inputs


def _recorder(writer, params: StageParams):
    """What the stage records through: its writer in one process; in a job, every process's
    rows gathered onto process 0's writer, once a step (sync) or after each trainer call (async)."""
    if jax.process_count() == 1:
        return writer
    return DeferredWriter(writer) if getattr(params, "mode", "sync") == "async" else GatheredWriter(writer)


def run_stage(job: StageJob, logger, *, progress: bool = True, publish=None) -> StageResult | None:
    """Train the stage `job` describes in this process, alone or as one process of a job
    (tasks/stage_job.py): load the starting policy, build, fit from `job.resumed`, save.

    Process 0 records the stage in the run store and writes its policy, metrics.jsonl,
    curves.png and result.json (last), and returns its result; other processes only train and
    return None. progress: process 0 moves the stage's progress artifact (the task's process
    does it for a job). publish: `(stage, metrics, curves path)`, called before the store marks the stage completed.
    """
    stage, kind, directory, params = job.stage, job.kind, job.directory, job.stage_params()
    primary = distributed.is_primary()
    recording = (open_stage(job.store_root, job.run, stage, kind, params.model_dump(mode="json")) if primary
                 else contextlib.nullcontext())
    with (recording as writer, TaskReward(job.reward or RewardParams()) as grader,
          stage_trackers(job.tracking, writer, job.run, stage, params, os.path.dirname(directory), logger) as trackers):
        recorder = _recorder(writer, params)
        pretrained, variables = load_policy(job.start, job.data.tokenizer)
        if params.lora.rank:  # adapters on the frozen starting policy; its saves fold them in
            model, variables = params.lora.attach(pretrained.model, variables, adapter_key(job.seed))
            pretrained = dataclasses.replace(pretrained, model=model)
            logger.info("%s trains LoRA adapters on its frozen starting policy (quantized: %s): %s", stage,
                        params.lora.quantize, model.lora)
        tokenizer_dir = job.data.tokenizer or job.start.path
        built = _build(kind, params, pretrained, variables, job.data, tokenizer_dir, job.seed, recorder, grader,
                       job.tools, job.ppo)
        optimizer = recipes.optimizer(params, job.ppo.critic_learning_rate if kind == "ppo" and job.ppo else None)
        rollout = recorder.after_each(built.rollout) if isinstance(recorder, DeferredWriter) else built.rollout
        trainer = Trainer(built.objective, optimizer, key=jax.random.key(job.seed), rollout=rollout,
                          mesh=MeshSpec.parse(params.mesh))
        rows = params.batch * getattr(params, "groups", 1)  # SFT rows, DPO pairs, RL completions
        dtype = str(jax.tree.leaves(variables)[0].dtype)
        check_memory(stage, kind, trainer, rows, built.objective.seq_len + 1, params.device_memory, dtype, logger)
        if job.resumed is not None:
            if isinstance(built.rollout, ScheduledRollout):  # before the killed attempt's rows go
                earlier, offered = built.rollout.reuse_from(
                    Store(job.store_root) if primary else None, job.run, stage, job.resumed,
                    os.path.join(job.written, str(job.resumed)))
                logger.info("%s reuses up to %d finished rollouts that run %s did not train on",
                            stage, offered, earlier)
            if writer is not None:
                writer.discard_after(job.resumed)
        sinks = stage_sinks(stage, params, writer, os.path.join(directory, "metrics.jsonl"), shown=SHOWN,
                            progress=progress, logger=logger, trackers=trackers.sinks)
        try:
            state = trainer.fit(built.dataset, steps=params.steps, log_every=params.log_every,
                                eval_every=built.eval_every, directory=os.path.join(directory, "checkpoints"),
                                checkpoint_every=params.checkpoint_every, sinks=sinks)
        finally:
            built.close()
            if isinstance(recorder, DeferredWriter):
                recorder.write_own()  # what process 0's scheduler settled at close
        trained = state.params["policy"] if isinstance(built.objective, PPOObjective) else state.params
        # Every process saves: a policy split across processes is gathered a tensor at a time
        # as process 0 writes it, never the whole of it on one host.
        policy = save_policy(pretrained, trained, os.path.join(directory, "policy"), job.key, write=primary)
        if params.lora.rank:  # the adapter alone too, as PEFT writes it, on the starting policy
            adapters = distributed.local_copy(lora.split(trained)[0])  # every process gathers together
            if primary:
                save_adapter(os.path.join(directory, "adapter"), pretrained.model, {"params": adapters["params"]},
                             base_model_name_or_path=os.path.abspath(job.start.path))
        if not primary:
            return None
        metrics = conclude(writer, stage, kind, directory, params.steps, policy.path, publish=publish)
        trackers.attach(policy=policy.path, curves=os.path.join(directory, "curves.png"))
    result = StageResult(stage=stage, kind=kind, policy=policy, metrics=metrics, directory=directory,
                         steps=params.steps)
    write_result(directory, job.key, result)
    return result

