"""The output head scored in chunks of tokens: target log-probs without the `[N, V]` logits.

`target_scores(hidden, weight, targets, ...)` returns, per token, log p(target) under
`softmax(hidden @ weight / temperature)`, whether the target has the highest logit, and (when
asked) the entropy of that distribution. It runs over chunks of `chunk` tokens inside a
`lax.scan` under a custom VJP: the forward pass keeps only each token's log-normalizer, and the
backward pass recomputes one chunk's logits at a time to form its gradient, so neither the
logits nor their gradient ever exist for more than one chunk. Peak memory is `chunk x V` floats
a few times over instead of `N x V`, and the weight gradient accumulates chunk by chunk.

`weighted_log_prob_sum(hidden, weight, targets, token_weights)` is the LM loss's special case:
a sum of log-probs with fixed weights, whose gradient the forward pass can form from each
chunk's logits while it has them, so training runs three head products per chunk, not four.

Under a data-parallel `jit` each device scores its own tokens and the devices' weight
gradients are summed once per call (`_summed_once`). Not here: the full logits
(`CausalTransformer.logits`), sampling (sampling.py), vocabulary sharding across devices.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from dew_lib.models import partitioning

# Bytes of float32 logits one chunk may hold: large enough for full-width matmuls, small enough
# that a 150k vocabulary stays a few hundred MB however many tokens a batch holds. Below 128
# tokens a chunk's products read the whole head weight for too few rows: at Qwen's 151,936 ids
# chunks of 64 made the training step 1.48x slower than chunks of 128.
CHUNK_BYTES = 64 * 2**20
MIN_CHUNK, MAX_CHUNK = 128, 4096


def chunk_tokens(vocab_size: int, tokens: int, budget: int = CHUNK_BYTES) -> int:
    """Tokens per chunk for this vocabulary: the budget's worth of float32 logits, a multiple
    of 64 in [128, 4096], and never more than the tokens there are (rounded up to 8)."""
    size = max(MIN_CHUNK, min(MAX_CHUNK, budget // (4 * vocab_size) // 64 * 64))
    return max(8, min(size, -(-tokens // 8) * 8))


def target_scores(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *,
                  temperature: float = 1.0, vocab_major: bool = False, chunk: int | None = None,
                  compute_dtype: Any = None, entropy: bool = False):
    """Per-token scores of `targets` under the head `weight`, computed chunk by chunk.

    hidden: `[..., E]`; targets: `[...]` ids. weight: `[E, V]`, or `[V, E]` with
    `vocab_major=True` (a tied embedding table). compute_dtype: the matmul input dtype (default:
    hidden's); logits and everything after them are float32. chunk: tokens per chunk (default:
    `chunk_tokens`). Returns `(log_probs, is_top)` float32 and bool of targets' shape, plus
    `entropy` (float32, in nats, differentiable) when `entropy=True`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score targets, got {temperature}")
    shape = targets.shape
    e = hidden.shape[-1]
    if hidden.shape[:-1] != shape:
        raise ValueError(f"hidden {hidden.shape} and targets {shape} disagree on the token axes")
    size, (chunks_h, chunks_t), unchunk = _chunked(weight, vocab_major, chunk,
                                                    hidden.reshape(-1, e), targets.reshape(-1))
    options = _Options(float(temperature), bool(vocab_major), size,
                       jnp.dtype(compute_dtype or hidden.dtype), bool(entropy))
    log_probs, is_top, ent = _scores(chunks_h, weight, chunks_t.astype(jnp.int32), options)
    out = [unchunk(x).reshape(shape) for x in (log_probs, is_top)]
    if entropy:
        out.append(unchunk(ent).reshape(shape))
    return tuple(out)


