"""Preference and reinforcement objectives, and the rollouts that feed them."""

from dew_lib.objectives.rl import algorithms, episodes, sessions
from dew_lib.objectives.rl.dpo import DPOObjective
from dew_lib.objectives.rl.episodes import (Action, Episode, EpisodeId, EpisodeStatus, Observation,
                                            Transition)
from dew_lib.objectives.rl.flow import (FlowGRPOObjective, FlowReward, FlowRollout,
                                        FlowRolloutRecord, group_advantages)
from dew_lib.objectives.rl.grpo import GRPOObjective
from dew_lib.objectives.rl.rollout import RewardFailed, SampledRollout
from dew_lib.objectives.rl.scheduler import (Publisher, RolloutScheduler, SchedulerRecord, SessionLog,
                                             prompt_tasks, task_ids)
from dew_lib.objectives.rl.sessions import Call, Session, SessionSource, Status, Task, pack
from dew_lib.objectives.rl.sources import EnvironmentSource, PromptSource

__all__ = ["Action", "Call", "DPOObjective", "EnvironmentSource", "Episode", "EpisodeId",
           "EpisodeStatus", "FlowGRPOObjective", "FlowReward", "FlowRollout", "FlowRolloutRecord",
           "GRPOObjective", "Observation", "PromptSource", "Publisher", "RewardFailed",
           "RolloutScheduler", "SampledRollout", "SchedulerRecord", "Session", "SessionLog",
           "SessionSource", "Status", "Task", "Transition", "algorithms", "episodes",
           "group_advantages", "pack", "prompt_tasks", "sessions", "task_ids"]
