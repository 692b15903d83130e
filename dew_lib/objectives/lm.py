"""LMObjective: next-token prediction, optionally restricted to one chat role (SFT).

Batch layout (`L` = seq_len): `text` `[B, L + 1]` token ids, and optionally `text_roles`,
`text_segment_ids` and `text_positions` of the same shape. Input position i predicts token i + 1;
the target's role decides whether the prediction counts, and a target that starts a new packed
document or is padding (segment 0) never counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.data.chat import Role
from dew_lib.data.dataset import describe
from dew_lib.objectives.base import LossTerms, Metrics, Objective, check_token_ids, with_perplexity
from dew_lib.objectives.policy import check_pretrained, check_seq_len, initial_variables
from dew_lib.objectives.routing import has_experts, router_terms

OPTIONAL_FIELDS = ("text_roles", "text_segment_ids", "text_positions")


def token_log_probs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log p(target) per position, `[B, S]`, without materializing a full log-softmax copy."""
    if temperature != 1.0:
        logits = logits / temperature
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def dropout_rngs(key: jax.Array | None) -> dict[str, jax.Array] | None:
    """The rngs of a training forward: `key` as the `dropout` stream (adapter dropout,
    models/lora.py), or none for a forward that must not drop (evaluation, references)."""
    return None if key is None else {"dropout": key}


def decoder_hidden(model, params, inputs, segments=None, positions=None, *, dropout_key=None, routes=None,
                   return_routing: bool = False):
    """The causal transformer's final hidden states `[B, S, E]` for scoring, and with
    `return_routing` its `moe.Routing` too. routes: `(experts [B, S, layers, top_k], routed
    [B, S])` to replay on a mixture-of-experts model (objectives/routing.py), or None."""
    extra: dict[str, Any] = {"return_routing": True} if return_routing else {}
    if routes is not None:
        extra["routes"], extra["routed"] = routes
    return model.apply(params, inputs, segments, positions, method=model.hidden,
                       rngs=dropout_rngs(dropout_key), **extra)


def _routable(model, routes, return_routing: bool) -> None:
    if (routes is not None or return_routing) and not hasattr(model, "target_scores"):
        raise ValueError(f"{type(model).__name__} has no expert routing to replay or report; only the "
                         "causal transformer with experts > 0 routes")


def score_targets(model, params, inputs, targets, segments=None, positions=None, *,
                  temperature: float = 1.0, dropout_key: jax.Array | None = None, routes=None,
                  return_routing: bool = False):
    """log p(target) and whether it was the argmax, `[B, S]` each, for any decoder.

    temperature: score under `softmax(logits / temperature)`, as a sampler at that temperature
    drew (the argmax test does not depend on it). Models with a `target_scores` method (the
    causal transformer) score in chunks of tokens and never hold the `[B, S, V]` logits or their
    gradient; others are scored from their full logits. dropout_key: given only by a training
    forward, which then drops what the model drops in training (adapter dropout). routes,
    return_routing: as `decoder_hidden` takes them; with return_routing the result is
    `(log_probs, is_top, routing)`.
    """
    _routable(model, routes, return_routing)
    if hasattr(model, "target_scores"):
        out = decoder_hidden(model, params, inputs, segments, positions, dropout_key=dropout_key, routes=routes,
                             return_routing=return_routing)
        hidden, routing = out if return_routing else (out, None)
        scores = model.apply(params, hidden, targets, temperature, method=model.target_scores)
        return (*scores, routing) if return_routing else scores
    logits = model.apply(params, inputs, segments, positions, rngs=dropout_rngs(dropout_key))
    return token_log_probs(logits, targets, temperature), jnp.argmax(logits, axis=-1) == targets


def weighted_log_prob_sum(model, params, inputs, targets, weights, segments=None, positions=None, *,
                          dropout_key: jax.Array | None = None, return_routing: bool = False):
    """`(sum(weights * log p(target)), is_top)` for any decoder: the LM loss's sum, scalar, and
    whether each target was the argmax, `[B, S]`.

    `weights` `[B, S]` is data and gets no gradient. The causal transformer forms the sum's
    gradient in the forward pass of its chunked head (one head product fewer than
    `score_targets` under the same loss); other models sum `score_targets`. dropout_key: as
    `score_targets` takes it. return_routing: also return the mixture-of-experts routing.
    """
    _routable(model, None, return_routing)
    if hasattr(model, "weighted_log_prob_sum"):
        out = decoder_hidden(model, params, inputs, segments, positions, dropout_key=dropout_key,
                             return_routing=return_routing)
        hidden, routing = out if return_routing else (out, None)
        summed = model.apply(params, hidden, targets, weights, method=model.weighted_log_prob_sum)
        return (*summed, routing) if return_routing else summed
    log_probs, top = score_targets(model, params, inputs, targets, segments, positions, dropout_key=dropout_key)
    return jnp.sum(log_probs * jax.lax.stop_gradient(weights)), top


