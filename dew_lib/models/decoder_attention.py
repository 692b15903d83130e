"""The decoder's attention, in the layout of its projections: queries `[B, S, H, D]`, keys and
values `[B, S, KV, D]`, grouped-query heads.

`attend` is dense attention under any mask (the reference); `attend_causal` is causal attention
within segments, through the compiled XLA:CPU kernel (`fused_attention`) or by blocks of queries
(`attention.causal_heads`), as `attention_kernel` picks; `attend_cached` is one decode step's
query against a head-major KV cache.

Not here: the softmax kernels (`attention`, `fused_attention`), the cache (`decoder.KVCache`),
the projections around attention (`decoder_layer.Block`).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from dew_lib.kernels import KernelBuildError, load_causal_attention
from dew_lib.models import attention, fused_attention
from dew_lib.options import choice


def attend(q, k, v, mask):
    """Grouped-query attention: q `[B, Q, H, D]`, k/v `[B, T, KV, D]`, mask `[B, Q, T]`.

    Computed heads-first with batch and kv-head merged into one batch axis (`[B*KV, G*Q, D]`):
    XLA:CPU runs a single-batch-axis product much faster than one with two batch axes. The
    dense reference for `attend_causal`, and what any other mask uses.
    """
    b, sq, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    t = k.shape[1]
    qh = q.reshape(b, sq, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b * kv, g * sq, d)
    kh = k.transpose(0, 2, 1, 3).reshape(b * kv, t, d)
    vh = v.transpose(0, 2, 1, 3).reshape(b * kv, t, d)
    return attention.heads(qh, kh, vh, mask, g).reshape(b, kv, g, sq, d).transpose(
        0, 3, 1, 2, 4).reshape(b, sq, h * d)


ATTENTION_KERNELS = ("auto", "fused", "blockwise")


def attend_causal(q, k, v, segment_ids, block: int, kernel: str = "auto"):
    """Causal self-attention within segments: q `[B, S, H, D]`, k/v `[B, S, KV, D]`,
    segment_ids `[B, S]` (a query sees earlier keys of its own segment; padding, segment 0,
    sees padding). Returns `[B, S, H * D]`.

    `kernel` picks the implementation: "fused", the compiled XLA:CPU kernel of
    `fused_attention` (tiles kept in cache; about twice the blockwise form's speed on CPU);
    "blockwise", XLA operations by blocks of `block` queries, for any backend and head size;
    "auto", the fused kernel when JAX's default backend is the CPU and the head dim is a
    multiple of 8, else blockwise.
    """
    b, s, h, d = q.shape
    if _use_fused(kernel, d, h, k.shape[2]):
        return fused_attention.causal_attention(q, k, v, segment_ids).reshape(b, s, h * d)
    return _attend_blockwise(q, k, v, segment_ids, block)


def _use_fused(kernel: str, head_dim: int, heads: int, kv_heads: int) -> bool:
    choice("attention kernel", kernel, ATTENTION_KERNELS)
    if kernel != "auto":
        return kernel == "fused"
    if jax.default_backend() != "cpu" or not fused_attention.supported(head_dim, heads, kv_heads):
        return False
    try:
        load_causal_attention()
    except KernelBuildError as error:
        _warn_blockwise(str(error))
        return False
    return True


@functools.cache
def _warn_blockwise(reason: str) -> None:
    warnings.warn(f"attention_kernel='auto' runs the slower blockwise attention: {reason}",
                  RuntimeWarning, stacklevel=4)


def _attend_blockwise(q, k, v, segment_ids, block: int):
    """Causal attention by blocks of `block` queries, in XLA operations.

    Query block i reads only keys `[0, (i + 1) * block)`: the blocks above the diagonal, always
    fully masked, are never computed, which halves the score and softmax work of long
    sequences. Each block's softmax runs over every key it may see, so the result equals
    `attend` with the dense mask.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qh = q.reshape(b, s, kv, g, d).transpose(0, 2, 3, 1, 4)  # [B, KV, G, S, D]
    kh = k.transpose(0, 2, 1, 3).reshape(b * kv, s, d)
    vh = v.transpose(0, 2, 1, 3).reshape(b * kv, s, d)
    out = attention.causal_heads(qh, kh, vh, segment_ids, g, block)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h * d)


def attend_cached(q, k, v, visible):
    """One query per row against a head-major cache: q `[B, 1, H, D]`, k/v `[B, KV, T, D]`."""
    b, _, h, d = q.shape
    kv = k.shape[1]
    g, t = h // kv, k.shape[2]
    q = q.reshape(b * kv, g, d)  # one merged batch axis, as in `attend`
    scores = jnp.einsum("ngd,ntd->ngt", q, k.reshape(b * kv, t, d), preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None, :], scores.reshape(b, kv, g, t) * (d**-0.5), attention.NEG)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b * kv, g, t)
    return jnp.einsum("ngt,ntd->ngd", weights, v.reshape(b * kv, t, d)).reshape(b, 1, h * d)
