"""What every objective over a decoder checks and does the same way: its options and its start.

Not here: losses (each objective owns its own) and the scoring seam (`lm.score_targets`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def check_seq_len(owner: str, model: Any, seq_len: int) -> None:
    """Refuse a nonpositive `seq_len` or one the model's context cannot hold."""
    if seq_len <= 0:
        raise ValueError(f"{owner}.seq_len must be positive, got {seq_len}")
    max_len = getattr(model, "max_seq_len", None)
    if max_len is not None and seq_len > max_len:
        raise ValueError(
            f"{owner}.seq_len={seq_len} exceeds the model's max_seq_len={max_len}; "
            f"build the model with max_seq_len >= {seq_len} or shorten seq_len"
        )


def check_pretrained(owner: str, pretrained: Any) -> None:
    """`pretrained` must be a whole Flax variables mapping, outer `params` collection included."""
    if pretrained is not None and "params" not in pretrained:
        raise ValueError(
            f"{owner}.pretrained must be a full Flax variables mapping with its outer "
            "'params' collection, such as a TrainState's .params"
        )


def initial_variables(model: Any, pretrained: Any, key: jax.Array, seq_len: int,
                      variables: Any = None) -> Any:
    """The variables a stage starts from: given ones, the pretrained ones, or a fresh init."""
    if variables is not None:
        return variables
    if pretrained is not None:
        return jax.tree.map(jnp.asarray, pretrained)
    return jax.jit(model.init)(key, jnp.zeros((1, seq_len), jnp.int32))
