"""Recipe: SFT, DPO and GRPO stages run one after another on one decoder.

Each `Stage` names a directory, a data spec and its options; the spec's type picks the objective
and the options class it takes:

    ChatMessages     + SFTOptions   -> LMObjective counting assistant targets (SFT)
    PreferencePairs  + DPOOptions   -> DPOObjective (or the family member `loss_type` names)
    UnpairedExamples + DPOOptions   -> KTOObjective (`loss_type="kto"`, the one loss that reads them)
    Prompts          + GRPOOptions  -> GRPOObjective with a SampledRollout (or, mode "async", a
                                       ScheduledRollout on the native server)

A stage starts a fresh optimizer and step counter from the previous stage's final policy
(the first stage from the Recipe's `pretrained` variables, or a fresh init); DPO and GRPO freeze
that starting policy as their reference. A stage whose directory already holds a checkpoint
continues from it, and one that already reached its steps restores without training, so a
rerun of a finished chain only reloads. The stage name only labels the directory. A stage whose
options ask for LoRA adapters (`lora.rank`) trains them on its starting policy, and the next
stage starts from the policy with them folded in.

The options are the same models the pipeline's forms are made of (options.py), so every choice
the pipeline offers (policy loss, aggregation, KL estimator, advantage estimator, the schedule)
is a Stage's too, and each stage's optimizer comes from its options unless the Recipe gives one.
For a decoded-text reward or stop tokens, build the stage with `build_grpo` (build.py) and a
Trainer yourself: a Recipe's GRPO stages read rewards on token-id text and stop at the budget.

Not here: a command line (the Prefect flows in flows/ are the runnable pipeline), evaluation
between stages.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from dew_lib.data.chat_messages import ChatMessages
from dew_lib.data.preference import PreferencePairs
from dew_lib.data.prompts import Prompts
from dew_lib.data.unpaired import UnpairedExamples
from dew_lib.models import lora
from dew_lib.recipes.build import Built, build_dpo, build_grpo, build_sft
from dew_lib.recipes.options import DPOOptions, GRPOOptions, SFTOptions, optimizer
from dew_lib.train.trainer import Trainer, TrainState

DataSpec = ChatMessages | PreferencePairs | UnpairedExamples | Prompts
ADAPTERS = 1  # folded into a stage's key for its adapters' draw (the Trainer's is the stage key itself)


OPTIONS = {"sft": SFTOptions, "dpo": DPOOptions, "grpo": GRPOOptions}  # what each kind's stage reads
KINDS = {ChatMessages: "sft", PreferencePairs: "dpo", UnpairedExamples: "dpo", Prompts: "grpo"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of a chain.

    name: the stage's directory under the Recipe's directory. data: the loader spec whose type
    picks the objective. options: that kind's options (options.py: SFTOptions, DPOOptions or
    GRPOOptions), which give its steps, batch, optimizer, logging and checkpoints as well as the
    algorithm's choices. reward: GRPO's reward callable, which reads token-id text.
    """

    name: str
    data: DataSpec
    options: SFTOptions | DPOOptions | GRPOOptions
    reward: Callable[[str, str, str, str], float] | None = None

    def __post_init__(self):
        if not self.name or os.sep in self.name or self.name in (".", ".."):
            raise ValueError(f"Stage.name must be a plain directory name, got {self.name!r}")
        if type(self.data) not in KINDS:
            raise TypeError(
                f"Stage {self.name!r}: data must be ChatMessages (SFT), PreferencePairs (DPO), "
                f"UnpairedExamples (KTO) or Prompts (GRPO), got {type(self.data).__name__}"
            )
        wanted = OPTIONS[self.kind]
        if type(self.options) is not wanted:
            raise TypeError(f"Stage {self.name!r} trains {self.kind.upper()} on {type(self.data).__name__}, so "
                            f"its options are {wanted.__name__}, got {type(self.options).__name__}")
        unpaired = isinstance(self.data, UnpairedExamples) and isinstance(self.options, DPOOptions)
        if unpaired and self.options.loss_type != "kto":
            raise ValueError(f"Stage {self.name!r} trains on UnpairedExamples, which only DPOOptions.loss_type='kto' "
                             f"reads; got loss_type={self.options.loss_type!r}")
        if self.kind == "grpo" and self.reward is None:
            raise ValueError(f"Stage {self.name!r} trains GRPO on Prompts and needs a reward")

    @property
    def kind(self) -> str:
        return KINDS[type(self.data)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Stages trained in order on one decoder; `run()` returns each stage's final state.

    model: the decoder every stage trains. key: seeds every stage (folded with its index).
    directory: the run directory; each stage checkpoints under directory/<name>. pretrained: the
    variables the first stage starts from (None: a fresh init). optimizer: one optax
    transformation every stage starts fresh (None: each stage's own, from its options).
    """

    model: Any
    key: jax.Array
    directory: str | os.PathLike
    stages: Sequence[Stage]
    pretrained: Any = None
    optimizer: optax.GradientTransformation | None = None

    def __post_init__(self):
        names = [stage.name for stage in self.stages]
        if not names:
            raise ValueError("Recipe.stages is empty; give at least one Stage")
        if len(set(names)) != len(names):
            raise ValueError(f"Recipe stage names must be distinct (they name directories), got {names}")

    def build(self, stage: Stage, start: Any, index: int = 0) -> Built:
        """The objects of the `index`th stage (objective, loaded data, rollout), starting from
        `start`; its adapters, if it trains any, are drawn from the Recipe's key and `index`."""
        key = jax.random.fold_in(jax.random.fold_in(self.key, index), ADAPTERS)
        data, options = stage.data, stage.options  # paired by Stage's checks
        if isinstance(data, ChatMessages) and isinstance(options, SFTOptions):
            return build_sft(self.model, start, data, options, key=key)
        if isinstance(data, PreferencePairs | UnpairedExamples) and isinstance(options, DPOOptions):
            return build_dpo(self.model, start, data, options, key=key)
        if isinstance(data, Prompts) and isinstance(options, GRPOOptions) and stage.reward is not None:
            return build_grpo(self.model, start, data, options, reward=stage.reward, key=key)
        raise TypeError(f"Stage {stage.name!r}: {type(data).__name__} with {type(options).__name__} is no stage")

    def trainer(self, index: int, stage: Stage, start: Any, built: Built | None = None) -> Trainer:
        """The Trainer for one stage, starting from the variables `start` (from `built` when
        given, else from `build(stage, start)`, which also loads the stage's data)."""
        built = self.build(stage, start, index) if built is None else built
        key = jax.random.fold_in(self.key, index)
        chosen = optimizer(stage.options) if self.optimizer is None else self.optimizer
        return Trainer(built.objective, chosen, key=key, rollout=built.rollout)

    def run(self, sinks_for: Callable[[Stage], Sequence[Any]] | None = None) -> list[TrainState]:
        """Train every stage in order; `sinks_for(stage)` picks each stage's metric sinks."""
        states: list[TrainState] = []
        start = self.pretrained
        for index, stage in enumerate(self.stages):
            built = self.build(stage, start, index)
            try:
                state = self.trainer(index, stage, start, built).fit(
                    built.dataset, steps=stage.options.steps, log_every=stage.options.log_every,
                    eval_every=built.eval_every,
                    directory=os.path.join(os.fspath(self.directory), stage.name),
                    checkpoint_every=stage.options.checkpoint_every,
                    sinks=None if sinks_for is None else sinks_for(stage),
                )
            finally:
                built.close()  # an async stage's server and scheduler
            states.append(state)
            start = lora.merged(built.model, state.params)[1]  # adapters folded into their kernels
        return states
