"""Stage builders: a stage's options and data spec in, its objective, dataset and rollout out.

This is the one place that maps an SFT, DPO or GRPO stage's options to objects; the Recipe chain
(chain.py) and the pipeline's training task (tasks/train.py, which turns its pydantic forms into
these options) both build every stage here, so the two cannot drift:

    ChatMessages    + SFTOptions  -> LMObjective counting assistant targets
    PreferencePairs + DPOOptions  -> DPOObjective (reference: the starting policy)
    Prompts         + GRPOOptions -> GRPOObjective with a SampledRollout (mode "sync"), or with a
                                     ScheduledRollout: RolloutScheduler + PromptSource on a
                                     NativeRolloutServer (mode "async", scheduled.py)

A builder returns `Built(objective, dataset, rollout, eval_every)`; the caller picks the optimizer
and key, makes the Trainer and fits it, then calls `Built.close()` (which stops an async stage's
server and scheduler). Given a `StageWriter`, a GRPO stage records every session it drew in the
run store (sync: `RecordedRollout`; async: every SchedulerRecord and settled session), with the
programs a code reward ran as Verdict rows when `verdicts` turns them into rows.

Options are frozen keyword-only dataclasses checked on construction; every refusal names the
field. Flow-matching and Flow-GRPO stages are built in flow.py.

Not here: optimizers, keys, Trainer.fit and resume (the callers), data specs from files or
manifests (the caller makes the spec), Prefect (tasks/ and flows/ wrap this).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dew_lib.data import ChatMessages, Dataset, PreferencePairs, Prompts
from dew_lib.data.chat import Role
from dew_lib.objectives import DPOObjective, GRPOObjective, LMObjective
from dew_lib.options import choice, integer, number
from dew_lib.recipes.scheduled import ScheduledRollout
from dew_lib.rollouts import SampledRollout
from dew_lib.sampling import Sampling

Verdicts = Callable[[Sequence[Any]], Sequence[Any]]  # a reward's program runs -> Verdict rows
MODES = ("sync", "async")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTOptions:
    """batch: rows per step. eval_every: steps between validations (None: never; the spec's
    validation split is read only when this is set)."""

    batch: int
    eval_every: int | None = None

    def __post_init__(self):
        integer("SFTOptions.batch", self.batch)
        integer("SFTOptions.eval_every", self.eval_every, optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOOptions:
    """batch: pairs per step. beta: the scale of the log-ratio to the reference. nll_weight:
    weight of the chosen answers' NLL added to the DPO loss (RPO; 0 is plain DPO)."""

    batch: int
    beta: float = 0.1
    nll_weight: float = 0.0

    def __post_init__(self):
        integer("DPOOptions.batch", self.batch)
        number("DPOOptions.beta", self.beta, above=0)
        number("DPOOptions.nll_weight", self.nll_weight, at_least=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOOptions:
    """One GRPO stage. The response budget and the spec's `max_prompt_len` fix the row width.

    batch: prompts per step. groups: completions per prompt. max_new_tokens: response budget.
    beta: KL coefficient to the frozen starting policy. temperature: the rollouts' sampling
    temperature (0: greedy; the objective then scores at temperature 1). eos_id: the id (or ids)
    that end a completion, or None.
    mode: "sync" draws each batch on the trainer's device before its update (SampledRollout);
    "async" draws `ahead` batches early on a NativeRolloutServer with `slots` requests, through
    the RolloutScheduler with `max_lag`, `sync_every`, `oversample`, `max_attempts` and
    `timeout`, and the objective caps the proximal over behavior ratio at `behavior_importance`
    (TIS). The async fields are ignored in sync mode.
    """

    batch: int
    groups: int = 4
    max_new_tokens: int = 16
    beta: float = 0.0
    temperature: float = 1.0
    eos_id: int | tuple[int, ...] | None = None
    mode: str = "sync"
    ahead: int = 1
    max_lag: int = 1
    sync_every: int = 1
    oversample: int = 0
    max_attempts: int = 3
    timeout: float | None = None
    slots: int = 32
    behavior_importance: float = 2.0

    def __post_init__(self):
        integer("GRPOOptions.batch", self.batch)
        integer("GRPOOptions.groups", self.groups, at_least=2,
                accepts="an integer >= 2 (group-relative advantages compare each completion with "
                        "the others drawn for its prompt)")
        integer("GRPOOptions.max_new_tokens", self.max_new_tokens)
        number("GRPOOptions.beta", self.beta, at_least=0)
        number("GRPOOptions.temperature", self.temperature, at_least=0)
        for eos in self.eos_id if isinstance(self.eos_id, tuple) else (self.eos_id,):
            integer("GRPOOptions.eos_id", eos, at_least=0, optional=self.eos_id is None)
        choice("GRPOOptions.mode", self.mode, MODES)
        integer("GRPOOptions.ahead", self.ahead, at_least=0)
        integer("GRPOOptions.max_lag", self.max_lag, at_least=0)
        integer("GRPOOptions.sync_every", self.sync_every)
        integer("GRPOOptions.oversample", self.oversample, at_least=0)
        integer("GRPOOptions.max_attempts", self.max_attempts)
        number("GRPOOptions.timeout", self.timeout, above=0, optional=True)
        integer("GRPOOptions.slots", self.slots)
        number("GRPOOptions.behavior_importance", self.behavior_importance, at_least=1,
               accepts="a number >= 1 (a TIS cap below 1 would shrink every on-policy token)")
        if self.mode == "async" and self.max_lag < self.ahead + self.sync_every - 1:
            raise ValueError(f"GRPOOptions.max_lag={self.max_lag} is below ahead + sync_every - 1 = "
                             f"{self.ahead + self.sync_every - 1}; rollouts that old would always "
                             "be discarded")

    @property
    def sampling_temperature(self) -> float:
        """The temperature the objective scores sampled ids at (1 for greedy draws)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Built:
    """What a builder returns: give objective and rollout to a Trainer, fit it on dataset with
    eval_every, then `close()`."""

    objective: Any
    dataset: Dataset
    rollout: Any = None
    eval_every: int | None = None

    def close(self) -> None:
        """Stop what the rollout runs (an async stage's scheduler, source and server)."""
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()


class RecordedRollout:
    """Runs a SampledRollout and writes every session it drew to the run store, with the verdict
    of every program a code reward ran for it (the rollout's `last_reward_details`), and the
    prompt of every task it has not recorded yet (`prompts`: the rollout's `last_tasks`, decoded
    with its `decode`), under the same update.

    writer: the stage's `dew_lib.store.StageWriter`. verdicts: a reward's program runs -> Verdict
    rows, or None to record sessions without verdicts.
    """

    def __init__(self, rollout: SampledRollout, writer, verdicts: Verdicts | None = None):
        self.rollout, self.stage, self.verdicts = rollout, writer, verdicts

    def __call__(self, state, batch, key):
        started = time.perf_counter()
        packed = self.rollout(state, batch, key)
        seconds = time.perf_counter() - started
        sessions = self.rollout.last_sessions
        runs = self.rollout.last_reward_details
        update = int(jax.device_get(state.updates))
        verdicts = self.verdicts
        self.stage.prompts(self.rollout.last_tasks, update=update, decode=self.rollout.decode)
        self.stage.sessions(sessions, update=update, latencies=[seconds] * len(sessions),
                            causes="admitted", truncation="score",
                            verdicts=[verdicts(r or ()) for r in runs] if runs and verdicts else None)
        return packed


def build_sft(model, variables, data: ChatMessages, options: SFTOptions) -> Built:
    """SFT on the assistant turns of `data`, starting from `variables` (None: a fresh init)."""
    objective = LMObjective(model, data.seq_len, pretrained=variables, loss_role=Role.ASSISTANT,
                            ema_decay=None)
    return Built(objective=objective, dataset=data.load(batch=options.batch),
                 eval_every=options.eval_every)


def build_dpo(model, variables, data: PreferencePairs, options: DPOOptions) -> Built:
    """DPO on `data` against the frozen `variables` (None: a fresh init)."""
    objective = DPOObjective(model, data.seq_len - 1, beta=options.beta, pretrained=variables,
                             nll_weight=options.nll_weight)
    return Built(objective=objective, dataset=data.load(batch=options.batch))


def build_grpo(model, variables, data: Prompts, options: GRPOOptions, *,
               reward: Callable[[str, str, str, str], float],
               decode: Callable[[Sequence[int]], str] | None = None,
               reward_details: Callable[[], Any] | None = None,
               writer=None, verdicts: Verdicts | None = None, server=None) -> Built:
    """GRPO on the prompts of `data` graded by `reward`, from the frozen `variables`.

    decode: sampled ids -> the text `reward` reads (None: the rollouts' token-id text).
    reward_details: the reward's record of the latest call on the calling thread (e.g.
    CodeReward.last_runs), or None. writer: the stage's `dew_lib.store.StageWriter`, to record
    sessions (and, async, scheduler records) in the run store; None records nothing.
    verdicts: turns reward_details' program runs into the store's Verdict rows. server: async
    only, `sampling -> RolloutServer` for a remote engine (`remote_server`; None: the native server).
    """
    if server is not None and options.mode != "async":
        raise ValueError("a remote rollout server draws ahead of the trainer: it needs GRPOOptions.mode='async'")
    if options.mode == "async":
        scheduled = ScheduledRollout(options, model, variables, reward, max_prompt_len=data.max_prompt_len,
                                     decode=decode, reward_details=reward_details, writer=writer,
                                     verdicts=verdicts, server=server)
        try:
            dataset = scheduled.dataset(data.load(batch=options.batch))
        except BaseException:
            scheduled.close()  # the server and the source's threads are already running
            raise
        return Built(objective=scheduled.objective, dataset=dataset, rollout=scheduled)
    objective = GRPOObjective(model, data.max_prompt_len + options.max_new_tokens - 1,
                              beta=options.beta, pretrained=variables,
                              sampling_temperature=options.sampling_temperature)
    decoded = {} if decode is None else {"decode": decode}
    rollout = SampledRollout(
        objective, reward=reward, groups=options.groups, max_new_tokens=options.max_new_tokens,
        sampling=Sampling(temperature=options.temperature, eos_id=options.eos_id),
        reward_details=reward_details, **decoded)
    dataset = data.load(batch=options.batch)
    if writer is not None:
        rollout = RecordedRollout(rollout, writer, verdicts)
    return Built(objective=objective, dataset=dataset, rollout=rollout)


__all__ = ["Built", "DPOOptions", "GRPOOptions", "RecordedRollout", "SFTOptions", "build_dpo",
           "build_grpo", "build_sft"]
