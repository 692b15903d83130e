"""Objectives: pure loss functions the Trainer optimizes."""

from dew_lib.objectives.base import LossTerms, Metric, Metrics, Objective, loss, mean
from dew_lib.objectives.lm import LMObjective

__all__ = ["LMObjective", "LossTerms", "Metric", "Metrics", "Objective", "loss", "mean"]