def weighted_log_prob_sum(hidden: jax.Array, weight: jax.Array, targets: jax.Array,
                          token_weights: jax.Array, *, vocab_major: bool = False,
                          chunk: int | None = None, compute_dtype: Any = None):
    """`(sum(token_weights * log p(targets)), is_top)`: the LM loss's one differentiable
    number, and whether each target has the highest logit.

    The gradient of a weighted sum of log-probs is known before any cotangent arrives, so it is
    formed in the forward pass, chunk by chunk, while the chunk's logits are at hand: three head
    products per chunk where `target_scores` under a loss needs four (its backward pass
    recomputes the logits). Without differentiation only the scores are computed. Arguments as
    in `target_scores` (temperature 1); `token_weights` (same shape as `targets`) is data, not
    differentiated.
    """
    shape = targets.shape
    e = hidden.shape[-1]
    if hidden.shape[:-1] != shape or token_weights.shape != shape:
        raise ValueError(f"hidden {hidden.shape}, targets {shape} and token_weights "
                         f"{token_weights.shape} disagree on the token axes")
    size, (chunks_h, chunks_t, chunks_w), unchunk = _chunked(
        weight, vocab_major, chunk, hidden.reshape(-1, e), targets.reshape(-1),
        jax.lax.stop_gradient(token_weights).reshape(-1).astype(jnp.float32))
    options = _Options(1.0, bool(vocab_major), size, jnp.dtype(compute_dtype or hidden.dtype), False)
    total, is_top = _weighted(chunks_h, weight, chunks_t.astype(jnp.int32), chunks_w, options)
    return total, unchunk(is_top).reshape(shape)


def _chunked(weight, vocab_major, chunk, *flat):
    """Tokens per chunk, the flat per-token arrays `flat` padded and cut into `[count, size, ...]`
    chunks, and the function that flattens a `[count, size]` result back to the tokens.

    Chunk j holds every count-th token from token j on, not a contiguous run: a batch split
    across devices splits each chunk the same way, so the loop over chunks stays on each
    device's own tokens. Contiguous chunks would each live on one device, and data-parallel
    steps all-gathered the hidden states and scored every token on every device.
    """
    vocab = weight.shape[0] if vocab_major else weight.shape[1]
    tokens = flat[0].shape[0]
    size = chunk or chunk_tokens(vocab, tokens)
    count = -(-tokens // size)
    pad = count * size - tokens
    padded = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x for x in flat]
    chunks = tuple(partitioning.constrain_rows(jnp.swapaxes(x.reshape(size, count, *x.shape[1:]), 0, 1), 1)
                   for x in padded)
    return size, chunks, lambda x: jnp.swapaxes(x, 0, 1).reshape(count * size)[:tokens]


class _Options(tuple):
    """Static settings of one head call (hashable, so it can be a non-differentiated argument)."""

    def __new__(cls, temperature, vocab_major, chunk, dtype, entropy):
        return super().__new__(cls, (temperature, vocab_major, chunk, dtype, entropy))

    temperature = property(lambda self: self[0])
    vocab_major = property(lambda self: self[1])
    chunk = property(lambda self: self[2])
    dtype = property(lambda self: self[3])
    entropy = property(lambda self: self[4])


def _logits(h, weight, options: _Options):
    """float32 logits `[C, V]` of one chunk `h` `[C, E]`."""
    h = h.astype(options.dtype)
    w = weight.astype(options.dtype)
    contract = ((1,), (1,)) if options.vocab_major else ((1,), (0,))
    return jax.lax.dot_general(h, w, (contract, ((), ())), preferred_element_type=jnp.float32)


def _chunk_forward(h, t, weight, options: _Options):
    """log p(target), is_top, log-normalizer and entropy (zeros unless asked) of one chunk."""
    return _chunk_scores(_logits(h, weight, options), t, options)


