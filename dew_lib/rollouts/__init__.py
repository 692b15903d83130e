"""Rollouts: host-side experience for the RL objectives, handed to the Trainer's `rollout` hook.

`pack` turns recorded sessions into packed rows (packing.py); `SampledRollout` draws groups from
the policy in-process (sampled.py); `EpisodeRollout` runs multi-turn tool episodes in lock step
(episodes.py), and `PPORollout` adds a critic's GAE targets to them (ppo.py); `DistillRollout`
gives on-policy distillation the student's samples or a dataset's completions (distill.py); `to_verl` and
`from_verl` write sessions as verl's agent-loop rows and read them back (verl.py); `PromptSource`
and `EnvironmentSource` draw sessions from a rollout server (sources.py), and `HarborSource` runs
Harbor trials behind a recording gateway (harbor.py); `RolloutScheduler` trains on them
asynchronously (scheduler/).

Not here: the losses (`dew_lib.objectives`), the records themselves (`dew_lib.records`), the
servers that sample (`dew_lib.inference`).
"""

from dew_lib.rollouts.distill import DistillRollout
from dew_lib.rollouts.episodes import (
                                      EpisodeCancelled,
                                      EpisodeFailure,
                                      EpisodeResult,
                                      EpisodeRollout,
                                      project,
                                      session_of,
)
from dew_lib.rollouts.harbor import Harbor, HarborSource
from dew_lib.rollouts.journal import EpisodeJournal, JournalBusy, JournalMismatch
from dew_lib.rollouts.packing import pack, session_metrics
from dew_lib.rollouts.ppo import PPORollout
from dew_lib.rollouts.sampled import RewardFailed, SampledRollout
from dew_lib.rollouts.scheduler import GroupState, RolloutScheduler, prompt_tasks, task_ids
from dew_lib.rollouts.sources import EnvironmentSource, PromptSource
from dew_lib.rollouts.subprocess_environment import SubprocessEnvironment, ToolFailure, WorkerEnvironment
from dew_lib.rollouts.verl import VerlTrajectory, from_verl, to_verl
from dew_lib.tool_worker import serve as serve_tool

__all__ = ["DistillRollout", "EnvironmentSource", "EpisodeCancelled", "EpisodeFailure", "EpisodeJournal",
           "EpisodeResult", "EpisodeRollout", "GroupState", "Harbor", "HarborSource", "JournalBusy",
           "JournalMismatch", "PPORollout", "PromptSource", "RewardFailed", "RolloutScheduler", "SampledRollout",
           "SubprocessEnvironment", "ToolFailure", "VerlTrajectory", "WorkerEnvironment", "from_verl", "pack",
           "project", "prompt_tasks", "serve_tool", "session_metrics", "session_of", "task_ids", "to_verl"]
