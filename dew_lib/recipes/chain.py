"""Recipe: SFT, DPO and GRPO stages run one after another on one decoder.

Each `Stage` names a directory and a data spec, and the spec's type picks the objective:

    ChatMessages     -> LMObjective counting assistant targets (SFT)
    PreferencePairs  -> DPOObjective
    Prompts          -> GRPOObjective with a SampledRollout

A stage starts a fresh optimizer and step counter from the previous stage's final policy
(the first stage from the Recipe's `pretrained` variables, or a fresh init); DPO and GRPO freeze
that starting policy as their reference. A stage whose directory already holds a checkpoint
continues from it, and one that already reached its steps restores without training, so a
rerun of a finished chain only reloads. The stage name only labels the directory.

The chain exposes the knobs most runs change (beta, reward, groups, max_new_tokens, sample).
For a decoded-text reward, stop tokens or a sampling temperature, build the stage with
`build_grpo` (build.py) and a Trainer yourself: a Recipe's GRPO stages read rewards on token-id
text. Every stage's objects come from the builders in build.py, the same ones the pipeline's
training task uses; the chain only maps a Stage to their options.

Not here: a command line (the Prefect flows in flows/ are the runnable pipeline), evaluation
between stages, learning-rate schedules per stage, asynchronous GRPO (GRPOOptions(mode="async")
with `build_grpo`).
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
from dew_lib.recipes.build import Built, DPOOptions, GRPOOptions, SFTOptions, build_dpo, build_grpo, build_sft
from dew_lib.train.trainer import Trainer, TrainState

DataSpec = ChatMessages | PreferencePairs | Prompts


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of a chain.

    name: the stage's directory under the Recipe's directory. data: the loader spec whose type
    picks the objective. steps: batches to train on. beta: DPO's preference scale, or GRPO's KL
    coefficient. reward, groups, max_new_tokens: GRPO's reward callable, completions per prompt
    and response budget. sample: GRPO draws by sampling at temperature 1 over the whole
    vocabulary when True, greedily when False (useful only to check a pipeline end to end, since
    identical completions carry no group-relative signal). log_every, checkpoint_every: as in
    Trainer.fit.
    """

    name: str
    data: DataSpec
    steps: int
    beta: float = 0.1
    reward: Callable[[str, str, str, str], float] | None = None
    groups: int = 4
    max_new_tokens: int = 16
    sample: bool = True
    log_every: int = 10
    checkpoint_every: int | None = None

    def __post_init__(self):
        if not self.name or os.sep in self.name or self.name in (".", ".."):
            raise ValueError(f"Stage.name must be a plain directory name, got {self.name!r}")
        if not isinstance(self.data, (ChatMessages, PreferencePairs, Prompts)):
            raise TypeError(
                f"Stage {self.name!r}: data must be ChatMessages (SFT), PreferencePairs (DPO) or "
                f"Prompts (GRPO), got {type(self.data).__name__}"
            )
        if self.steps < 1:
            raise ValueError(f"Stage {self.name!r}: steps must be >= 1, got {self.steps}")
        if isinstance(self.data, Prompts) and self.reward is None:
            raise ValueError(f"Stage {self.name!r} trains GRPO on Prompts and needs a reward")

    @property
    def kind(self) -> str:
        return {ChatMessages: "sft", PreferencePairs: "dpo", Prompts: "grpo"}[type(self.data)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Stages trained in order on one decoder; `run()` returns each stage's final state.

    model: the decoder every stage trains. optimizer: the optax transformation each stage starts
    fresh. key: seeds every stage (folded with its index). directory: the run directory; each
    stage checkpoints under directory/<name>. batch: rows per step (prompts per step for GRPO).
    pretrained: the variables the first stage starts from (None: a fresh init).
    """

    model: Any
    optimizer: optax.GradientTransformation
    key: jax.Array
    directory: str | os.PathLike
    batch: int
    stages: Sequence[Stage]
    pretrained: Any = None

    def __post_init__(self):
        names = [stage.name for stage in self.stages]
        if not names:
            raise ValueError("Recipe.stages is empty; give at least one Stage")
        if len(set(names)) != len(names):
            raise ValueError(f"Recipe stage names must be distinct (they name directories), got {names}")

    def build(self, stage: Stage, start: Any) -> Built:
        """The objects of one stage (objective, loaded data, rollout), starting from `start`."""
        if stage.kind == "sft":
            return build_sft(self.model, start, stage.data, SFTOptions(batch=self.batch))
        if stage.kind == "dpo":
            return build_dpo(self.model, start, stage.data, DPOOptions(batch=self.batch, beta=stage.beta))
        options = GRPOOptions(batch=self.batch, groups=stage.groups, max_new_tokens=stage.max_new_tokens,
                              beta=stage.beta, temperature=1.0 if stage.sample else 0.0)
        return build_grpo(self.model, start, stage.data, options, reward=stage.reward)

    def trainer(self, index: int, stage: Stage, start: Any, built: Built | None = None) -> Trainer:
        """The Trainer for one stage, starting from the variables `start` (from `built` when
        given, else from `build(stage, start)`, which also loads the stage's data)."""
        built = self.build(stage, start) if built is None else built
        key = jax.random.fold_in(self.key, index)
        return Trainer(built.objective, self.optimizer, key=key, rollout=built.rollout)

    def run(self, sinks_for: Callable[[Stage], Sequence[Any]] | None = None) -> list[TrainState]:
        """Train every stage in order; `sinks_for(stage)` picks each stage's metric sinks."""
        states: list[TrainState] = []
        start = self.pretrained
        for index, stage in enumerate(self.stages):
            built = self.build(stage, start)
            trainer = self.trainer(index, stage, start, built)
            state = trainer.fit(
                built.dataset, steps=stage.steps, log_every=stage.log_every,
                eval_every=built.eval_every,
                directory=os.path.join(os.fspath(self.directory), stage.name),
                checkpoint_every=stage.checkpoint_every,
                sinks=None if sinks_for is None else sinks_for(stage),
            )
            states.append(state)
            start = state.params
        return states
