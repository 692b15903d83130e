"""Dew: post-training for JAX decoders (SFT, DPO, GRPO, PPO) and rectified-flow models.

The library knows nothing of Prefect; flows and tasks wrap it. The names below are imported on
first use, so `import dew_lib.store` or the `dew` command do not load JAX.
"""

import importlib

_EXPORTS = {
    "Dataset": "dew_lib.data", "Loading": "dew_lib.data", "Partition": "dew_lib.data",
    "LMObjective": "dew_lib.objectives", "Trainer": "dew_lib.trainer",
    "TrainingDiverged": "dew_lib.trainer", "TrainState": "dew_lib.trainer",
}

__all__ = ["Dataset", "LMObjective", "Loading", "Partition", "Trainer", "TrainState",
           "TrainingDiverged", "models"]


def __getattr__(name: str):
    if name == "models":
        return importlib.import_module("dew_lib.models")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dew_lib' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
