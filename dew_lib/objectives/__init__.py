"""Objectives: pure loss functions the Trainer optimizes, and the tables their variants come from.

`LMObjective` (lm.py), `DPOObjective` (dpo.py), `KTOObjective` (kto.py), `GRPOObjective`
(grpo.py), `DistillObjective` (distill.py: on-policy distillation from a frozen teacher) and
`PPOObjective` with its `ValueHead` critic (ppo.py) over the `PackedBatch` (batch.py), each an
`Objective` (base.py: the contract and its optional hooks); every advantage estimator, policy
loss, KL estimator and aggregation is a function in `algorithms`, and every preference loss one
in `preference_losses`. Nothing here draws rollouts, runs threads or touches
the host beyond checking a batch before it compiles.
"""

from dew_lib.objectives import algorithms
from dew_lib.objectives.base import LossTerms, Metric, Metrics, Objective, average, loss, mean
from dew_lib.objectives.batch import PackedBatch
from dew_lib.objectives.distill import DistillObjective
from dew_lib.objectives.dpo import DPOObjective
from dew_lib.objectives.grpo import GRPOObjective
from dew_lib.objectives.kto import KTOObjective
from dew_lib.objectives.lm import LMObjective
from dew_lib.objectives.ppo import PPOObjective, ValueHead, split_optimizer

__all__ = ["DPOObjective", "DistillObjective", "GRPOObjective", "KTOObjective", "LMObjective", "LossTerms",
           "Metric", "Metrics", "average", "Objective", "PPOObjective", "PackedBatch", "ValueHead", "algorithms",
           "loss", "mean", "split_optimizer"]
