"""Scoring sampled ids over the support the sampler kept (top-k / top-p draws).

A filtered sampler draws from the renormalized distribution over its kept ids, so the
likelihood that matches the draw is `z_t / T - logsumexp(z_s / T for s in support)`, not the
full-vocabulary softmax. `pack` records each row's kept ids back to back in `support_ids`
with the input_ids column of the sampled id they belong to in `support_columns` (-1: unused).

Not here: recording the support (engines and sources do) and the policy loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dew_lib.objectives.lm import decoder_hidden, score_targets


def support_log_probs(model, params, inputs, targets, segments, positions, support_ids,
                      support_columns, temperature: float, dropout_key: jax.Array | None = None, *,
                      routes=None, return_routing: bool = False):
    """log p(target) `[R, T]`, over the recorded support where a column has one.

    inputs/targets/segments/positions: `[R, T]` (targets are input_ids[:, 1:]). support_ids,
    support_columns: `[R, C]` aligned with input_ids columns. Columns without support entries
    are scored over the whole vocabulary at `temperature`. dropout_key: a training forward's
    (adapter dropout); both passes below draw the same masks from it. routes, return_routing:
    as `lm.score_targets` takes them (both passes replay the same routes); with return_routing
    the result is `(log_probs, routing)`.
    """
    rows, t = targets.shape
    full, _, *routed = score_targets(model, params, inputs, targets, segments, positions, temperature=temperature,
                                     dropout_key=dropout_key, routes=routes, return_routing=return_routing)
    valid = (support_columns >= 1) & (support_ids >= 0)  # [R, C]
    position = jnp.clip(support_columns - 1, 0, t - 1)  # prediction position of that column
    ids = jnp.maximum(support_ids, 0)
    hidden = decoder_hidden(model, params, inputs, segments, positions, dropout_key=dropout_key,
                            routes=routes)  # [R, T, E]
    at = jnp.take_along_axis(hidden, position[..., None], axis=1)  # [R, C, E]
    if hasattr(model, "id_logits"):
        z = model.apply(params, at, ids, method=model.id_logits)
    else:
        logits = model.apply(params, at, method=model.logits)
        z = jnp.take_along_axis(logits, ids[..., None], axis=-1)[..., 0]
    z = z.astype(jnp.float32) / temperature  # [R, C]

    slot = jnp.where(valid, jnp.arange(rows)[:, None] * t + position, rows * t).reshape(-1)
    segments_total = rows * t + 1
    flat = jnp.where(valid, z, -jnp.inf).reshape(-1)
    peak = jax.ops.segment_max(flat, slot, num_segments=segments_total)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    mass = jax.ops.segment_sum(jnp.exp(flat - peak[slot]), slot, num_segments=segments_total)
    lse = (jnp.log(jnp.maximum(mass, 1e-30)) + peak)[:-1].reshape(rows, t)
    target_at = jnp.take_along_axis(targets, position, axis=1)  # [R, C]
    is_target = valid & (support_ids == target_at)
    target_logit = jax.ops.segment_sum(jnp.where(is_target, z, 0.0).reshape(-1), slot,
                                       num_segments=segments_total)[:-1].reshape(rows, t)
    has_support = jax.ops.segment_sum(valid.reshape(-1).astype(jnp.int32), slot,
                                      num_segments=segments_total)[:-1].reshape(rows, t) > 0
    scores = jnp.where(has_support, target_logit - lse, full)
    return (scores, routed[0]) if return_routing else scores
