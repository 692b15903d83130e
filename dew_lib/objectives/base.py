"""The objective contract every Trainer stage implements.

An objective is pure functions of arrays. Its loss is reported as a sum and a normalizer
(`LossTerms.total`, `LossTerms.weight`) so the Trainer can accumulate microbatches and reduce
across devices without rescaling: the update always follows `sum of totals / sum of weights`.
Metrics use the same convention: each is a `(sum, count)` pair, averaged only when read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

Metric = tuple[jax.Array, jax.Array]
Metrics = dict[str, Metric]


class LossTerms(NamedTuple):
    """A loss as `total / weight`, with metrics as `(sum, count)` pairs."""

    total: jax.Array
    weight: jax.Array
    metrics: Metrics


class Objective(Protocol):
    """What the Trainer needs from an objective."""

    ema_decay: float | None

    def init(self, key: jax.Array, variables: Any = None) -> Any: ...

    def terms(self, params: Any, batch: Mapping[str, jax.Array], *, step: jax.Array,
              reference: Any, key: jax.Array) -> LossTerms: ...

    def evaluate(self, params: Any, batch: Mapping[str, jax.Array]) -> Metrics: ...

    def check_batch(self, batch: Mapping[str, Any]) -> None: ...


def mean(metric: Metric) -> jax.Array:
    """The average a `(sum, count)` metric stands for; 0 when nothing was counted."""
    total, count = metric
    return total / jnp.maximum(count, 1e-12) * (count > 0)


def loss(objective: Objective, params, batch, step=0, reference=None, key=None):
    """`(mean loss, metric means)`: the plain-function view of `objective.terms`."""
    terms = objective.terms(
        params, batch, step=jnp.asarray(step), reference=reference,
        key=jax.random.key(0) if key is None else key,
    )
    return mean((terms.total, terms.weight)), {k: mean(v) for k, v in terms.metrics.items()}
