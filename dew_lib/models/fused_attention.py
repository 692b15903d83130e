"""Causal attention within segments through Dew's compiled XLA:CPU kernel.

The kernel (`dew_lib/kernels/causal_attention.cc`) runs flash-attention style: tiles of 64
queries and keys, an online softmax, and a backward pass that rebuilds the weights from each
query's log-sum-exp, so neither pass writes a score matrix to memory. It reads queries, keys
and values in the projections' `[B, S, heads, D]` layout. It computes in float32 whatever the
inputs' dtype. Under a sharded `jit` it runs on each device's share of the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from dew_lib.kernels import load_causal_attention


def supported(head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether the kernel takes these heads: a head dim that is a multiple of 8."""
    return head_dim % 8 == 0 and num_heads % num_kv_heads == 0


def causal_attention(q, k, v, segment_ids):
    """q `[B, S, H, D]`, k/v `[B, S, KV, D]`, segment_ids `[B, S]` -> `[B, S, H, D]` in q's
    dtype. A query sees earlier keys of its own segment (padding, segment 0, sees padding)."""
    b, s, h, d = q.shape
    if not supported(d, h, k.shape[2]):
        raise ValueError(
            f"the fused attention kernel needs a head dim that is a multiple of 8 and heads a "
            f"multiple of key heads, got head_dim={d}, heads={h}, kv heads={k.shape[2]}; use "
            "attention_kernel='blockwise'")
    load_causal_attention()
    f32 = jnp.float32
    out = _attention(q.astype(f32), k.astype(f32), v.astype(f32), segment_ids.astype(jnp.int32))
    return out.astype(q.dtype)


@jax.custom_vjp
def _attention(q, k, v, segment_ids):
    return _forward(q, k, v, segment_ids)[0]


def _attention_fwd(q, k, v, segment_ids):
    out, lse = _forward(q, k, v, segment_ids)
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(residuals, d_out):
    return (*_backward(*residuals, d_out), None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _scale(q):
    return np.float32(q.shape[-1] ** -0.5)


def _forward_call(q, k, v, segment_ids):
    """`(out [B, S, H, D], lse [B, H, S])`: the output and each query's log-sum-exp of scores."""
    b, s, h, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
              jax.ShapeDtypeStruct((b, h, s), jnp.float32))
    return jax.ffi.ffi_call("dew_causal_attention_forward", shapes)(
        q, k, v, segment_ids, scale=_scale(q))


def _backward_call(q, k, v, segment_ids, out, lse, d_out):
    """`(d_q, d_k, d_v)` from the forward's output and log-sum-exp."""
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    return jax.ffi.ffi_call("dew_causal_attention_backward", shapes)(
        q, k, v, segment_ids, out, lse, d_out, scale=_scale(q))


def _split_over_batch(call, rule, result_ranks):
    """`call` under `custom_partitioning`: each device runs the kernel on its share of the
    batch (the operands' leading axis); any other sharding of the operands is gathered first."""

    def shardings(mesh, arg_shapes):
        spec = arg_shapes[0].sharding.spec
        axis = spec[0] if len(spec) else None

        def on_batch(rank):
            return NamedSharding(mesh, PartitionSpec(axis, *[None] * (rank - 1)))

        args = tuple(on_batch(len(x.shape)) for x in arg_shapes)
        return args, tuple(on_batch(rank) for rank in result_ranks)

    def partition(mesh, arg_shapes, result_shape):
        args, results = shardings(mesh, arg_shapes)
        return mesh, call, results, args

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    split = custom_partitioning(call)
    split.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                        need_replication_factors=("s", "h", "d", "k"))
    return split


# factors: b batch, s sequence, h query heads, k key heads, d head dim
_forward = _split_over_batch(
    _forward_call, "b s h d, b s k d, b s k d, b s -> b s h d, b h s", (4, 3))
_backward = _split_over_batch(
    _backward_call,
    "b s h d, b s k d, b s k d, b s, b s h d, b h s, b s h d -> b s h d, b s k d, b s k d",
    (4, 4, 4))
