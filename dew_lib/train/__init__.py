"""Training: the `Trainer` (trainer.py), its orbax checkpoints (checkpoint.py) and metric sinks
(sinks.py).

The names below load on first use, so that a light module of this package (the launcher,
launch.py, and the job's environment, topology.py) is imported without JAX and orbax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dew_lib.train.checkpoint import CheckpointMismatch, Checkpoints
    from dew_lib.train.sinks import JsonlSink, LineLog, MemorySink, ProgressBar
    from dew_lib.train.trainer import Trainer, TrainingDiverged, TrainState

_HOMES = {"CheckpointMismatch": "checkpoint", "Checkpoints": "checkpoint", "JsonlSink": "sinks", "LineLog": "sinks",
          "MemorySink": "sinks", "ProgressBar": "sinks", "TrainState": "trainer", "Trainer": "trainer",
          "TrainingDiverged": "trainer"}
__all__ = ["CheckpointMismatch", "Checkpoints", "JsonlSink", "LineLog", "MemorySink", "ProgressBar",
           "TrainState", "Trainer", "TrainingDiverged"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # found directly from now on
    return value
