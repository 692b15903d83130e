"""GRPO on tool episodes: a stage's options, its prompts and an environment in, objects out.

    Prompts + GRPOOptions + EpisodeOptions + environment + verifier
        mode "sync":  GRPOObjective with an EpisodeRollout sampling every turn on the trainer's
                      device (recorded.py writes each episode and its turns to the store)
        mode "async": GRPOObjective with a ScheduledRollout whose source is an EnvironmentSource
                      on the native rollout server (scheduled.py)
    ... + PPOOptions: PPOObjective (a ValueHead critic on a copy of the starting policy) with a
                      PPORollout over the EpisodeRollout (sync only)

`OneTurn` makes a prompt a one-turn episode, so one-turn tasks train through PPO too.

Each prompt row is a task (`Prompts(row_ids=True)`: its row is its id); its data reaches the
environment and the verifier (sync: the batch's columns; async: `prompt_tasks`' layout, the
prompt ids as `prompt_ids` and the reward fields as text). Rows are `max_prompt_len +
max_new_tokens` ids wide, one per task, sample and turn.

Not here: one-turn GRPO (build.py), the episode loop and its records (dew_lib.rollouts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dew_lib.data import Prompts
from dew_lib.inference import TextGeneration
from dew_lib.models import lora
from dew_lib.objectives import PPOObjective, ValueHead
from dew_lib.objectives.ppo import critic_from_policy
from dew_lib.recipes.build import Built, adapted
from dew_lib.recipes.options import EpisodeOptions, GRPOOptions, PPOOptions
from dew_lib.recipes.recorded import RecordedRollout, episode_sessions
from dew_lib.recipes.scheduled import ScheduledRollout
from dew_lib.records.episodes import EnvironmentFactory, Observation, Verifier
from dew_lib.rollouts import EnvironmentSource, EpisodeRollout, PPORollout


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


def build_episode_grpo(model, variables, data: Prompts, options: GRPOOptions, episodes: EpisodeOptions, *,
                       environment: EnvironmentFactory, verifier: Verifier, eos_id, decode=None,
                       writer=None, ppo: PPOOptions | None = None, server=None, key=None) -> Built:
    """GRPO (or, given `ppo`, PPO with a critic) over tool episodes of `data`'s prompts, from the
    frozen `variables`.

    environment: `(task, identity) -> Environment`; verifier: `(task, episode) -> reward`.
    eos_id: the tokenizer's end-of-turn id (or ids), where a turn ends.
    decode: prompt ids -> text for the store. writer: the stage's StageWriter (None: nothing
    recorded); async records its scheduler records and sessions, sync also each turn. ppo: runs
    synchronously; the built objective's params are `{"policy", "critic"}`. server: async only,
    `sampling -> RolloutServer` for a remote engine (`remote_server`; None: the native server).
    key: seeds the adapters when `options.lora` has a rank (PPO's critic starts with a copy).
    """
    model, variables = adapted(model, variables, options, key)
    if eos_id is None:
        raise ValueError("build_episode_grpo(eos_id=None): a tool episode's turn ends at EOS, so give the "
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
                            verifier=verifier, eos_id=eos_id, decode=decode, writer=writer)
    width = episodes.max_prompt_len + options.max_new_tokens
    sampling = options.sampling(eos_id)
    if options.mode == "async":
        def source(server: Any) -> EnvironmentSource:
            return EnvironmentSource(server, environment, verifier, max_prompt_tokens=episodes.max_prompt_len,
                                     max_new_tokens=options.max_new_tokens, max_turns=episodes.max_turns,
                                     workers=episodes.workers, keep_episodes=writer is not None)

        scheduled = ScheduledRollout(options, model, variables, max_prompt_len=episodes.max_prompt_len,
                                     eos_id=eos_id, decode=decode, writer=writer, source=source, truncation="mask",
                                     server=server)
        try:
            dataset = scheduled.dataset(data.load(batch=options.batch))
        except BaseException:
            scheduled.close()
            raise
        return Built(objective=scheduled.objective, dataset=dataset, rollout=scheduled, model=model)
    objective = options.objective(model, variables, width)
    policy = TextGeneration(model, pad_id=data.pad_id, routing=options.routing_replay != "none")
    drawn = EpisodeRollout(policy, environment, verifier,
                           max_prompt_tokens=episodes.max_prompt_len, max_new_tokens=options.max_new_tokens,
                           max_turns=episodes.max_turns, groups=options.groups, sampling=sampling,
                           estimator=options.advantage_estimator, workers=episodes.workers)
    rollout = drawn if writer is None else RecordedRollout(drawn, episode_sessions(drawn, writer, decode))
    return Built(objective=objective, dataset=data.load(batch=options.batch), rollout=rollout, model=model)


def _episode_ppo(model, variables, data: Prompts, options: GRPOOptions, episodes: EpisodeOptions,
                 ppo: PPOOptions, *, environment, verifier, eos_id, decode, writer) -> Built:
    options.check_ppo()
    width = episodes.max_prompt_len + options.max_new_tokens
    critic = ValueHead(model)  # with adapters, the critic's own over the policy's frozen base (no copy)
    critic_variables = critic_from_policy(critic, variables, width - 1, share_base=lora.has_adapters(variables))
    objective = PPOObjective(model, width - 1, critic=critic, beta=options.beta, pretrained=variables,
                             critic_variables=critic_variables,
                             value_coefficient=ppo.value_coefficient, value_clip=ppo.value_clip,
                             epsilon_low=options.epsilon_low, epsilon_high=options.epsilon_high,
                             dual_clip=options.dual_clip, kl_estimator=options.kl_estimator,
                             sampling_temperature=options.temperature, routing_replay=options.routing_replay)
    sampled = EpisodeRollout(objective.policy(pad_id=data.pad_id), environment, verifier,
                             max_prompt_tokens=episodes.max_prompt_len, max_new_tokens=options.max_new_tokens,
                             max_turns=episodes.max_turns, groups=options.groups,
                             sampling=options.sampling(eos_id), workers=episodes.workers)
    trained = PPORollout(objective, sampled, gamma=ppo.gamma, lam=ppo.lam, epochs=ppo.epochs,
                         minibatches=ppo.minibatches)
    rollout = trained if writer is None else RecordedRollout(trained, episode_sessions(trained, writer, decode))
    return Built(objective=objective, dataset=data.load(batch=options.batch), rollout=rollout, model=model)



__all__ = ["OneTurn", "build_episode_grpo"]