def _chunk_scores(logits, t, options: _Options):
    """`_chunk_forward` from the chunk's logits."""
    top = jnp.max(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
    is_top = picked >= top  # on the raw logits: temperature never changes the argmax test
    if options.temperature != 1.0:
        z, m, picked = logits / options.temperature, top / options.temperature, picked / options.temperature
    else:
        z, m = logits, top
    e = jnp.exp(z - m[:, None])
    total = jnp.sum(e, axis=-1)
    lse = m + jnp.log(total)
    if options.entropy:
        ent = lse - jnp.sum(e * z, axis=-1) / total
    else:
        ent = jnp.zeros_like(lse)
    return picked - lse, is_top, lse, ent


def _forward_all(hidden, weight, targets, options):
    def body(_, chunk):
        h, t = chunk
        return None, _chunk_forward(h, t, weight, options)

    _, (log_probs, is_top, lse, ent) = jax.lax.scan(body, None, (hidden, targets))
    return log_probs, is_top, lse, ent


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _scores(hidden, weight, targets, options):
    log_probs, is_top, _, ent = _forward_all(hidden, weight, targets, options)
    return log_probs, is_top, ent


def _scores_fwd(hidden, weight, targets, options):
    log_probs, is_top, lse, ent = _forward_all(hidden, weight, targets, options)
    return (log_probs, is_top, ent), (hidden, weight, targets, lse, ent)


def _scores_bwd(options, residuals, cotangents):
    hidden, weight, targets, lse, ent = residuals
    g_lp, _, g_ent = cotangents
    g_ent = g_ent if options.entropy else jnp.zeros_like(g_lp)
    grad_w, grad_h = _backward_loop(hidden, weight, targets, lse, ent, g_lp, g_ent, options)
    return grad_h, _weight_gradient(grad_w, weight, options), None


def _backward_loop_local(hidden, weight, targets, lse, ent, g_lp, g_ent, options):
    """`(d weight [E, V], d hidden)` of `target_scores`, chunk by chunk, on one device's tokens."""
    inverse_t = 1.0 / options.temperature

    def body(grad_w, chunk):
        h, t, lse_c, ent_c, g_c, g_e = chunk
        logits = _logits(h, weight, options)
        z = logits * inverse_t if options.temperature != 1.0 else logits
        p = jnp.exp(z - lse_c[:, None])
        # d log p(t) / dz = onehot(t) - p; d H / dz = -p (log p + H) = -p (z - lse + H)
        dz = _onehot_minus(p, t) * g_c[:, None]
        if options.entropy:
            dz = dz - p * (z - (lse_c - ent_c)[:, None]) * g_e[:, None]
        if options.temperature != 1.0:
            dz = dz * inverse_t
        grad_h, step = _head_products(dz, h, weight, options)
        return grad_w + step, grad_h.astype(hidden.dtype)

    return jax.lax.scan(body, _zero_weight_gradient(weight, options),
                        (hidden, targets, lse, ent, g_lp, g_ent))


_scores.defvjp(_scores_fwd, _scores_bwd)


def _onehot_minus(p, t):
    """`onehot(t) - p` `[C, V]`: d log p(t) / d logits of a chunk whose softmax is `p`."""
    hit = jnp.arange(p.shape[-1], dtype=jnp.int32)[None, :] == t[:, None]
    return hit.astype(jnp.float32) - p


def _head_products(dz, h, weight, options: _Options):
    """The gradients `(d hidden, d weight)` of one chunk from `dz`, d(loss)/d(logits) `[C, V]`.

    The weight gradient comes out `[E, V]` whatever the weight's layout (`_weight_gradient`
    turns the sum over chunks back). It is formed as `h^T @ dz` from a materialized `[E, C]`
    copy of the chunk's hidden states: left to itself, XLA folds the transpose into the product,
    and XLA:CPU runs a product contracting both operands' leading axes on its own emitter at
    about half the rate its YNN library reaches on the plain layout (46 against 101 GFLOP/s
    for `[2048, 256]^T x [2048, 8192]`). The copy is `C x E` floats, small beside `dz`.
    """
    dz = dz.astype(options.dtype)
    hc = h.astype(options.dtype)
    w = weight.astype(options.dtype)
    contract = (((1,), (0,)), ((), ())) if options.vocab_major else (((1,), (1,)), ((), ()))
    grad_h = jax.lax.dot_general(dz, w, contract, preferred_element_type=jnp.float32)
    h_t = jax.lax.optimization_barrier(hc.T)
    grad_w = jax.lax.dot_general(h_t, dz, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return grad_h, grad_w


def _weight_gradient(grad_w, weight, options: _Options):
    """The `[E, V]` sum of `_head_products`' weight gradients in the weight's own layout."""
    return (grad_w.T if options.vocab_major else grad_w).astype(weight.dtype)


def _zero_weight_gradient(weight, options: _Options):
    e, v = weight.shape[::-1] if options.vocab_major else weight.shape
    return jnp.zeros((e, v), jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _weighted(hidden, weight, targets, token_weights, options):
    log_probs, is_top, _, _ = _forward_all(hidden, weight, targets, options)
    return jnp.sum(log_probs * token_weights), is_top


def _weighted_fwd(hidden, weight, targets, token_weights, options):
    grad_w, log_probs, is_top, grad_h = _weighted_loop(hidden, weight, targets, token_weights, options)
    return (jnp.sum(log_probs * token_weights), is_top), (grad_h, _weight_gradient(grad_w, weight, options))


def _weighted_loop_local(hidden, weight, targets, token_weights, options):
    """`(d weight [E, V], log p(targets), is_top, d hidden)` of the weighted sum, chunk by
    chunk, on one device's tokens."""
    def body(grad_w, chunk):
        h, t, w_t = chunk
        logits = _logits(h, weight, options)
        log_probs, is_top, lse, _ = _chunk_scores(logits, t, options)
        dz = _onehot_minus(jnp.exp(logits - lse[:, None]), t) * w_t[:, None]
        grad_h, step = _head_products(dz, h, weight, options)
        return grad_w + step, (log_probs, is_top, grad_h.astype(hidden.dtype))

    grad_w, (log_probs, is_top, grad_h) = jax.lax.scan(body, _zero_weight_gradient(weight, options),
                                                       (hidden, targets, token_weights))
    return grad_w, log_probs, is_top, grad_h


def _weighted_bwd(options, residuals, cotangents):
    del options
    grad_h, grad_w = residuals
    scale = cotangents[0]
    return (grad_h * scale.astype(grad_h.dtype), grad_w * scale.astype(grad_w.dtype), None, None)


_weighted.defvjp(_weighted_fwd, _weighted_bwd)


def _summed_once(loop_local):
    """`loop_local(hidden, weight, *per_token, options) -> (grad_w, *per_token_results)` under
    `custom_partitioning`: each device loops over its own share of every chunk's tokens and
    the devices' weight gradients are summed once, after the loop.

    Left to XLA's partitioner, the loop's running weight-gradient sum is kept replicated, so
    every trip all-reduces a `[E, V]` partial sum: 16 all-reduces of 155 MB a step at Qwen's
    vocabulary and 2 x 1,024 tokens, where one suffices. The chunk arrays are `[count, size,
    ...]` with the tokens of each chunk on axis 1, which is how the data-parallel batch splits
    them (`_chunked`); the weight is replicated. A device holds `size / devices` tokens of each
    chunk and joins that many chunks into one, so its products keep the rows per chunk that the
    vocabulary's budget chose: chunks of 64 rows ran the head 1.5x slower (`MIN_CHUNK`).
    """

    def shardings(mesh, arg_shapes, result_shapes):
        spec = arg_shapes[0].sharding.spec
        axis = spec[1] if len(spec) > 1 else None

        def split(x):  # every chunk on every device, each chunk's tokens split as the batch is
            return NamedSharding(mesh, PartitionSpec(None, axis, *[None] * (len(x.shape) - 2)))

        whole = NamedSharding(mesh, PartitionSpec())
        args = (split(arg_shapes[0]), whole, *map(split, arg_shapes[2:]))
        return axis, args, (whole, *map(split, result_shapes[1:]))

    def partition(options, mesh, arg_shapes, result_shapes):
        axis, args, results = shardings(mesh, arg_shapes, result_shapes)
        shards = _axis_size(mesh, axis)

        def lower(hidden, weight, *per_token):
            join = math.gcd(hidden.shape[0], shards)
            joined = [x.reshape(x.shape[0] // join, join * x.shape[1], *x.shape[2:])
                      for x in (hidden, *per_token)]
            grad_w, *rest = loop_local(joined[0], weight, *joined[1:], options)
            rest = [x.reshape(hidden.shape[0], hidden.shape[1], *x.shape[2:]) for x in rest]
            return (jax.lax.psum(grad_w, axis) if axis is not None else grad_w, *rest)

        return mesh, lower, results, args

    def infer(options, mesh, arg_shapes, result_shapes):
        return shardings(mesh, arg_shapes, result_shapes)[2]

    def rule(options, mesh, arg_types, result_types):
        # factors: c chunks, n tokens of a chunk, e hidden features, v vocabulary
        del mesh
        per_token = lambda t: "c n e" if len(t.shape) == 3 else "c n"  # noqa: E731
        weight = "v e" if options.vocab_major else "e v"
        operands = ", ".join(["c n e", weight, *map(per_token, arg_types[2:])])
        return f"{operands} -> " + ", ".join(["e v", *map(per_token, result_types[1:])])

    options_at = len(inspect.signature(loop_local).parameters) - 1  # options come last
    split = custom_partitioning(loop_local, static_argnums=(options_at,))
    split.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return split


def _axis_size(mesh, axis) -> int:
    """Devices along a sharding's mesh axis (a name, a tuple of names, or None)."""
    names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
    return math.prod(mesh.shape[name] for name in names)


_backward_loop = _summed_once(_backward_loop_local)
_weighted_loop = _summed_once(_weighted_loop_local)

__all__ = ["CHUNK_BYTES", "chunk_tokens", "target_scores", "weighted_log_prob_sum"]
