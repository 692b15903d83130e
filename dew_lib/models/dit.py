"""SimpleDiT: a small diffusion transformer over image patches (Peebles and Xie's DiT, reduced).

`SimpleDiT(...)(x [B, H, W, C], t [B], condition [B, F] | None) -> [B, H, W, output_channels]`.
The image is cut into `patch_size` squares, each embedded and given a fixed 2-D sine-cosine
position code. The time `t` in [0, 1] (and the condition's features, when given) form one
embedding that modulates every block through adaptive layer norm (shift, scale and a gate).
The gates and the output projection start at zero, so a fresh model predicts 0 everywhere and
each block starts as the identity.

Not here: cross-attention to token sequences (conditions arrive as one feature vector),
learned position embeddings, dropout, mixed precision.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew_lib.models import partitioning

_ZERO = nn.initializers.zeros

# Logical axes (partitioning.py): under FSDP each weight is split along its model-width side.
_WIDE_IN, _WIDE_OUT, _BIAS = ("embed", None), (None, "embed"), (None,)
partitioning.declare({
    **{(name, "kernel"): _WIDE_IN for name in ("qkv", "modulation", "mlp_in", "final_modulation",
                                                   "output", "time_out")},
    **{(name, "kernel"): _WIDE_OUT for name in ("attention_out", "mlp_out", "time_in", "condition")},
    **{(name, "bias"): _BIAS for name in ("qkv", "modulation", "mlp_in", "final_modulation", "output",
                                          "time_out", "attention_out", "mlp_out", "time_in", "condition",
                                          "patches")},
    ("patches", "kernel"): (None, None, None, "embed"),
})


def timestep_embedding(t: jax.Array, features: int, max_period: float = 10_000.0) -> jax.Array:
    """Sine-cosine features `[B, features]` of `t * 1000` (t in [0, 1])."""
    half = features // 2
    frequencies = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / max(half, 1))
    angles = (t.astype(jnp.float32) * 1000.0)[:, None] * frequencies[None]
    out = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    if features % 2:
        out = jnp.pad(out, ((0, 0), (0, 1)))
    return out


def position_code(height: int, width: int, features: int) -> jax.Array:
    """Fixed 2-D sine-cosine position code `[height * width, features]`."""
    quarter = features // 4
    frequencies = 1.0 / 10_000.0 ** (jnp.arange(quarter, dtype=jnp.float32) / max(quarter, 1))
    rows, cols = jnp.meshgrid(jnp.arange(height, dtype=jnp.float32),
                              jnp.arange(width, dtype=jnp.float32), indexing="ij")
    parts = []
    for grid in (rows.reshape(-1), cols.reshape(-1)):
        angles = grid[:, None] * frequencies[None]
        parts += [jnp.sin(angles), jnp.cos(angles)]
    code = jnp.concatenate(parts, axis=-1)
    return jnp.pad(code, ((0, 0), (0, features - code.shape[-1])))


def _modulate(x, shift, scale):
    return x * (1.0 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """Self-attention and an MLP, each behind an adaptive layer norm with a zero-started gate."""

    num_heads: int
    mlp_ratio: float
    param_dtype: Any = jnp.float32

    def _attention(self, x):
        batch, length, features = x.shape
        heads = self.num_heads
        qkv = nn.Dense(3 * features, param_dtype=self.param_dtype, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * heads, features // heads), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(features // heads)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return nn.Dense(features, param_dtype=self.param_dtype, name="attention_out")(
            mixed.reshape(batch, length, features))

    @nn.compact
    def __call__(self, h, c):
        features = h.shape[-1]
        modulation = nn.Dense(6 * features, kernel_init=_ZERO, param_dtype=self.param_dtype,
                              name="modulation")(nn.silu(c))
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(modulation, 6, axis=-1)

        def norm(name):
            return nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6, name=name)

        a = _modulate(norm("norm1")(h), shift1, scale1)
        a = self._attention(a)
        h = h + gate1[:, None] * a
        m = _modulate(norm("norm2")(h), shift2, scale2)
        hidden = max(1, int(round(features * self.mlp_ratio)))
        m = nn.Dense(hidden, param_dtype=self.param_dtype, name="mlp_in")(m)
        m = nn.Dense(features, param_dtype=self.param_dtype, name="mlp_out")(nn.gelu(m))
        return h + gate2[:, None] * m


class SimpleDiT(nn.Module):
    """A diffusion transformer for small images; see the module docstring.

    output_channels: channels of the prediction (the image's channels for velocity prediction).
    patch_size: side of the square patches; height and width must be multiples of it.
    emb_features: width of patch and time embeddings (a multiple of num_heads and of 4).
    mlp_ratio: MLP width as a multiple of emb_features.
    """

    output_channels: int
    patch_size: int = 2
    emb_features: int = 64
    num_layers: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    param_dtype: Any = jnp.float32

    def _check(self, x):
        if self.output_channels < 1 or self.patch_size < 1 or self.num_layers < 0 or self.num_heads < 1:
            raise ValueError(
                f"SimpleDiT needs output_channels, patch_size, num_heads >= 1 and num_layers >= 0; got "
                f"output_channels={self.output_channels}, patch_size={self.patch_size}, "
                f"num_layers={self.num_layers}, num_heads={self.num_heads}"
            )
        if self.emb_features % self.num_heads or self.emb_features % 4:
            raise ValueError(
                f"SimpleDiT.emb_features={self.emb_features} must be a multiple of num_heads="
                f"{self.num_heads} and of 4"
            )
        if x.ndim != 4 or x.shape[1] % self.patch_size or x.shape[2] % self.patch_size:
            raise ValueError(
                f"SimpleDiT takes images [B, H, W, C] with H and W multiples of patch_size="
                f"{self.patch_size}; got shape {x.shape}"
            )

    @nn.compact
    def __call__(self, x: jax.Array, t: jax.Array, condition: jax.Array | None = None) -> jax.Array:
        self._check(x)
        batch, height, width, _ = x.shape
        p, e = self.patch_size, self.emb_features
        rows, cols = height // p, width // p
        h = nn.Conv(e, (p, p), strides=(p, p), padding="VALID", param_dtype=self.param_dtype,
                    name="patches")(x.astype(jnp.float32))
        h = h.reshape(batch, rows * cols, e) + position_code(rows, cols, e)[None]
        c = nn.Dense(e, param_dtype=self.param_dtype, name="time_in")(timestep_embedding(t, e))
        c = nn.Dense(e, param_dtype=self.param_dtype, name="time_out")(nn.silu(c))
        if condition is not None:
            c = c + nn.Dense(e, param_dtype=self.param_dtype, name="condition")(
                condition.astype(jnp.float32))
        for i in range(self.num_layers):  # rows pinned to the batch split (partitioning.constrain_rows)
            h = partitioning.constrain_rows(
                DiTBlock(self.num_heads, self.mlp_ratio, self.param_dtype, name=f"blocks_{i}")(h, c))
        shift, scale = jnp.split(
            nn.Dense(2 * e, kernel_init=_ZERO, param_dtype=self.param_dtype, name="final_modulation")(
                nn.silu(c)), 2, axis=-1)
        h = _modulate(nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6, name="final_norm")(h),
                      shift, scale)
        out = nn.Dense(p * p * self.output_channels, kernel_init=_ZERO, param_dtype=self.param_dtype,
                       name="output")(h)  # [B, rows * cols, p * p * C]
        out = out.reshape(batch, rows, cols, p, p, self.output_channels)
        return out.transpose(0, 1, 3, 2, 4, 5).reshape(batch, height, width, self.output_channels)
