"""Softmax attention over merged heads whose backward pass recomputes the weights.

Autodiff of `softmax(q k^T) v` keeps the `[heads, queries, keys]` attention weights of every
layer for the backward pass: at batch 16 x 256 with 4 heads that is 17 MB a layer, written and
read back each step, the largest residual a training step keeps. This kernel keeps only each
row's maximum score and softmax denominator (`[heads, queries]`) and rebuilds the weights from
the queries and keys in the backward pass, as flash attention does; one more `q k^T` product
buys the memory back.

The forward pass computes what `jax.nn.softmax` computes, in the same order, so its outputs
are those of the plain form bit for bit; the gradients are the same math added in a
different order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG = -1e30  # finite, so a row with nothing to attend to gives no NaN


def _scores(qh, kh, mask, groups):
    """Scaled scores `[N, G*Q, T]` with masked slots at NEG; mask `[B, Q, T]` covers every
    group of heads sharing a key head (N = B * KV)."""
    n, gq, d = qh.shape
    b, sq, t = mask.shape
    scores = jnp.einsum("nqd,ntd->nqt", qh, kh, preferred_element_type=jnp.float32) * (d**-0.5)
    full = jnp.broadcast_to(mask[:, None, None], (b, n // b, groups, sq, t)).reshape(n, gq, t)
    return jnp.where(full, scores, NEG), full


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def heads(qh, kh, vh, mask, groups: int):
    """Attention of queries `[N, G*Q, D]` over keys and values `[N, T, D]` (N = B * KV, the
    batch and key heads merged; each key head serves G query heads), under `mask` `[B, Q, T]`."""
    return _forward(qh, kh, vh, mask, groups)[0]


def _forward(qh, kh, vh, mask, groups):
    scores, _ = _scores(qh, kh, mask, groups)
    top = jnp.max(scores, axis=-1, keepdims=True)
    unnormalized = jnp.exp(scores - top)
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    weights = (unnormalized / total).astype(vh.dtype)
    return jnp.einsum("nqt,ntd->nqd", weights, vh), (top, total)


def _heads_fwd(qh, kh, vh, mask, groups):
    out, (top, total) = _forward(qh, kh, vh, mask, groups)
    return out, (qh, kh, vh, mask, top, total)


def _heads_bwd(groups, residuals, d_out):
    qh, kh, vh, mask, top, total = residuals
    scores, full = _scores(qh, kh, mask, groups)
    weights = jnp.exp(scores - top) / total  # float32, as in the forward pass
    d_weights = jnp.einsum("nqd,ntd->nqt", d_out, vh, preferred_element_type=jnp.float32)
    d_v = jnp.einsum("nqt,nqd->ntd", weights.astype(vh.dtype), d_out)
    # softmax's backward; masked slots took no part in the scores, so they get no gradient
    d_scores = weights * (d_weights - jnp.sum(weights * d_weights, axis=-1, keepdims=True))
    d_scores = jnp.where(full, d_scores, 0.0) * (qh.shape[-1] ** -0.5)
    d_scores = d_scores.astype(qh.dtype)
    d_q = jnp.einsum("nqt,ntd->nqd", d_scores, kh, preferred_element_type=jnp.float32)
    d_k = jnp.einsum("nqt,nqd->ntd", d_scores, qh, preferred_element_type=jnp.float32)
    return d_q.astype(qh.dtype), d_k.astype(kh.dtype), d_v.astype(vh.dtype), None


heads.defvjp(_heads_fwd, _heads_bwd)
