"""Dew: post-training for JAX decoders (SFT, DPO, GRPO, PPO) and rectified-flow models.

The library knows nothing of Prefect; flows and tasks wrap it.
"""

from dew_lib.quiet import drop_torch_notice

drop_torch_notice()  # before anything below imports transformers

from dew_lib import models  # noqa: E402
from dew_lib.data import Dataset, Loading, Partition  # noqa: E402
from dew_lib.objectives import LMObjective  # noqa: E402
from dew_lib.trainer import Trainer, TrainingDiverged, TrainState  # noqa: E402

__all__ = ["Dataset", "LMObjective", "Loading", "Partition", "Trainer", "TrainState",
           "TrainingDiverged", "models"]
