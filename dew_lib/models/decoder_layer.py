"""One decoder layer and what it is built from: RMSNorm, projections, the gated MLP.

`Block` is a pre-norm Llama/Qwen layer: RMSNorm, the q/k/v projections (with Qwen3's qk-norm or
Qwen2's biases when asked), rotary positions, causal attention, the output projection, then a
SiLU-gated MLP, or with `sparse` a mixture of experts (models/moe.py), each with its residual.
`Linear` has `nn.Dense`'s parameters but lets sibling projections that share an input run as one
matmul (`fused`). RMSNorm and the MLP's gated
product are recomputed in the backward pass rather than kept.

A layer's methods take `dropout`, a key or None: with a key, each adapter (models/lora.py) reads
its own dropped copy of its input; without one (evaluation, sampling) nothing is dropped. With
`quantized`, the projections' kernels are int8 with a scale per output channel (or NF4 codes with
an absmax per block; models/quantize.py), dequantized here, per layer.

Not here: the layer stack, embeddings and output head (`decoder.CausalTransformer`), the
attention functions (`decoder_attention`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.models import lora, moe, quantize, rotary
from dew_lib.models.decoder_attention import attend_causal

_INIT = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as the reference implementations do."""

    eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return _rms_norm(x, weight, self.eps, self.dtype)


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def _rms_norm(x, weight, eps, dtype):
    """RMSNorm recomputed in the backward pass from its input: a layer keeps `x` for each of
    its two norms rather than `x` and its normalized copy."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(dtype)


class Linear(nn.Module):
    """A projection whose weights sibling projections can read, to run several as one matmul.

    Same parameters as `nn.Dense` (`kernel` `[in, out]`, optional `bias`), declared in `setup`
    so a parent can concatenate kernels that share an input. With `lora_rank`, a low-rank
    adapter beside the kernel (`lora_a` `[in, r]`, `lora_b` `[r, out]`, models/lora.py) adds
    `lora_scale * (dropout(x) A) B` to the output. With `quantized`, `kernel` is int8 and
    `kernel_scale` `[out]` its float32 scale per output channel; with `quantized="nf4"`, `kernel`
    holds packed NF4 codes `[in/2, out]` and `kernel_absmax` `[in/block, out]` (models/quantize.py).
    """

    in_features: int
    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora_rank: int = 0
    lora_scale: float = 1.0
    lora_dropout: float = 0.0
    quantized: bool | str = False

    def setup(self):
        shape = (self.in_features, self.features)
        if self.quantized == "nf4":
            blocks = self.in_features // quantize.nf4_block(self.in_features)
            self.kernel = self.param("kernel", quantize.init_codes, (self.in_features // 2, self.features), jnp.uint8)
            self.kernel_scale = self.param(quantize.ABSMAX, quantize.init_absmax, (blocks, self.features), jnp.float32)
        elif self.quantized:
            self.kernel = self.param("kernel", quantize.init_values, shape, jnp.int8)
            self.kernel_scale = self.param(quantize.SCALE, quantize.init_scale, (self.features,), jnp.float32)
        else:
            self.kernel = self.param("kernel", _INIT, shape, self.param_dtype)
            self.kernel_scale = None
        if self.use_bias:
            self.bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
        if self.lora_rank:
            self.lora_a = self.param("lora_a", lora.A_INIT, (self.in_features, self.lora_rank), self.param_dtype)
            self.lora_b = self.param("lora_b", nn.initializers.zeros, (self.lora_rank, self.features),
                                     self.param_dtype)

    def __call__(self, x, dropout=None):
        return fused(x, [self], dropout)[0]


def _joined(arrays):
    return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=-1)


def fused(x, projections, dropout=None):
    """Apply projections that share the input `x` as one matmul; returns one output each.

    The matmul runs on `[B*S, in]` rows: then the weight gradient contracts one axis. Over
    `[B, S, in]` it contracts two, which XLA:CPU compiles into a transposed copy of the output
    gradient and a matmul at half the speed (the step ran 1.08-1.11x faster as rows).

    The adapters' `x A` are one matmul too, unless `dropout` (a key) and a nonzero rate give
    each adapter its own dropped input (its own mask, the key folded with its projection).
    """
    kernel = _joined([p.kernel for p in projections])
    scale = _joined([p.kernel_scale for p in projections]) if projections[0].quantized else None
    dtype = projections[0].dtype
    out = _on_rows(x, kernel, dtype, scale)
    if any(p.use_bias for p in projections):
        out = out + jnp.concatenate([
            p.bias if p.use_bias else jnp.zeros((p.features,), p.param_dtype) for p in projections
        ]).astype(dtype)
    cuts = np.cumsum([p.features for p in projections])[:-1].tolist()
    outs = jnp.split(out, cuts, axis=-1)
    adapted = [i for i, p in enumerate(projections) if p.lora_rank]
    if dropout is not None and any(projections[i].lora_dropout for i in adapted):
        for i in adapted:  # each adapter reads its own dropped copy of x
            p = projections[i]
            seen = lora.dropped(x, jax.random.fold_in(dropout, lora.TARGETS.index(p.name)), p.lora_dropout)
            outs[i] = outs[i] + p.lora_scale * _on_rows(_on_rows(seen, p.lora_a, dtype), p.lora_b, dtype)
    elif adapted:  # every adapter's x A as one matmul, then each its own B
        inner = _on_rows(x, jnp.concatenate([projections[i].lora_a for i in adapted], axis=1), dtype)
        parts = jnp.split(inner, np.cumsum([projections[i].lora_rank for i in adapted])[:-1].tolist(), axis=-1)
        for i, part in zip(adapted, parts, strict=True):
            outs[i] = outs[i] + projections[i].lora_scale * _on_rows(part, projections[i].lora_b, dtype)
    return outs


def _on_rows(x, kernel, dtype, scale=None):
    """`x @ kernel` computed on `[B*S, in]` rows (see `fused`), shaped back like `x`. With
    `scale`, `kernel` is quantized (int8 or NF4) and is dequantized here, in float32, one
    layer's kernel at a time inside the layer scan."""
    rows = x.reshape(-1, x.shape[-1]).astype(dtype)
    if scale is not None:
        kernel = quantize.dequantized_kernel(kernel, scale)
    return jnp.dot(rows, kernel.astype(dtype)).reshape(*x.shape[:-1], kernel.shape[-1])


