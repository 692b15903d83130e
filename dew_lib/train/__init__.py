"""Training: the `Trainer` (trainer.py), its orbax checkpoints (checkpoint.py) and metric sinks
(sinks.py)."""

from dew_lib.train.checkpoint import CheckpointMismatch, Checkpoints
from dew_lib.train.sinks import JsonlSink, LineLog, MemorySink, ProgressBar
from dew_lib.train.trainer import Trainer, TrainingDiverged, TrainState

__all__ = ["CheckpointMismatch", "Checkpoints", "JsonlSink", "LineLog", "MemorySink", "ProgressBar",
           "TrainState", "Trainer", "TrainingDiverged"]
