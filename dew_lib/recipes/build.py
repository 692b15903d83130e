"""Stage builders: a stage's options and data spec in, its objective, dataset and rollout out.

This is the one place that maps an SFT, DPO or GRPO stage's options (options.py) to objects; the
Recipe chain (chain.py) and the pipeline's training task (tasks/train.py, whose forms are those
options) both build every stage here, so the two cannot drift:

    ChatMessages    + SFTOptions  -> LMObjective counting assistant targets
    PreferencePairs + DPOOptions  -> DPOObjective with options.loss_type (reference: the starting
                                     policy, none for simpo/orpo); loss_type 'kto': KTOObjective
                                     on UnpairedExamples (or the pairs split in two)
    Prompts         + GRPOOptions -> GRPOObjective with a SampledRollout (mode "sync"), or with a
                                     ScheduledRollout: RolloutScheduler + PromptSource on a
                                     NativeRolloutServer (mode "async", scheduled.py)
    Prompts      + DistillOptions -> DistillObjective against the teacher checkpoint
                                     options.teacher, or the RemoteTeacher served at
                                     options.teacher_url, with a DistillRollout (the student samples,
                                     in process or on a `server`)

A builder returns `Built(objective, dataset, rollout, eval_every)`; the caller picks the optimizer
and key, makes the Trainer and fits it, then calls `Built.close()` (which stops an async stage's
server and scheduler). Given a `StageWriter`, a GRPO stage records every session it drew in the
run store (sync: `RecordedRollout`, recorded.py; async: every SchedulerRecord and settled session), with the
programs a code reward ran as Verdict rows when `verdicts` turns them into rows; a distill stage records
the sessions its student sampled, each with reward = the negative mean per-token KL to the teacher.

`GRPOOptions.objective` and `.sampling` are the one place a GRPOObjective and its Sampling come
from options (the sync, async, episode and PPO paths all call them). Flow-matching and Flow-GRPO
stages are built in flow.py, optimizers by options.optimizer.

Not here: the options' declarations (options.py), keys, Trainer.fit and resume (the callers),
data specs from files or manifests (the caller makes the spec), Prefect (tasks/ and flows/).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dew_lib.data import ChatMessages, Dataset, PreferencePairs, Prompts, UnpairedExamples
from dew_lib.data.chat import Role
from dew_lib.inference.openai_engine import OpenAICompletion
from dew_lib.inference.remote_teacher import RemoteTeacher
from dew_lib.models import load_pretrained
from dew_lib.objectives import DistillObjective, DPOObjective, KTOObjective, LMObjective
from dew_lib.options import integer
from dew_lib.recipes.options import DPOOptions, GRPOOptions, SFTOptions
from dew_lib.recipes.options_distill import DistillOptions
from dew_lib.recipes.recorded import RecordedRollout, Verdicts, sampled_sessions
from dew_lib.recipes.scheduled import ScheduledRollout
from dew_lib.rollouts import DistillRollout, SampledRollout
from dew_lib.sampling import Sampling


@dataclasses.dataclass(frozen=True, kw_only=True)
class Built:
    """What a builder returns: give objective and rollout to a Trainer, fit it on dataset with
    eval_every, then `close()`."""

    objective: Any
    dataset: Dataset
    rollout: Any = None
    eval_every: int | None = None
    model: Any = None  # the model trained: the one given, with adapters when the options' lora asks
    teacher: Any = None  # a distill stage's RemoteTeacher, whose request threads close with the stage

    def close(self) -> None:
        """Stop what the rollout runs (an async stage's scheduler, source and server) and a remote
        teacher's request threads."""
        for part in (self.rollout, self.teacher):
            close = getattr(part, "close", None)
            if close is not None:
                close()


ADAPTER_KEY = 0  # seeds the adapters' A when a builder is given no key


def adapted(model, variables, options, key: jax.Array | None) -> tuple[Any, Any]:
    """`(model, variables)` with the adapters `options.lora` asks for (A drawn from `key`,
    else from key ADAPTER_KEY), or as given at rank 0."""
    return options.lora.attach(model, variables, jax.random.key(ADAPTER_KEY) if key is None else key)


def build_sft(model, variables, data: ChatMessages, options: SFTOptions, *, eval_every: int | None = None,
              key: jax.Array | None = None) -> Built:
    """SFT on the assistant turns of `data`, starting from `variables` (None: a fresh init).
    eval_every: steps between validations (None: never; the spec's validation split is read
    only when this is set). key: seeds the adapters when `options.lora` has a rank."""
    integer("build_sft eval_every", eval_every, optional=True)
    model, variables = adapted(model, variables, options, key)
    objective = LMObjective(model, data.seq_len, pretrained=variables, loss_role=Role.ASSISTANT,
                            ema_decay=None)
    return Built(objective=objective, dataset=data.load(batch=options.batch), eval_every=eval_every, model=model)


def build_dpo(model, variables, data: PreferencePairs | UnpairedExamples, options: DPOOptions, *,
              key: jax.Array | None = None) -> Built:
    """The DPO family's `options.loss_type` on `data`, starting from `variables` (None: a fresh
    init), which the reference losses and KTO freeze as their reference; with `options.lora`,
    adapters seeded by `key` train and the reference is `variables` themselves. 'kto' reads
    UnpairedExamples, or PreferencePairs split into a desirable chosen and an undesirable
    rejected example each; the paired losses read PreferencePairs only."""
    model, variables = adapted(model, variables, options, key)
    if options.loss_type == "kto":
        if isinstance(data, PreferencePairs):
            data = UnpairedExamples.from_pairs(data)
        objective: DPOObjective | KTOObjective = KTOObjective(
            model, data.seq_len - 1, beta=options.beta, pretrained=variables,
            desirable_weight=options.desirable_weight, undesirable_weight=options.undesirable_weight)
        return Built(objective=objective, dataset=data.load(batch=options.batch), model=model)
    if not isinstance(data, PreferencePairs):
        raise ValueError(f"DPOOptions.loss_type={options.loss_type!r} trains preference pairs; "
                         f"{type(data).__name__} holds unpaired examples, which only loss_type='kto' reads")
    objective = DPOObjective(model, data.seq_len - 1, beta=options.beta, pretrained=variables,
                             nll_weight=options.nll_weight, loss_type=options.loss_type,
                             label_smoothing=options.label_smoothing, simpo_gamma=options.simpo_gamma,
                             cpo_alpha=options.cpo_alpha)
    return Built(objective=objective, dataset=data.load(batch=options.batch), model=model)


def build_grpo(model, variables, data: Prompts, options: GRPOOptions, *,
               reward: Callable[[str, str, str, str], float], eos_id: int | Sequence[int] | None = None,
               decode: Callable[[Sequence[int]], str] | None = None,
               reward_details: Callable[[], Any] | None = None,
               writer=None, verdicts: Verdicts | None = None, server=None, key: jax.Array | None = None) -> Built:
    """GRPO on the prompts of `data` graded by `reward`, from the frozen `variables`.

    eos_id: the id (or ids) that end a completion, the tokenizer's (None: only the budget).
    decode: sampled ids -> the text `reward` reads (None: the rollouts' token-id text).
    reward_details: the reward's record of the latest call on the calling thread (e.g.
    CodeReward.last_runs), or None. writer: the stage's `dew_lib.store.StageWriter`, to record
    sessions (and, async, scheduler records) in the run store; None records nothing.
    verdicts: turns reward_details' program runs into the store's Verdict rows. server: async
    only, `sampling -> RolloutServer` for a remote engine (`remote_server`; None: the native server).
    key: seeds the adapters when `options.lora` has a rank.
    """
    model, variables = adapted(model, variables, options, key)
    if server is not None and options.mode != "async":
        raise ValueError("a remote rollout server draws ahead of the trainer: it needs GRPOOptions.mode='async'")
    if options.mode == "async":
        scheduled = ScheduledRollout(options, model, variables, reward, max_prompt_len=data.max_prompt_len,
                                     eos_id=eos_id, decode=decode, reward_details=reward_details, writer=writer,
                                     verdicts=verdicts, server=server)
        try:
            dataset = scheduled.dataset(data.load(batch=options.batch))
        except BaseException:
            scheduled.close()  # the server and the source's threads are already running
            raise
        return Built(objective=scheduled.objective, dataset=dataset, rollout=scheduled, model=model)
    objective = options.objective(model, variables, data.max_prompt_len + options.max_new_tokens)
    decoded = {} if decode is None else {"decode": decode}
    rollout = SampledRollout(
        objective, reward=reward, groups=options.groups, max_new_tokens=options.max_new_tokens,
        sampling=options.sampling(eos_id), estimator=options.advantage_estimator,
        reward_details=reward_details, **decoded)
    dataset = data.load(batch=options.batch)
    if writer is not None:
        rollout = RecordedRollout(rollout, sampled_sessions(rollout, writer, verdicts))
    return Built(objective=objective, dataset=dataset, rollout=rollout, model=model)


def load_teacher(options: DistillOptions, student, tokenizer=None) -> tuple[Any, Any]:
    """`(model, variables)` of the checkpoint `options.teacher`, refused with the field named when
    it is empty or its vocabulary is not the student's: another vocab_size, or, when both the
    teacher's directory and the caller (`tokenizer`, what the prompts are encoded with) have a
    tokenizer, another token -> id map. A served teacher (`options.teacher_url`) is not loaded:
    see `remote_teacher`."""
    if options.teacher is None:
        served = (f" (teacher_url={options.teacher_url!r} is served: build it with remote_teacher)"
                  if options.remote else "")
        raise ValueError("DistillOptions.teacher is empty: give the teacher's Hugging Face checkpoint directory "
                         f"(e.g. the policy directory of an SFT stage of a larger model){served}")
    teacher = load_pretrained(options.teacher, tokenizer=tokenizer is not None)
    ours, theirs = getattr(student, "vocab_size", None), getattr(teacher.model, "vocab_size", None)
    if ours != theirs:
        raise ValueError(f"DistillOptions.teacher={options.teacher!r} has vocab_size {theirs} and the student "
                         f"{ours}: distillation compares their next-token distributions id by id, so both must "
                         "use one tokenizer; pick a teacher trained with the student's tokenizer")
    theirs_ids = None if tokenizer is None or teacher.tokenizer is None else teacher.tokenizer.get_vocab()
    if theirs_ids is not None and theirs_ids != tokenizer.get_vocab():
        raise ValueError(f"DistillOptions.teacher={options.teacher!r} ships a tokenizer whose token ids differ from "
                         f"the student's (both have vocab_size {ours}): distillation compares the two models id by "
                         "id, so both must use one tokenizer; pick a teacher trained with the student's tokenizer")
    return teacher.model, teacher.variables


def remote_teacher(options: DistillOptions, tokenizer=None) -> RemoteTeacher:
    """The `RemoteTeacher` served at `options.teacher_url` (an OpenAI-compatible base URL, /v1
    included) under the name `options.teacher_model`, on an `openai` client made as a remote
    rollout engine's is (recipes/remote.py; RemoteTeacher sets its timeouts and retries). Given
    the student's `tokenizer`, a teacher whose engine tokenizes otherwise is refused
    (`RemoteTeacher.check_tokenizer`), and one whose engine cannot say (no /tokenize, no tokenizer
    served) is taken with a warning: its ids are then trusted to mean the student's tokens."""
    import openai

    if options.teacher_url is None or options.teacher_model is None:
        raise ValueError("DistillOptions.teacher_url and teacher_model are empty: give the served teacher's "
                         "base URL and model name, or a checkpoint in DistillOptions.teacher")
    client = openai.OpenAI(base_url=options.teacher_url, api_key="EMPTY")
    teacher = RemoteTeacher(OpenAICompletion(options.teacher_model, client))
    if tokenizer is None:
        return teacher
    try:
        checked = teacher.check_tokenizer(tokenizer)
    except BaseException:
        teacher.close()
        raise
    if not checked:
        warnings.warn(f"the teacher served at {options.teacher_url} does not say how it tokenizes (no POST "
                      "/tokenize, or no tokenizer served), so it could not be checked against the student's; "
                      "its log-probs are trusted to be of the student's tokens", stacklevel=2)
    return teacher


def build_distill(model, variables, data: Prompts, options: DistillOptions, *,
                  eos_id: int | Sequence[int] | None = None, decode: Callable[[Sequence[int]], str] | None = None,
                  teacher: tuple[Any, Any] | RemoteTeacher | None = None, writer=None,
                  key: jax.Array | None = None, server: Callable[[Sampling], Any] | None = None) -> Built:
    """On-policy distillation of the student `(model, variables)` (variables None: a fresh init)
    from the teacher the options name: the checkpoint `options.teacher`, or the engine at
    `options.teacher_url` (or `teacher`: a `(model, variables)` already loaded, or a RemoteTeacher),
    on the prompts of `data`. With probability `options.lmbda` a step trains on the student's
    samples, otherwise on the data's completions, so `lmbda` below 1 needs a spec with its
    `completion` column set, at most `max_new_tokens` wide, and is refused before anything loads
    without one. A remote teacher is closed by `Built.close()`, and its engine's context is
    checked here.
    eos_id, decode, writer, key: as `build_grpo`'s (writer records each sampled session with reward
    = its negative mean per-token KL to the teacher). server: `sampling -> RolloutServer` (e.g.
    `remote_server`) to draw the student's samples on, pushed the student's weights before each
    sampled step's draws (None: `generate` in this process); closed by `Built.close()`."""
    if options.lmbda < 1:
        completion, width = getattr(data, "completion", None), getattr(data, "max_completion_len", None)
        if completion is None:
            raise ValueError(f"DistillOptions.lmbda={options.lmbda} trains some steps on the data's completions, "
                             "and Prompts.completion is empty, so the prompts carry none: set "
                             "Prompts(completion=..., max_completion_len=...) to the field holding each prompt's "
                             "completion (docs/distill.md), or lmbda=1.0 (the student's own samples every step)")
        if width is not None and width > options.max_new_tokens:
            raise ValueError(f"Prompts.max_completion_len={width} is more than DistillOptions.max_new_tokens="
                             f"{options.max_new_tokens}, the completion ids a packed row holds: set "
                             "max_completion_len to at most max_new_tokens, or raise max_new_tokens")
    if teacher is None:
        teacher = remote_teacher(options) if options.remote else load_teacher(options, model)
    served = teacher if isinstance(teacher, RemoteTeacher) else None
    student_server = None
    try:
        model, variables = adapted(model, variables, options, key)
        width = data.max_prompt_len + options.max_new_tokens - 1
        common = dict(loss=options.loss, beta=options.beta, temperature=options.temperature, pretrained=variables)
        if isinstance(teacher, RemoteTeacher):
            objective = DistillObjective(model, width, teacher=teacher, **common)
        else:
            teacher_model, teacher_variables = teacher
            objective = DistillObjective(model, width, teacher_model=teacher_model, teacher=teacher_variables,
                                         **common)
        decoded = {} if decode is None else {"decode": decode}
        sampling = options.sampling(eos_id)
        student_server = None if server is None else server(sampling)
        rollout: Any = DistillRollout(objective, max_new_tokens=options.max_new_tokens, sampling=sampling,
                                      lmbda=options.lmbda, server=student_server, **decoded)
        dataset = data.load(batch=options.batch)
    except BaseException:
        for running in (served, student_server):
            if running is not None:
                running.close()  # its request threads are already running
        raise
    if writer is not None:
        rollout = RecordedRollout(rollout, sampled_sessions(rollout, writer))
    return Built(objective=objective, dataset=dataset, rollout=rollout, model=model, teacher=served)


__all__ = ["Built", "build_distill", "build_dpo", "build_grpo", "build_sft", "load_teacher", "remote_teacher"]
