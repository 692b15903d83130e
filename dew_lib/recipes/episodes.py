"""GRPO on tool episodes: a stage's options, its prompts and an environment in, objects out.

    Prompts + GRPOOptions + EpisodeOptions + environment + verifier
        mode "sync":  GRPOObjective with an EpisodeRollout sampling every turn on the trainer's
                      device (RecordedEpisodes writes each episode and its turns to the store)
        mode "async": GRPOObjective with a ScheduledRollout whose source is an EnvironmentSource
                      on the native rollout server (scheduled.py)
    ... + PPOOptions: PPOObjective (a ValueHead critic on a copy of the starting policy) with a
                      PPORollout over the EpisodeRollout (sync only)

`OneTurn` makes a prompt a one-turn episode, so one-turn tasks train through PPO too.

Each prompt row is a task (`Prompts(row_ids=True)`: its row is its id); its data reaches the
environment and the verifier (sync: the batch's columns; async: `prompt_tasks`' layout, the
prompt ids as `prompt_ids` and the reward fields as text). Rows are `max_context +
max_new_tokens` ids wide, one per task, sample and turn.

Not here: one-turn GRPO (build.py), the episode loop and its records (dew_lib.rollouts).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from dew_lib.data import Prompts
from dew_lib.inference import TextGeneration
from dew_lib.objectives import GRPOObjective, PPOObjective, ValueHead
from dew_lib.objectives.ppo import critic_from_policy
from dew_lib.options import integer, number
from dew_lib.recipes.build import Built, GRPOOptions
from dew_lib.recipes.scheduled import ScheduledRollout
from dew_lib.records.episodes import EnvironmentFactory, Observation, Verifier
from dew_lib.rollouts import EnvironmentSource, EpisodeRollout, PPORollout, prompt_tasks
from dew_lib.sampling import Sampling


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeOptions:
    """max_turns: model turns per episode. max_context: the longest context a turn reads (a
    longer one truncates the episode). workers: threads stepping environments at once."""

    max_turns: int
    max_context: int
    workers: int = 8

    def __post_init__(self):
        integer("EpisodeOptions.max_turns", self.max_turns)
        integer("EpisodeOptions.max_context", self.max_context)
        integer("EpisodeOptions.workers", self.workers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOOptions:
    """PPO with a critic on the episodes: a ValueHead on a copy of the starting policy.
    value_coefficient, value_clip: PPOObjective's. gamma, lam, epochs, minibatches: PPORollout's."""

    value_coefficient: float = 0.5
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    epochs: int = 1
    minibatches: int = 1

    def __post_init__(self):
        number("PPOOptions.value_coefficient", self.value_coefficient, at_least=0)
        number("PPOOptions.value_clip", self.value_clip, above=0)
        integer("PPOOptions.epochs", self.epochs)
        integer("PPOOptions.minibatches", self.minibatches)


class OneTurn:
    """A prompt as a one-turn episode: the context is the task's prompt ids, and the policy's
    reply ends it (the verifier grades it), so one-turn prompts train through the episode
    path (PPO's GAE and critic). An environment factory: `OneTurn(task, identity)`."""

    def __init__(self, task, identity):
        self.data = task.data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def reset(self) -> Observation:
        if "prompt_ids" in self.data:  # prompt_tasks' layout
            return Observation(self.data["prompt_ids"])
        prompt, length = np.asarray(self.data["prompt"]), int(self.data["prompt_length"])
        return Observation(prompt[prompt.size - length:])

    def step(self, action) -> Observation:
        return Observation(status="completed", detail="answered")


class RecordedEpisodes:
    """Runs an EpisodeRollout (or a PPORollout over one) and writes each collection's episodes
    to the run store under the update that first trains them: its task's prompt (first time
    only), its session with the calls, and its turns."""

    def __init__(self, rollout, writer, decode=None):
        self.rollout, self.stage, self.decode = rollout, writer, decode
        self.episodes: EpisodeRollout = getattr(rollout, "episodes", rollout)
        self._recorded: Any = None  # the collection written last

    def __call__(self, state, batch, key):
        started = time.perf_counter()
        packed = self.rollout(state, batch, key)
        seconds = time.perf_counter() - started
        results = self.episodes.last_results
        if results is self._recorded:  # a PPO pass over a collection already written
            return packed
        self._recorded = results
        update = int(jax.device_get(state.updates))
        self.stage.prompts(prompt_tasks(batch), update=update, decode=self.decode)
        self.stage.sessions([r.session for r in results], update=update,
                            latencies=[seconds] * len(results), causes="admitted", truncation="mask",
                            episodes=[r.episode for r in results])
        return packed


def build_episode_grpo(model, variables, data: Prompts, options: GRPOOptions, episodes: EpisodeOptions, *,
                       environment: EnvironmentFactory, verifier: Verifier, decode=None,
                       writer=None, ppo: PPOOptions | None = None, server=None) -> Built:
    """GRPO (or, given `ppo`, PPO with a critic) over tool episodes of `data`'s prompts, from the
    frozen `variables`.

    environment: `(task, identity) -> Environment`; verifier: `(task, episode) -> reward`.
    decode: prompt ids -> text for the store. writer: the stage's StageWriter (None: nothing
    recorded); async records its scheduler records and sessions, sync also each turn. ppo: runs
    synchronously; the built objective's params are `{"policy", "critic"}`. server: async only,
    `sampling -> RolloutServer` for a remote engine (`remote_server`; None: the native server).
    """
    if options.eos_id is None:
        raise ValueError("GRPOOptions.eos_id is None; a tool episode's turn ends at EOS, so give the "
                         "tokenizer's end-of-turn id")
    data = dataclasses.replace(data, row_ids=True)
    if server is not None and (options.mode != "async" or ppo is not None):
        raise ValueError("a remote rollout server draws ahead of the trainer: it needs GRPOOptions.mode='async' "
                         "(and GRPO, not PPO)")
    if ppo is not None:
        if options.mode != "sync":
            raise ValueError("PPO on episodes runs with GRPOOptions.mode='sync': its targets need the "
                             "critic at the weights that sampled")
        return _episode_ppo(model, variables, data, options, episodes, ppo, environment=environment,
                            verifier=verifier, decode=decode, writer=writer)
    width = episodes.max_context + options.max_new_tokens
    sampling = Sampling(temperature=options.temperature, eos_id=options.eos_id)
    if options.mode == "async":
        def source(server: Any) -> EnvironmentSource:
            return EnvironmentSource(server, environment, verifier, max_prompt_tokens=episodes.max_context,
                                     max_new_tokens=options.max_new_tokens, max_turns=episodes.max_turns,
                                     workers=episodes.workers, keep_episodes=writer is not None)

        scheduled = ScheduledRollout(options, model, variables, max_prompt_len=episodes.max_context,
                                     decode=decode, writer=writer, source=source, truncation="mask",
                                     server=server)
        try:
            dataset = scheduled.dataset(data.load(batch=options.batch))
        except BaseException:
            scheduled.close()
            raise
        return Built(objective=scheduled.objective, dataset=dataset, rollout=scheduled)
    objective = GRPOObjective(model, width - 1, beta=options.beta, pretrained=variables,
                              sampling_temperature=options.sampling_temperature)
    rollout = EpisodeRollout(TextGeneration(model, pad_id=data.pad_id), environment, verifier,
                             max_prompt_tokens=episodes.max_context, max_new_tokens=options.max_new_tokens,
                             max_turns=episodes.max_turns, groups=options.groups, sampling=sampling,
                             workers=episodes.workers)
    if writer is not None:
        rollout = RecordedEpisodes(rollout, writer, decode)
    return Built(objective=objective, dataset=data.load(batch=options.batch), rollout=rollout)


def _episode_ppo(model, variables, data: Prompts, options: GRPOOptions, episodes: EpisodeOptions,
                 ppo: PPOOptions, *, environment, verifier, decode, writer) -> Built:
    width = episodes.max_context + options.max_new_tokens
    critic = ValueHead(model)
    objective = PPOObjective(model, width - 1, critic=critic, beta=options.beta, pretrained=variables,
                             critic_variables=critic_from_policy(critic, variables, width - 1),
                             value_coefficient=ppo.value_coefficient, value_clip=ppo.value_clip,
                             sampling_temperature=options.sampling_temperature)
    sampled = EpisodeRollout(objective.policy(pad_id=data.pad_id), environment, verifier,
                             max_prompt_tokens=episodes.max_context, max_new_tokens=options.max_new_tokens,
                             max_turns=episodes.max_turns, groups=options.groups,
                             sampling=Sampling(temperature=options.temperature, eos_id=options.eos_id),
                             workers=episodes.workers)
    rollout = PPORollout(objective, sampled, gamma=ppo.gamma, lam=ppo.lam, epochs=ppo.epochs,
                         minibatches=ppo.minibatches)
    if writer is not None:
        rollout = RecordedEpisodes(rollout, writer, decode)
    return Built(objective=objective, dataset=data.load(batch=options.batch), rollout=rollout)


__all__ = ["EpisodeOptions", "OneTurn", "PPOOptions", "RecordedEpisodes", "build_episode_grpo"]
