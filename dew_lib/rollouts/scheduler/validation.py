"""What a RolloutScheduler refuses at construction, with errors that name the option and the fix."""

from __future__ import annotations

from typing import Any

from dew_lib.objectives import algorithms
from dew_lib.objectives.grpo import GRPOObjective
from dew_lib.options import choice, group_size, integer, lag_bound, number
from dew_lib.records.sessions import TRUNCATION


def check_options(objective: Any, source: Any, weights: Any, *, width, rows, tasks, groups,
                  oversample, admit, max_lag, ahead, sync_every, max_attempts, timeout, estimator,
                  truncation, proximal) -> None:
    """Refuse a schedule that cannot run: see RolloutScheduler's docstring."""
    for name, value, low in (("width", width, 2), ("rows", rows, 1),
                             ("oversample", oversample, 0), ("max_lag", max_lag, 0),
                             ("ahead", ahead, 0), ("sync_every", sync_every, 1),
                             ("max_attempts", max_attempts, 1)):
        integer(f"RolloutScheduler.{name}", value, at_least=low)
    group_size("RolloutScheduler.groups", groups)
    integer("RolloutScheduler.admit", admit, optional=True)
    number("RolloutScheduler.timeout", timeout, above=0, optional=True)
    lag_bound("RolloutScheduler", max_lag, ahead, sync_every)
    choice("RolloutScheduler.truncation", truncation, TRUNCATION)
    algorithms.advantage_function(estimator)
    objective_width = getattr(objective, "width", None)
    if objective_width is not None and objective_width != width:
        raise ValueError(
            f"RolloutScheduler.width={width} but the objective reads rows of seq_len + 1 = "
            f"{objective_width}; set GRPOObjective(seq_len={width - 1}) or width={objective_width}")
    if not isinstance(objective, GRPOObjective):
        raise TypeError("RolloutScheduler needs a GRPOObjective (its update scores the "
                        f"proximal policy); got {type(objective).__name__}")
    choice("RolloutScheduler.proximal", proximal, ("in_update", "bypass"))
    if proximal == "bypass" and isinstance(getattr(objective, "behavior_importance", None), float):
        raise ValueError(
            "RolloutScheduler(proximal='bypass') compares the current policy with behavior directly, "
            "so a TIS cap would count that correction twice: build the GRPOObjective without "
            "behavior_importance (or with a (low, high) band), or use proximal='in_update'")
    if proximal == "in_update" and max_lag > 0 and getattr(objective, "behavior_importance", None) is None:
        raise ValueError(
            f"RolloutScheduler(max_lag={max_lag}) trains on rollouts drawn by older weights, "
            "which needs an importance correction: set GRPOObjective(behavior_importance=2.0) "
            "(a TIS cap) or a (low, high) IcePop band, use proximal='bypass', or run max_lag=0 "
            "with ahead=0")
    for name, thing, methods in (("source", source, ("submit", "cancel")),
                                 ("weights", weights, ("load",))):
        missing = [m for m in methods if not callable(getattr(thing, m, None))]
        if missing:
            raise TypeError(f"RolloutScheduler.{name} lacks {missing}; a {name} needs "
                            f"{list(methods)}")
    if not callable(tasks):
        raise TypeError("RolloutScheduler.tasks must be callable as tasks(batch) -> [Task]")