def _dense(in_features, features, name, dtype, param_dtype, bias=False, adapter=None, quantized=False):
    """A projection, with the low-rank adapter `adapter` (a `lora.LoRA`) asks for it, and an int8
    kernel when `quantized`."""
    targeted = adapter is not None and name in adapter.targets
    rank, scale, rate = (adapter.rank, adapter.scale, adapter.dropout) if targeted else (0, 1.0, 0.0)
    return Linear(in_features, features, bias, dtype, param_dtype, rank, scale, rate, quantized, name=name)


@functools.partial(jax.checkpoint, static_argnums=(3, 9))
def _gated_down(gate, up, kernel, dtype, scale=None, lora_a=None, lora_b=None, lora_scale=1.0, dropout=None,
                rate=0.0):
    """The MLP's `down_proj(silu(gate) * up)` on rows, given the down projection's kernel (its
    scale when quantized), and its adapter's `A` and `B` when it has one, which reads the gated
    product dropped at `rate` when `dropout` is a key.

    Under `jax.checkpoint` with the down projection inside: a layer keeps `gate` and `up` for
    the backward pass and recomputes the gated product there (an elementwise pass) rather
    than keeping it as the down projection's input, one `[B*S, mlp_features]` array fewer
    in the layer scan's stacked residuals, and five fewer than autodiff keeps for the SiLU.
    """
    gated = nn.silu(gate) * up
    out = _on_rows(gated, kernel, dtype, scale)
    if lora_a is not None:
        seen = gated if dropout is None else lora.dropped(gated, dropout, rate)
        out = out + lora_scale * _on_rows(_on_rows(seen, lora_a, dtype), lora_b, dtype)
    return out


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` on rows: Qwen2-MoE's shared expert."""

    features: int
    hidden: int
    dtype: Any
    param_dtype: Any

    def setup(self):
        e, m, dt, pt = self.features, self.hidden, self.dtype, self.param_dtype
        self.gate_proj = _dense(e, m, "gate_proj", dt, pt)
        self.up_proj = _dense(e, m, "up_proj", dt, pt)
        self.down_proj = _dense(m, e, "down_proj", dt, pt)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One pre-norm decoder layer."""

    features: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_features: int
    qk_norm: bool
    attention_bias: bool
    norm_eps: float
    dtype: Any
    param_dtype: Any
    lora: Any = None  # a lora.LoRA: which projections carry adapters
    quantized: bool | str = False  # int8 (True) or "nf4" projection kernels (models/quantize.py)
    sparse: Any = None  # a moe.Sparse: a mixture of experts in place of the MLP

    def setup(self):
        h, kv, d, dt, pt = self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.param_dtype
        self.input_layernorm = RMSNorm(self.norm_eps, dt, pt)
        self.post_attention_layernorm = RMSNorm(self.norm_eps, dt, pt)
        e, m, adapter, bias = self.features, self.mlp_features, self.lora, self.attention_bias
        extra = dict(adapter=adapter, quantized=self.quantized)
        self.q_proj = _dense(e, h * d, "q_proj", dt, pt, bias, **extra)
        self.k_proj = _dense(e, kv * d, "k_proj", dt, pt, bias, **extra)
        self.v_proj = _dense(e, kv * d, "v_proj", dt, pt, bias, **extra)
        self.o_proj = _dense(h * d, e, "o_proj", dt, pt, **extra)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.norm_eps, dt, pt)
            self.k_norm = RMSNorm(self.norm_eps, dt, pt)
        sparse = self.sparse
        if sparse is None:
            self.gate_proj = _dense(e, m, "gate_proj", dt, pt, **extra)
            self.up_proj = _dense(e, m, "up_proj", dt, pt, **extra)
            self.down_proj = _dense(m, e, "down_proj", dt, pt, **extra)
            return
        self.router = _dense(e, sparse.experts, "router", dt, pt)
        self.experts = moe.Experts(sparse.experts, e, sparse.features, pt)
        if sparse.shared_features:
            self.shared_expert = GatedMLP(e, sparse.shared_features, dt, pt)
            self.shared_expert_gate = _dense(e, 1, "shared_expert_gate", dt, pt)

    def qkv(self, x, rope, dropout=None):
        """Rotated queries and keys and plain values for `x` `[B, S, E]`; `rope` is the
        `rotary.table` of the positions, shared by all layers. `dropout`: this layer's key for
        adapter dropout, or None."""
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q, k, v = fused(h, [self.q_proj, self.k_proj, self.v_proj], dropout)
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary.apply(q, rope)
        k = rotary.apply(k, rope)
        return q, k, v

    def finish(self, x, attended, dropout=None, segment_ids=None, routes=None, routed=None):
        """Output projection, residual, then the MLP with its residual. Returns the output and,
        for a sparse layer, its `moe.LayerRouting` over the tokens with `segment_ids` > 0 (all,
        when None); `routes` `[B, S, k]` replays experts where `routed` `[B, S]` is true."""
        x = x + self.o_proj(attended, dropout)
        h = self.post_attention_layernorm(x)
        if self.sparse is not None:
            out, routing = self._experts(h, segment_ids, routes, routed)
            return x + out, routing
        gate, up = fused(h, [self.gate_proj, self.up_proj], dropout)
        down = self.down_proj
        adapter = (None, None, 1.0, None, 0.0)
        if down.lora_rank:
            key = (None if dropout is None or not down.lora_dropout
                   else jax.random.fold_in(dropout, lora.TARGETS.index("down_proj")))
            adapter = (down.lora_a, down.lora_b, down.lora_scale, key, down.lora_dropout)
        return x + _gated_down(gate, up, down.kernel, down.dtype, down.kernel_scale, *adapter), None

    def _experts(self, h, segment_ids, routes, routed):
        """The sparse MLP of normed `h` `[B, S, E]`: the router in float32, the routed experts,
        Qwen2-MoE's gated shared expert; and the layer's routing sums."""
        b, s, e = h.shape
        sparse = self.sparse
        rows = h.reshape(-1, e)
        logits = jnp.dot(rows.astype(jnp.float32), self.router.kernel.astype(jnp.float32))
        forced = None if routes is None else routes.reshape(-1, sparse.per_token).astype(jnp.int32)
        chosen = None if routed is None else routed.reshape(-1)
        experts, weights, probabilities = moe.route(logits, sparse.per_token, sparse.normalize, forced, chosen)
        out = self.experts(rows.astype(self.dtype), experts, weights)
        if sparse.shared_features:
            out = out + nn.sigmoid(self.shared_expert_gate(rows)) * self.shared_expert(rows)
        real = jnp.ones((b * s,), bool) if segment_ids is None else segment_ids.reshape(-1) > 0
        return out.reshape(b, s, e), moe.layer_routing(experts, probabilities, logits, real, (b, s))

    def __call__(self, x, rope, segment_ids, block, kernel="auto", dropout=None, routes=None, routed=None):
        q, k, v = self.qkv(x, rope, dropout)
        x, routing = self.finish(x, attend_causal(q, k, v, segment_ids, block, kernel), dropout, segment_ids,
                                 routes, routed)
        return x, (k, v), routing
