"""Dew: post-training for JAX decoders (SFT, DPO, GRPO, PPO) and rectified-flow models.

The library knows nothing of Prefect; flows and tasks wrap it.
"""

from dew_lib import models
from dew_lib.data import Dataset, Loading, Partition
from dew_lib.diffusion import DiffusionObjective, Field, InputSpec, presets
from dew_lib.objectives import LMObjective
from dew_lib.trainer import Trainer, TrainingDiverged, TrainState

__all__ = ["Dataset", "DiffusionObjective", "Field", "InputSpec", "LMObjective", "Loading",
           "Partition", "Trainer", "TrainState", "TrainingDiverged", "models", "presets"]
