"""Preference and reinforcement objectives, and the rollouts that feed them."""

from dew_lib.objectives.rl import algorithms, sessions
from dew_lib.objectives.rl.dpo import DPOObjective
from dew_lib.objectives.rl.flow import (FlowGRPOObjective, FlowReward, FlowRollout,
                                        FlowRolloutRecord, group_advantages)
from dew_lib.objectives.rl.grpo import GRPOObjective
from dew_lib.objectives.rl.rollout import RewardFailed, SampledRollout
from dew_lib.objectives.rl.sessions import Call, Session, SessionSource, Status, Task, pack

__all__ = ["Call", "DPOObjective", "FlowGRPOObjective", "FlowReward", "FlowRollout",
           "FlowRolloutRecord", "GRPOObjective", "RewardFailed", "SampledRollout", "Session",
           "SessionSource", "Status", "Task", "algorithms", "group_advantages", "pack", "sessions"]
