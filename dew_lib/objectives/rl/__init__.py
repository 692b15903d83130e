"""Preference and reinforcement objectives, and the rollouts that feed them."""

from dew_lib.objectives.rl.flow import (FlowGRPOObjective, FlowReward, FlowRollout,
                                        FlowRolloutRecord, group_advantages)

__all__ = ["FlowGRPOObjective", "FlowReward", "FlowRollout", "FlowRolloutRecord", "group_advantages"]
