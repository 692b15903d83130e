"""Rotary position embeddings in the Hugging Face layout (rotate-half, not interleaved).

Qwen2, Qwen3 and Llama all rotate the first and second halves of each head against each other,
so weights imported from their checkpoints need no permutation. Scaling follows the config's
`rope_scaling` ("llama3", "linear" or none); anything else is refused rather than silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

SUPPORTED_SCALING = ("default", "linear", "llama3")


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Mapping[str, float | str] | None = None
) -> np.ndarray:
    """The rotation frequency of each pair of head channels, `[head_dim // 2]`, float32.

    Follows transformers' float32 `inv_freq` computation step by step, so imported checkpoints
    rotate by the same angles as the reference (equal bits on the checked configs, else within
    an ulp of the float32 power).
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary positions, got {head_dim}")
    f32 = np.float32
    exponents = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    # The power is rounded once from float64: torch's float32 pow is within an ulp of that and
    # equal to it on the usual head sizes and thetas, where numpy's float32 pow often is not.
    inv = f32(1.0) / (np.float64(theta) ** exponents.astype(np.float64)).astype(f32)
    config: Mapping[str, float | str] = scaling or {}
    kind = config.get("rope_type", config.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / f32(config["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, config)
    else:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported; use one of {SUPPORTED_SCALING}"
        )
    return inv.astype(np.float32)


def _llama3(inv: np.ndarray, scaling: Mapping) -> np.ndarray:
    """Llama 3.1 frequency scaling: slow long wavelengths, keep short ones, blend between.

    Every step stays in float32 (the thresholds too), matching the reference's tensor math.
    """
    f32 = np.float32
    factor = f32(scaling["factor"])
    low = f32(scaling.get("low_freq_factor", 1.0))
    high = f32(scaling.get("high_freq_factor", 4.0))
    original = f32(scaling["original_max_position_embeddings"])
    wavelength = f32(2 * math.pi) / inv
    low_wavelength = f32(float(original) / float(low))
    high_wavelength = f32(float(original) / float(high))
    scaled = np.where(wavelength > low_wavelength, inv / factor, inv)
    smooth = (original / wavelength - low) / (high - low)
    blended = (f32(1) - smooth) * scaled / factor + smooth * scaled
    middle = ~(wavelength < high_wavelength) & ~(wavelength > low_wavelength)
    return np.where(middle, blended, scaled).astype(f32)


def table(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The rotation of every position, float32: `cos` `[..., S, 1, 1, D/2]` and `sin` signed per
    half, `[..., S, 1, 2, D/2]` (`-sin` for the first half, `+sin` for the second).

    Computed once per forward pass and shared by every layer's queries and keys.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., S, D/2]
    cos = jnp.cos(angles)[..., None, None, :]
    sign = jnp.asarray([[-1.0], [1.0]], jnp.float32)  # [2, 1]
    return cos, jnp.sin(angles)[..., None, None, :] * sign


def apply(x: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray]) -> jnp.ndarray:
    """Rotate `x` `[..., S, H, D]` by a `table`; computed in float32.

    Each head is viewed as its two halves `[..., 2, D/2]`; the halves swapped (a reversal of
    that size-2 axis) times the signed `sin`, plus `x` times `cos`, gives
    `(x1 cos - x2 sin, x2 cos + x1 sin)` (negating is exact, so these are the reference's bits)
    as one elementwise fusion, forward and backward, with no concatenate of the halves.
    """
    cos, sin = rope
    halves = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    out = halves * cos + jnp.flip(halves, axis=-2) * sin
    return out.reshape(x.shape).astype(x.dtype)


def rotate(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotate `x` `[..., S, H, D]` by `positions` `[..., S]`: `apply(x, table(...))`."""
    return apply(x, table(positions, inv_freq))
