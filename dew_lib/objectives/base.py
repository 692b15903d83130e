"""The objective contract every Trainer stage implements.

An objective is pure functions of arrays. Its loss is reported as a sum and a normalizer
(`LossTerms.total`, `LossTerms.weight`) so the Trainer can accumulate microbatches and reduce
across devices without rescaling: the update always follows `sum of totals / sum of weights`.
Metrics use the same convention: each is a `(sum, count)` pair, averaged only when read.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.models import lora

Metric = tuple[jax.Array, jax.Array]
Metrics = dict[str, Metric]


class LossTerms(NamedTuple):
    """A loss as `total / weight`, with metrics as `(sum, count)` pairs."""

    total: jax.Array
    weight: jax.Array
    metrics: Metrics


class Objective(abc.ABC):
    """What the Trainer needs from an objective: subclass it and implement the four abstract
    methods. The hooks below it are optional: their defaults leave plain training as it is, and
    an objective overrides the ones it needs (DPO and GRPO keep a frozen reference through
    `ema_decay`, PPO references only its policy and trains its critic beside the policy's
    adapters, token objectives derive perplexity)."""

    ema_decay: float | None = None
    """Decay of the moving average the Trainer keeps in `TrainState.ema` of `reference_params`:
    None keeps none, 1.0 a frozen copy of the starting values (a reference policy)."""

    @abc.abstractmethod
    def init(self, key: jax.Array, variables: Any = None) -> Any:
        """The starting parameters (`variables` when given, checked against the model)."""

    @abc.abstractmethod
    def terms(self, params: Any, batch: Mapping[str, jax.Array], *, step: jax.Array,
              reference: Any, key: jax.Array) -> LossTerms:
        """The loss as `(total, weight)` and its `(sum, count)` metrics, pure and jit-compiled."""

    @abc.abstractmethod
    def evaluate(self, params: Any, batch: Mapping[str, jax.Array]) -> Metrics:
        """Validation metrics of one batch, as `(sum, count)` pairs."""

    @abc.abstractmethod
    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse, on the host, a batch this objective cannot read, naming the field."""

    def reference_params(self, params: Any) -> Any:
        """The part of `params` that `TrainState.ema` tracks: all of them unless overridden."""
        return params

    def trainable(self, params: Any) -> Any:
        """Which leaves of `params` the optimizer trains, as a tree of Python bools shaped like
        them; the others stay bit for bit as they started and have no optimizer state. The
        Trainer asks once, with the starting params' shapes. Default: `adapters_or_all`."""
        return adapters_or_all(params)

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        """Validation means as reported: the averages unless overridden (e.g. with perplexity)."""
        return means

    def derive_training(self, means: dict[str, float]) -> dict[str, float]:
        """A training window's means as reported (ratios of window means belong here)."""
        return means


def adapters_or_all(params: Any) -> Any:
    """True on the low-rank adapters (models/lora.py) when `params` hold any, so their base
    stays frozen; else True on every leaf (a full fine-tune)."""
    adapted = lora.has_adapters(params)
    return jax.tree_util.tree_map_with_path(lambda path, _: not adapted or lora.is_adapter(path), params)


def mean(metric: Metric) -> jax.Array:
    """The average a `(sum, count)` metric stands for; 0 when nothing was counted."""
    total, count = metric
    return total / jnp.maximum(count, 1e-12) * (count > 0)


def average(metrics: Iterable[Metrics]) -> dict[str, float]:
    """The means of `(sum, count)` metrics read back over several steps or batches. A metric
    nothing counted has no mean and is left out, rather than shown as a made-up 0 or NaN."""
    sums: dict[str, list[float]] = {}
    for step in metrics:
        for name, (total, count) in step.items():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += float(total)
            acc[1] += float(count)
    return {name: total / count for name, (total, count) in sums.items() if count}


def loss(objective: Objective, params, batch, step=0, reference=None, key=None):
    """`(mean loss, metric means)`: the plain-function view of `objective.terms`."""
    terms = objective.terms(
        params, batch, step=jnp.asarray(step), reference=reference,
        key=jax.random.key(0) if key is None else key,
    )
    return mean((terms.total, terms.weight)), {k: mean(v) for k, v in terms.metrics.items()}


def with_perplexity(means: dict[str, float]) -> dict[str, float]:
    """Averaged evaluation metrics plus `perplexity = exp(loss)` (the loss capped at 80 so it
    stays finite) when they hold a `loss`: what token-likelihood objectives' `derive` reports."""
    if "loss" in means:
        means = {**means, "perplexity": float(np.exp(min(means["loss"], 80.0)))}
    return means


def check_token_ids(field: str, values: Any, model: Any) -> None:
    """Refuse token ids outside `[0, model.vocab_size)` on the host, before anything compiles.

    An id past the embedding table does not fail inside XLA: it reads clamped garbage and the
    loss turns non-finite steps later, so the check names the field, the id and the size here.
    """
    values = np.asarray(values)
    if not np.issubdtype(values.dtype, np.integer):
        raise TypeError(
            f"batch field {field!r} holds {values.dtype} values; token ids must be integers "
            f"(convert with .astype(np.int32))"
        )
    if values.size == 0:
        return
    low, high = int(values.min()), int(values.max())
    vocab = getattr(model, "vocab_size", None)
    if low < 0:
        raise ValueError(f"batch field {field!r} holds a negative token id ({low}); ids start at 0")
    if vocab is not None and high >= vocab:
        raise ValueError(
            f"batch field {field!r} holds token id {high}, but the model's vocab_size is {vocab}; "
            f"build the model with vocab_size >= {high + 1} (for a Hugging Face tokenizer use "
            "len(tokenizer), which counts added special tokens, not tokenizer.vocab_size)"
        )
