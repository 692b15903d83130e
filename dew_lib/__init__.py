"""Dew: post-training for JAX decoders (SFT, DPO, GRPO, PPO) and rectified-flow models.

The library knows nothing of Prefect; flows and tasks wrap it. The names below are imported on
first use, so `import dew_lib.store` or the `dew` command do not load JAX.
"""

import importlib

from dew_lib.quiet import drop_torch_notice

drop_torch_notice()  # before any dew_lib module imports transformers (quiet.py imports only logging)

_EXPORTS = {
    "Dataset": "dew_lib.data", "Loading": "dew_lib.data", "Partition": "dew_lib.data",
    "LMObjective": "dew_lib.objectives", "Trainer": "dew_lib.train",
    "TrainingDiverged": "dew_lib.train", "TrainState": "dew_lib.train",
    "DiffusionObjective": "dew_lib.diffusion", "Field": "dew_lib.diffusion",
    "InputSpec": "dew_lib.diffusion",
}

__all__ = ["Dataset", "DiffusionObjective", "Field", "InputSpec", "LMObjective", "Loading",
           "Partition", "Trainer", "TrainState", "TrainingDiverged", "models", "presets"]


def __getattr__(name: str):
    if name == "models":
        return importlib.import_module("dew_lib.models")
    if name == "presets":
        return importlib.import_module("dew_lib.diffusion.presets")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dew_lib' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
