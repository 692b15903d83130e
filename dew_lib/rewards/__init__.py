"""Verifiable rewards with the `reward(data_source, completion, ground_truth, extra_info)` signature."""

from dew_lib.rewards.code import CodeReward, ProgramRun
from dew_lib.rewards.math import MathReward

__all__ = ["CodeReward", "MathReward", "ProgramRun"]
