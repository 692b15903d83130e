"""Softmax attention over merged heads whose backward pass recomputes the weights.

Autodiff of `softmax(q k^T) v` keeps the `[heads, queries, keys]` attention weights of every
layer for the backward pass: at batch 16 x 256 with 4 heads that is 17 MB a layer, written and
read back each step, the largest residual a training step keeps. This kernel keeps only each
row's maximum score and softmax denominator (`[heads, queries]`) and its output, and rebuilds
the weights from the queries and keys in the backward pass, as flash attention does; one more
`q k^T` product buys the memory back. The backward pass holds the weights keys-first, the
layout in which XLA:CPU runs its products fastest.

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
    return out, (qh, kh, vh, mask, top, total, out)


def _heads_bwd(groups, residuals, d_out):
    qh, kh, vh, mask, top, total, out = residuals
    return (*_backward(qh, kh, vh, mask, top, total, out, d_out, groups), None)


def _backward(qh, kh, vh, mask, top, total, out, d_out, groups):
    """`(d_q, d_k, d_v)` of one `heads` call from its saved statistics."""
    # Works on the transposed weights `[N, T, G*Q]` (keys first): the value and key gradients
    # are then plain `[T, Q] x [Q, D]` products, which XLA:CPU runs about 3x faster on long
    # keys than the same products contracting the weights' leading query axis.
    d = qh.shape[-1]
    scores_t, full_t = _scores_transposed(qh, kh, mask, groups)
    weights_t = jnp.exp(scores_t - _as_row(top)) / _as_row(total)  # float32, as forward
    d_weights_t = jnp.einsum("ntd,nqd->ntq", vh, d_out, preferred_element_type=jnp.float32)
    d_v = jnp.einsum("ntq,nqd->ntd", weights_t.astype(vh.dtype), d_out)
    # softmax's backward, with each query's sum over keys of `weights * d_weights` taken as
    # `d_out . out` (the same sum, over D rather than T); masked slots took no part in the
    # scores, so they get no gradient
    rows = _as_row(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True))
    d_scores_t = jnp.where(full_t, weights_t * (d_weights_t - rows), 0.0) * (d**-0.5)
    d_scores_t = d_scores_t.astype(qh.dtype)
    d_k = jnp.einsum("ntq,nqd->ntd", d_scores_t, qh, preferred_element_type=jnp.float32)
    d_q = jnp.einsum("ntq,ntd->nqd", d_scores_t, kh, preferred_element_type=jnp.float32)
    return d_q.astype(qh.dtype), d_k.astype(kh.dtype), d_v.astype(vh.dtype)


def _scores_transposed(qh, kh, mask, groups):
    """`_scores` with keys first: `[N, T, G*Q]`, computed as `k q^T`."""
    n, gq, d = qh.shape
    b, sq, t = mask.shape
    scores = jnp.einsum("ntd,nqd->ntq", kh, qh, preferred_element_type=jnp.float32) * (d**-0.5)
    # transposed once into its own buffer: fused into each consumer, the strided reads of a
    # transposed mask cost more than the elementwise work around them
    mask_t = jax.lax.optimization_barrier(jnp.swapaxes(mask, 1, 2))[:, None, :, None, :]
    full = jnp.broadcast_to(mask_t, (b, n // b, t, groups, sq)).reshape(n, t, gq)
    return jnp.where(full, scores, NEG), full


def _as_row(column):
    """`[N, G*Q, 1]` per-query statistics as `[N, 1, G*Q]`, to broadcast over keys-first weights."""
    return jnp.swapaxes(column, 1, 2)


heads.defvjp(_heads_fwd, _heads_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def causal_heads(qh, kh, vh, segment_ids, groups: int, block: int):
    """Causal attention within segments by blocks of `block` queries: queries `[B, KV, G, S, D]`,
    keys and values `[B*KV, S, D]`, segment_ids `[B, S]`; returns `[B, KV, G, S, D]`.

    Query block i reads keys `[0, (i + 1) * block)` only, so blocks above the diagonal are
    never computed. One custom VJP over all blocks: the backward pass keeps the queries, keys,
    values and output once. Blocks that each were a `heads` call kept their own slice of the
    keys and values, a prefix per block, 4.5 copies of each at 8 blocks.
    """
    return _causal_forward(qh, kh, vh, segment_ids, groups, block)[0]


def _causal_blocks(segment_ids, block):
    """`(lo, hi, mask)` per query block: its query span and its `[B, Q, hi]` mask (a query sees
    earlier keys of its own segment; padding, segment 0, sees padding)."""
    s = segment_ids.shape[1]
    for lo in range(0, s, block):
        hi = min(lo + block, s)
        causal = jnp.arange(lo, hi)[:, None] >= jnp.arange(hi)[None, :]
        yield lo, hi, causal[None] & (segment_ids[:, lo:hi, None] == segment_ids[:, None, :hi])


def _causal_forward(qh, kh, vh, segment_ids, groups, block):
    b, kv, g, _, d = qh.shape
    outs, stats = [], []
    for lo, hi, mask in _causal_blocks(segment_ids, block):
        query = qh[:, :, :, lo:hi].reshape(b * kv, g * (hi - lo), d)
        out, top_total = _forward(query, kh[:, :hi], vh[:, :hi], mask, groups)
        outs.append(out.reshape(b, kv, g, hi - lo, d))
        stats.append(top_total)
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)), stats


def _causal_fwd(qh, kh, vh, segment_ids, groups, block):
    out, stats = _causal_forward(qh, kh, vh, segment_ids, groups, block)
    return out, (qh, kh, vh, segment_ids, stats, out)


def _causal_bwd(groups, block, residuals, d_out):
    qh, kh, vh, segment_ids, stats, out = residuals
    b, kv, g, _, d = qh.shape
    d_qs = []
    d_k = jnp.zeros(kh.shape, jnp.float32)
    d_v = jnp.zeros(vh.shape, jnp.float32)
    for (lo, hi, mask), (top, total) in zip(_causal_blocks(segment_ids, block), stats):
        span = (b * kv, g * (hi - lo), d)
        d_q, d_k_block, d_v_block = _backward(
            qh[:, :, :, lo:hi].reshape(span), kh[:, :hi], vh[:, :hi], mask, top, total,
            out[:, :, :, lo:hi].reshape(span), d_out[:, :, :, lo:hi].reshape(span), groups)
        d_qs.append(d_q.reshape(b, kv, g, hi - lo, d))
        d_k = d_k.at[:, :hi].add(d_k_block.astype(jnp.float32))
        d_v = d_v.at[:, :hi].add(d_v_block.astype(jnp.float32))
    d_q = d_qs[0] if len(d_qs) == 1 else jnp.concatenate(d_qs, axis=3)
    return d_q, d_k.astype(kh.dtype), d_v.astype(vh.dtype), None


causal_heads.defvjp(_causal_fwd, _causal_bwd)
