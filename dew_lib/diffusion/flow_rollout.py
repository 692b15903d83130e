"""FlowRollout: sample Flow-GRPO's groups, score them, and hand the Trainer their transitions.

`FlowRollout` (the Trainer's rollout hook) repeats every source row `groups` times, samples
each copy's path with the objective's `FlowSDE`, decodes the final states to images in [-1, 1],
scores them with the reward on the host, and turns the scores into group-relative advantages
(`group_statistics`: population standard deviation plus 1e-4, float64 until the float32
advantages, as Flow-GRPO's per-prompt tracker computes them). It returns the first
`train_steps` transitions of every path:

    latents, next_latents      [N, K, *latent]   float32   the state before / after transition k
    timesteps, next_timesteps  [N, K]            float32
    old_log_probs              [N, K]            float32   joint log density at sampling time
    transition_mask            [N, K]            bool      stochastic and advantage != 0
    advantages                 [N]               float32
    rewards                    [N]               float64   (a diagnostic on the device)
    the condition fields       [N, *shape]                 repeated with their groups

In a multi-process job every process draws the job's whole batch from the same key (its sources
gathered from every process), exactly what one process would draw on the same global devices,
then scores and normalizes its own groups, which never cross processes. `records` sees each
process's own rows, on that process. Drawing is repeated on every process: more processes train
faster but sample no faster.

Not here: the loss (`FlowGRPOObjective`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from dew_lib.diffusion.flow_grpo import GROUP_EPSILON, FlowGRPOObjective, FlowReward
from dew_lib.diffusion.preview import Preview, ensure_sequence, score
from dew_lib.options import group_size
from dew_lib.train.distributed import gather_rows, own_rows


def group_statistics(rewards: np.ndarray, groups: int):
    """Group-relative advantages of contiguous groups: `(mean, std, advantages)`, float64 `[N]`.

    std is the population standard deviation (ddof 0); advantages are
    `(reward - mean) / (std + 1e-4)`, as Flow-GRPO's PerPromptStatTracker computes them.
    """
    rewards = np.asarray(rewards, np.float64)
    by_group = rewards.reshape(-1, groups)
    mean = by_group.mean(axis=1, keepdims=True)
    std = by_group.std(axis=1, keepdims=True)
    advantages = (by_group - mean) / (std + GROUP_EPSILON)

    def spread(a):
        return np.broadcast_to(a, by_group.shape).reshape(-1)

    return spread(mean), spread(std), advantages.reshape(-1)


@dataclasses.dataclass(frozen=True)
class FlowRolloutRecord:
    """One rollout on the host: every sample's image, reward and group statistics.

    images float32 `[N, H, W, C]` in [-1, 1]; group int `[N]` (the source row); rewards,
    group_mean, group_std float64 `[N]`; advantages float32 `[N]`; kept bool `[N]` (advantage
    != 0, so the row's transitions train); captions one per sample; step: updates before it.
    """

    step: int
    images: np.ndarray
    group: np.ndarray
    rewards: np.ndarray
    group_mean: np.ndarray
    group_std: np.ndarray
    advantages: np.ndarray
    kept: np.ndarray
    captions: tuple[str, ...]

    def rows(self) -> list[dict[str, Any]]:
        """One plain dict per sample (for a table or a run store)."""
        return [
            {"step": self.step, "sample": i, "group": int(self.group[i]), "reward": float(self.rewards[i]),
             "group_mean": float(self.group_mean[i]), "group_std": float(self.group_std[i]),
             "advantage": float(self.advantages[i]), "kept": bool(self.kept[i]), "caption": self.captions[i]}
            for i in range(len(self.rewards))
        ]

    def preview(self) -> Preview:
        """The rollout's samples with their rewards; `.png()` renders them."""
        return Preview(self.images, self.captions, self.rewards, self.step)


@dataclasses.dataclass
class FlowRollout:
    """Collect complete prompt groups and the first `train_steps` transitions (a Trainer rollout).

    groups: samples per source row (>= 2). steps: time points of a rollout path, both ends
    included (steps=11 draws ten transitions). train_steps: how many of the first transitions
    to train on (None: all). records: optional `FlowRolloutRecord -> None` called after every
    rollout (a flow stores the rewards and renders previews there); the latest record is also
    kept as `.last`.
    """

    objective: FlowGRPOObjective
    reward: FlowReward
    groups: int = 4
    steps: int = 11
    train_steps: int | None = None
    records: Callable[[FlowRolloutRecord], None] | None = None

    def __post_init__(self):
        if not isinstance(self.objective, FlowGRPOObjective):
            raise TypeError(f"FlowRollout.objective must be a FlowGRPOObjective, got "
                            f"{type(self.objective).__name__}")
        if not callable(self.reward):
            raise TypeError(f"FlowRollout.reward must be callable (images, batch) -> [N], got "
                            f"{self.reward!r}")
        self.groups = group_size("FlowRollout.groups", self.groups)
        if self.steps < 2:
            raise ValueError(f"FlowRollout.steps counts time points including both ends and must be >= 2, "
                             f"got {self.steps}")
        transitions = self.steps - 1
        if self.train_steps is not None and not 1 <= self.train_steps <= transitions:
            raise ValueError(
                f"FlowRollout.train_steps={self.train_steps} must be between 1 and the {transitions} "
                f"transitions that steps={self.steps} draws (or None for all)"
            )
        selected = self.train_steps or transitions
        times = np.asarray(self.objective.process.times(self.steps))[:selected]
        if not np.any(np.asarray(self.objective.sde.stochastic(times))):
            raise ValueError(
                f"none of the first {selected} transitions (start times {np.round(times, 4).tolist()}) "
                f"is stochastic under {self.objective.sde}; widen FlowSDE.window, raise noise_level "
                "or select more train_steps"
            )
        self.last: FlowRolloutRecord | None = None
        self._compiled: dict = {}

    def _sampler(self, rows: int, conditions: Mapping[str, np.ndarray]):
        signature = (rows, tuple((k, v.shape, v.dtype.name) for k, v in conditions.items()))
        if signature not in self._compiled:
            objective, steps = self.objective, self.steps

            def draw(params, conditions, key):
                path = objective.denoiser.trajectory(params, conditions, key, rows=rows, steps=steps,
                                                     guidance=objective.guidance, sde=objective.sde)
                return path, objective.denoiser.decode(path.final)

            self._compiled[signature] = jax.jit(draw)
        return self._compiled[signature]

    def __call__(self, state, batch: Mapping[str, Any], key: jax.Array) -> dict[str, np.ndarray]:
        objective, groups = self.objective, self.groups
        sources = objective.inputs.check(batch)
        rows = sources * groups
        # Every process draws the job's whole batch (a no-op gather in one process), exactly what
        # one process would draw on the same global devices, and keeps its own groups.
        everyone = {k: np.repeat(gather_rows(np.asarray(v)), groups, axis=0) for k, v in batch.items()}
        conditions = objective.inputs.condition_batch(everyone)
        path, images = self._sampler(rows * jax.process_count(), conditions)(state.params, conditions, key)
        (states, times, log_probs, stochastic, images), step = jax.device_get(
            ((path.states, path.times, path.log_probs, path.stochastic, images), state.updates))
        states, log_probs, stochastic, images = (own_rows(x, rows) for x in (states, log_probs, stochastic, images))
        source = {k: own_rows(v, rows) for k, v in everyone.items()}  # contiguous groups
        conditions = {k: own_rows(v, rows) for k, v in conditions.items()}
        images = np.asarray(images, np.float32)
        rewards = score(self.reward, images, source, rows)  # float64 from here to the advantages
        mean, std, advantages = group_statistics(rewards, groups)
        advantages = advantages.astype(np.float32)
        kept = advantages != 0
        k = self.train_steps or (self.steps - 1)
        out = {
            "latents": states[:, :k],
            "next_latents": states[:, 1:k + 1],
            "timesteps": np.broadcast_to(times[:k], (rows, k)).astype(np.float32),
            "next_timesteps": np.broadcast_to(times[1:k + 1], (rows, k)).astype(np.float32),
            "old_log_probs": np.asarray(log_probs[:, :k], np.float32),
            "transition_mask": np.asarray(stochastic[:, :k]) & kept[:, None],
            "advantages": advantages,
            "rewards": rewards,
            **conditions,
        }
        record = FlowRolloutRecord(
            step=int(step), images=images, group=np.repeat(np.arange(sources), groups), rewards=rewards,
            group_mean=mean, group_std=std, advantages=advantages, kept=kept,
            captions=ensure_sequence(objective.inputs.captions(source), rows),
        )
        self.last = record
        if self.records is not None:
            self.records(record)
        return out
