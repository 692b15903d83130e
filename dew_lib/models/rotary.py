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
    """The rotation frequency of each pair of head channels, `[head_dim // 2]`, float32."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary positions, got {head_dim}")
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    else:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported; use one of {SUPPORTED_SCALING}"
        )
    return inv.astype(np.float32)


def _llama3(inv: np.ndarray, scaling: Mapping) -> np.ndarray:
    """Llama 3.1 frequency scaling: slow long wavelengths, keep short ones, blend between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv
    low_wavelength = original / low
    high_wavelength = original / high
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = np.where(wavelength > low_wavelength, inv / factor, inv)
    middle = (wavelength <= low_wavelength) & (wavelength >= high_wavelength)
    return np.where(middle, blended, out)


def rotate(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotate `x` `[..., S, H, D]` by `positions` `[..., S]`; computed in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., S, D/2]
    cos = jnp.cos(angles)[..., None, :]  # [..., S, 1, D/2]
    sin = jnp.sin(angles)[..., None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(x.dtype)
