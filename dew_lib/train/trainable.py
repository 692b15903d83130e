"""Which parameters the Trainer's optimizer trains, and the frozen reference it need not copy.

An objective marks its trainable leaves (`Objective.trainable`: by default the low-rank
adapters when the params hold any, else every leaf; PPO adds its critic). The Trainer splits
the params into the marked leaves, which the gradient, the optimizer state and a gradient sum
cover, and the rest, which stays bit for bit as it started. When the reference part of the
params (`Objective.reference_params`) trains its adapters alone, a frozen reference is that
part with its adapters switched off (`lora.without_adapters`), never a second copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from dew_lib.models import lora


def marks(objective: Any, params: Any) -> Any:
    """`objective.trainable(params)`, checked: Python bools in the params' tree, at least one
    True (params may be shapes only, as `jax.eval_shape` gives them)."""
    mask = objective.trainable(params)
    name = type(objective).__name__
    got: Any = jax.tree.structure(mask)
    expected: Any = jax.tree.structure(params)
    if got != expected:
        raise ValueError(f"{name}.trainable must return a tree shaped like the params, one bool per "
                         f"leaf; got {got} for {expected}")
    leaves = jax.tree.leaves(mask)
    if not all(isinstance(leaf, bool) for leaf in leaves):
        raise TypeError(f"{name}.trainable must mark each leaf with a Python bool (decided from "
                        "the params' paths and shapes, not their values)")
    if not any(leaves):
        raise ValueError(f"{name}.trainable marks no leaf: there is nothing to train")
    return mask


def split(params: Mapping[str, Any], mask: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(trained, frozen)`: two nested dicts with the leaves `mask` marks and the others (empty
    subtrees stay with the frozen part). `lora.merge` puts them back together."""
    trained: dict[str, Any] = {}
    frozen: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            inner_trained, inner_frozen = split(value, mask[key])
            if inner_trained:
                trained[key] = inner_trained
            if inner_frozen:
                frozen[key] = inner_frozen
        elif mask[key] is True:
            trained[key] = value
        else:
            frozen[key] = value
    return trained, frozen


def reference_is_base(objective: Any, params: Any, mask: Any) -> bool:
    """Whether the frozen reference (ema_decay 1.0) is the reference part with its adapters off:
    that part holds adapters and trains nothing else, so the rest of it never moves."""
    if objective.ema_decay != 1.0:
        return False
    part, marked = objective.reference_params(params), objective.reference_params(mask)
    return lora.has_adapters(part) and all(
        lora.is_adapter(path) for path, trains in jax.tree_util.tree_leaves_with_path(marked) if trains)


__all__ = ["marks", "reference_is_base", "split"]
