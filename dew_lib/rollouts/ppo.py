"""PPORollout: tool episodes with a critic's targets, the Trainer's rollout for PPOObjective.

Each call collects a batch of episodes with the wrapped `EpisodeRollout` (its policy is
`objective.policy()`, so it binds the policy part of the Trainer's snapshot), packs them, and
prepares PPO's targets:

  1. the critic's value of every sampled id's state, read from the packed rows (`old_values`);
  2. each episode's sampled ids in draw order (turn by turn, across chains and rows), its
     verifier reward on the last one, and GAE along that sequence with `gamma` and `lam`
     (observations are not in it; the tail bootstraps from 0, an ended episode has no future);
  3. the advantages whitened over every sampled id of the batch (unbiased variance), the
     returns taken before whitening: `returns = advantages + old_values`.

In a multi-process job each process collects, values and packs its own task rows (its critic
read from its own copy of the weights), and the GAE sequences of every process are gathered for
step 3, so the batch whitened is the job's, as in one process. Minibatches are cut from each
process's own rows (every process shuffles its rows with the same key).

Truncated and failed episodes are masked by the packer and take no part. A batch with exactly
one sampled id is refused (its variance is undefined); one with none gets zero targets, so the
update has no gradient. GAE runs compiled at one shape per rollout: `[episodes, max_turns *
max_new_tokens]`.

Several updates per collection (`epochs`, `minibatches`): the prepared rows are kept and handed
to the Trainer as `epochs` passes of `minibatches` equal slices (rows shuffled per epoch with
the collection's key), one slice per Trainer step, before the next collection. Every slice
keeps the targets and the recorded proximal log-probs of its collection, so the ratio of every
pass compares with the policy that sampled. A step that trains a kept slice does not read its
task batch, and a run resumed from a checkpoint taken mid-pass collects afresh. With the
defaults (1, 1) each step collects and trains once.

Not here: the loss (`objectives/ppo.py`), the episodes (`episodes.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dew_lib.objectives import algorithms
from dew_lib.objectives.batch import PackedBatch
from dew_lib.options import integer, number
from dew_lib.rollouts.episodes import EpisodeRollout, project
from dew_lib.train.distributed import gather_rows, local_copy, own_rows


class PPORollout:
    """Collect episodes and add `old_values`, `advantages` and `returns` (module docstring)."""

    def __init__(self, objective, episodes: EpisodeRollout, *, gamma: float = 1.0, lam: float = 0.95,
                 epochs: int = 1, minibatches: int = 1):
        if not isinstance(episodes, EpisodeRollout):
            raise TypeError(f"PPORollout.episodes must be an EpisodeRollout, got {type(episodes).__name__}")
        if not callable(getattr(objective, "packed_values", None)):
            raise TypeError("PPORollout.objective must be a PPOObjective (it has a critic)")
        if episodes.width != objective.width:
            raise ValueError(f"the episodes' rows are {episodes.width} ids wide (max_prompt_tokens + "
                             f"max_new_tokens) and the objective reads {objective.width}; build it with "
                             f"seq_len={episodes.width - 1}")
        self.objective, self.episodes = objective, episodes
        self.gamma = number("PPORollout.gamma", gamma, at_least=0)
        self.lam = number("PPORollout.lam", lam, at_least=0)
        if self.gamma > 1 or self.lam > 1:
            raise ValueError(f"PPORollout.gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
        self.epochs = integer("PPORollout.epochs", epochs)
        self.minibatches = integer("PPORollout.minibatches", minibatches)
        self.horizon = episodes.max_turns * episodes.max_new_tokens  # sampled ids an episode holds
        self.kept: list[PackedBatch] = []  # the slices of the last collection not trained yet
        self._values = jax.jit(objective.packed_values)
        self._targets = jax.jit(functools.partial(_targets, gamma=self.gamma, lam=self.lam))

    def __call__(self, state, batch: Mapping[str, Any], key: jax.Array) -> PackedBatch:
        if not self.kept:
            self.kept = self.slices(self.collect(state, batch, key), key)
        return self.kept.pop(0)

    def collect(self, state, batch: Mapping[str, Any], key: jax.Array) -> PackedBatch:
        """One collection of episodes over `batch`'s tasks, packed, with its targets."""
        results = self.episodes.collect(state.params, batch, key, step=int(state.step),
                                        policy_step=int(state.updates))
        rows = self.episodes.rows(len(results) // self.episodes.groups)
        if rows % self.minibatches:
            raise ValueError(f"a collection packs {rows} rows, which {self.minibatches} minibatches do not "
                             "split evenly; choose minibatches dividing tasks x groups x max_turns")
        packed = project(results, width=self.episodes.width, rows=rows, estimator=self.episodes.estimator,
                         truncation=self.episodes.truncation)
        return self.prepare(state.params, packed, episodes=len(results))

    def slices(self, prepared: PackedBatch, key: jax.Array) -> list[PackedBatch]:
        """The Trainer's next `epochs x minibatches` batches from one prepared collection."""
        if self.epochs == self.minibatches == 1:
            return [prepared]
        rows = np.shape(prepared["input_ids"])[0]
        size = rows // self.minibatches
        seed = np.asarray(jax.random.key_data(key)).reshape(-1).tolist()
        out = []
        for epoch in range(self.epochs):
            order = np.random.default_rng([*seed, epoch]).permutation(rows)
            for part in range(self.minibatches):
                chosen = np.sort(order[part * size:(part + 1) * size])
                out.append(jax.tree.map(lambda column, rows=chosen: np.asarray(column)[rows], prepared))
        return out

    def prepare(self, params, packed: PackedBatch, *, episodes: int) -> PackedBatch:
        """`packed` with the critic's targets under `params` (the PPO variables). episodes: how
        many sessions the rows hold (their `session_index` runs below it). In a multi-process
        job every process calls it with its own rows, and the advantages are whitened over the
        job's whole batch, as one process would whiten them."""
        fields = {k: packed[k] for k in ("input_ids", "text_segment_ids", "text_positions")}
        critic = local_copy(self.objective.critic_params(params))  # this process's rows, on its copy
        values = np.asarray(jax.device_get(self._values(critic, fields)), np.float32)
        mask = np.asarray(packed["response_mask"]) > 0
        rows, columns = np.nonzero(mask)
        sequences = _Sequences(episodes, self.horizon)
        if rows.size:
            session = np.asarray(packed["session_index"])[rows, columns]
            call = np.asarray(packed["call_index"])[rows, columns]
            order = np.lexsort((columns, rows, call, session))  # each episode's ids in draw order
            rows, columns = rows[order], columns[order]
            sequences.fill(session[order], values[rows, columns], np.asarray(packed["rewards"])[rows, columns])
        rewards, sequence_values, sequence_mask = (gather_rows(x) for x in sequences.arrays())
        count = int(sequence_mask.sum())
        if count == 1:
            raise ValueError("this batch has exactly one sampled id to train; PPO whitens advantages over "
                             "the batch, which needs at least two (draw more episodes per batch)")
        old_values = np.zeros(mask.shape, np.float32)
        advantages = np.zeros(mask.shape, np.float32)
        returns = np.zeros(mask.shape, np.float32)
        if count:
            whitened, targets = (own_rows(np.asarray(x), episodes)
                                 for x in self._targets(rewards, sequence_values, sequence_mask))
        if rows.size:
            grid = sequences.grid
            old_values[rows, columns] = values[rows, columns]
            advantages[rows, columns] = whitened[grid]
            returns[rows, columns] = targets[grid]
        return packed.replace(old_values=old_values, advantages=advantages, returns=returns)


class _Sequences:
    """Each episode's sampled ids as one row of `[episodes, horizon]` grids: the critic's
    values, a mask, and the verifier's reward on the last id."""

    def __init__(self, episodes: int, horizon: int):
        self.horizon = horizon
        self.values = np.zeros((episodes, horizon), np.float32)
        self.mask = np.zeros((episodes, horizon), np.float32)
        self.rewards = np.zeros((episodes, horizon), np.float32)
        self.grid: tuple[np.ndarray, np.ndarray] = (np.zeros(0, int), np.zeros(0, int))

    def fill(self, session: np.ndarray, values: np.ndarray, rewards: np.ndarray) -> None:
        """Place sampled ids sorted by episode, then draw order (`session`: each id's episode)."""
        count = session.size
        starts = np.searchsorted(session, session, side="left")
        place = np.arange(count) - starts  # position within its episode
        if place.max() >= self.horizon:
            raise ValueError(f"an episode holds {place.max() + 1} sampled ids, more than max_turns x "
                             f"max_new_tokens = {self.horizon}")
        self.grid = (session, place)
        self.values[self.grid] = values
        self.mask[self.grid] = 1.0
        last = np.r_[session[1:] != session[:-1], True]  # the last sampled id of each episode
        self.rewards[session[last], place[last]] = rewards[last]

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.rewards, self.values, self.mask


def _targets(rewards, values, mask, *, gamma: float, lam: float):
    """(whitened advantages, returns) of episode sequences `[E, H]`."""
    advantages, returns = algorithms.gae(rewards, values, mask, gamma, lam)
    return algorithms.masked_whiten(advantages, mask), returns


__all__ = ["PPORollout"]