def score_targets_with_entropy(model, params, inputs, targets, segments=None, positions=None, *,
                               temperature: float = 1.0):
    """`score_targets` plus each position's entropy `[B, S]` (nats, under the same temperature).

    Returns `(log_probs, is_top, entropy)`; the entropy comes from the same chunks as the
    log-probs and is differentiable, for entropy bonuses and metrics.
    """
    if hasattr(model, "target_scores_with_entropy"):
        hidden = model.apply(params, inputs, segments, positions, method=model.hidden)
        return model.apply(params, hidden, targets, temperature,
                           method=model.target_scores_with_entropy)
    logits = model.apply(params, inputs, segments, positions).astype(jnp.float32) / temperature
    log_softmax = jax.nn.log_softmax(logits, axis=-1)
    entropy = -jnp.sum(jnp.exp(log_softmax) * log_softmax, axis=-1)
    picked = jnp.take_along_axis(log_softmax, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets, entropy


def prompt_layout(prompt_length: jax.Array, width: int):
    """Segment ids (0 on left padding) and positions (0 at each row's first real token)."""
    pad = width - prompt_length[:, None]
    columns = jnp.arange(width)[None, :]
    segments = (columns >= pad).astype(jnp.int32)
    positions = jnp.maximum(columns - pad, 0).astype(jnp.int32)
    return segments, positions


class LMObjective(Objective):
    """Language-model loss over `text`, counting only `loss_role` targets when it is set."""

    def __init__(self, model, seq_len: int, *, pretrained: Any = None,
                 loss_role: Role | int | None = None, ema_decay: float | None = 0.999):
        check_seq_len("LMObjective", model, seq_len)
        if ema_decay is not None and not 0.0 <= ema_decay <= 1.0:
            raise ValueError(f"LMObjective.ema_decay must be in [0, 1] or None, got {ema_decay}")
        check_pretrained("LMObjective", pretrained)
        self.model = model
        self.seq_len = seq_len
        self.pretrained = pretrained
        self.loss_role = None if loss_role is None else Role(int(loss_role))
        self.ema_decay = ema_decay

    def init(self, key, variables=None):
        return initial_variables(self.model, self.pretrained, key, self.seq_len, variables)

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse a batch whose fields or shapes this objective cannot read, on the host."""
        if "text" not in batch:
            raise KeyError(
                f"LMObjective needs a 'text' field [B, {self.seq_len + 1}]; the batch has "
                f"{describe(batch)}"
            )
        shape = np.shape(batch["text"])
        if len(shape) != 2 or shape[1] != self.seq_len + 1:
            raise ValueError(
                f"batch field 'text' has shape {shape}, expected [B, seq_len + 1] = "
                f"[B, {self.seq_len + 1}]; set LMObjective(seq_len=...) to the row width minus one"
            )
        if self.loss_role is not None and "text_roles" not in batch:
            raise KeyError(
                f"LMObjective(loss_role={self.loss_role.name}) needs 'text_roles' in every batch "
                "to know which targets count; add roles or construct it with loss_role=None"
            )
        check_token_ids("text", batch["text"], self.model)
        for name in OPTIONAL_FIELDS:
            if name in batch and np.shape(batch[name]) != shape:
                raise ValueError(
                    f"batch field {name!r} has shape {np.shape(batch[name])}, but 'text' has "
                    f"{shape}; every text field must share one shape"
                )

    def _weights(self, batch):
        """Which targets count `[B, L]`: same document, not padding, and the loss role if set."""
        text = batch["text"]
        weights = jnp.ones(text[:, 1:].shape, jnp.float32)
        segments = batch.get("text_segment_ids")
        if segments is not None:
            same_document = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
            weights = weights * same_document
        if self.loss_role is not None:
            weights = weights * (batch["text_roles"][:, 1:] == int(self.loss_role))
        return weights

    def _loss_sums(self, params, batch, dropout_key=None, *, routing: bool = False) -> tuple[Metrics, Any]:
        """Summed negative log-likelihood, right argmax predictions and counted targets, and the
        forward's expert routing when asked (else None); the training forward passes
        `dropout_key` (adapter dropout), evaluation does not."""
        text = batch["text"]
        segments = batch.get("text_segment_ids")
        positions = batch.get("text_positions")
        weights = self._weights(batch)
        log_prob_sum, top, *routed = weighted_log_prob_sum(
            self.model, params, text[:, :-1], text[:, 1:], weights,
            None if segments is None else segments[:, :-1],
            None if positions is None else positions[:, :-1],
            dropout_key=dropout_key, return_routing=routing,
        )
        count = weights.sum()
        sums = {"loss": (-log_prob_sum, count), "accuracy": ((top * weights).sum(), count)}
        return sums, (routed[0] if routing else None)

    def terms(self, params, batch, *, step, reference, key) -> LossTerms:
        """The summed NLL over its target count; an MoE model's router terms join the total
        (objectives/routing.py) while the `loss` metric stays the NLL, which perplexity reads."""
        del step, reference
        sums, routing = self._loss_sums(params, batch, dropout_key=key, routing=has_experts(self.model))
        total, count = sums["loss"]
        metrics = {**sums, "tokens": (count, jnp.ones(()))}
        if routing is not None:
            extra, router_metrics = router_terms(self.model, routing, count)
            total, metrics = total + extra, {**metrics, **router_metrics}
        return LossTerms(total, count, metrics)

    def evaluate(self, params, batch) -> Metrics:
        return self._loss_sums(params, batch)[0]

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        return with_perplexity(means)
