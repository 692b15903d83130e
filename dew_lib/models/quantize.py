"""An int8 frozen base under low-rank adapters (QLoRA's idea, with int8 weights).

`quantize_base` replaces each layer projection's kernel (q/k/v/o and gate/up/down, the stacked
`[L, in, out]` kernels) by int8 values and a float32 scale per output channel, their absmax over
the input axis divided by 127: `kernel` becomes int8 `[L, in, out]` and `kernel_scale` `[L, out]`
appears beside it. The embedding, the norms, any attention biases and the output head stay as
they were. The quantized model (`quantized=True`) dequantizes an int8 kernel (`q * scale`) inside the
layer scan, one layer at a time, so a full-precision copy of the whole base never exists.

The projections' bytes fall to `1/4 + 1/in` of float32 (int8 plus one float32 per output
channel): 0.27x at an input width of 50, 0.251x at 1024.

Only an adapted model is quantized: the Trainer trains the adapters alone and leaves the int8
leaves frozen, where a model without adapters would ask it to differentiate integers.
`dequantized` turns the leaves back into float kernels, which `lora.merged`, `Pretrained.save`
and `export` do before folding the adapters in.

Not here: 4-bit NF4 (no maintained JAX library was at hand), quantizing the embedding or head,
quantizing activations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

BITS = (8,)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE = "kernel_scale"
_LEVELS = 127  # symmetric int8: -127..127, so 0 is exact and the range is the same both ways

# What a quantized model's own init draws: the float init's normal(0.02), clipped at 4 standard
# deviations and stored on that grid, so `model.init` makes the same leaves `quantize_base` does.
_INIT_STDDEV = 0.02
_INIT_SCALE = 4 * _INIT_STDDEV / _LEVELS


def quantized(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(values, scale)` of a kernel `[..., in, out]`: int8 `[..., in, out]` and float32
    `[..., out]`, with `kernel ~= values * scale` to half a step (`scale / 2`) per entry."""
    kernel = jnp.asarray(kernel, jnp.float32)
    peak = jnp.max(jnp.abs(kernel), axis=-2)
    scale = jnp.where(peak > 0, peak / _LEVELS, 1.0)
    values = jnp.clip(jnp.round(kernel / scale[..., None, :]), -_LEVELS, _LEVELS).astype(jnp.int8)
    return values, scale


def init_values(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.int8) -> jax.Array:
    """A quantized model's initial int8 kernel (see `_INIT_SCALE`)."""
    drawn = jax.random.normal(key, shape) * _INIT_STDDEV
    return jnp.clip(jnp.round(drawn / _INIT_SCALE), -_LEVELS, _LEVELS).astype(dtype)


def init_scale(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """A quantized model's initial scale: the grid `init_values` draws on."""
    del key
    return jnp.full(shape, _INIT_SCALE, dtype)


def is_quantized(tree: Any) -> bool:
    """Whether any leaf of `tree` (variables, params) is a quantized kernel's scale."""
    return any(getattr(path[-1], "key", None) == SCALE for path, _ in jax.tree_util.tree_leaves_with_path(tree))


def quantize_base(model: Any, variables: Mapping[str, Any], bits: int = 8) -> tuple[Any, dict[str, Any]]:
    """The adapted `model` reading an int8 base, and `variables` with every layer projection's
    kernel quantized (`kernel` int8, `kernel_scale` float32 per output channel). Adapters, the
    embedding, norms, biases and the output head are kept as they are."""
    if bits not in BITS:
        raise ValueError(f"quantize_base(bits={bits!r}) is not supported; use bits=8 (int8 weights with a "
                         "float32 scale per output channel)")
    if getattr(model, "quantized", False) or is_quantized(variables):
        raise ValueError("the base is already quantized; quantize the full-precision base once")
    if getattr(model, "lora", None) is None:
        raise ValueError("quantize_base quantizes the frozen base of an adapted model, and this model has no "
                         "adapters: the Trainer would try to train its int8 weights. Attach adapters first "
                         "(dew_lib.models.lora.attach), then quantize")
    if getattr(model, "experts", 0):
        raise ValueError("quantize_base quantizes the dense layers' projections, and this model's MLPs are "
                         "mixtures of experts (experts > 0), which it does not quantize yet; train its "
                         "adapters on the full-precision base")
    params = variables["params"]
    layers = dict(params["layers"])
    for name in PROJECTIONS:
        values, scale = quantized(layers[name]["kernel"])
        layers[name] = {**layers[name], "kernel": values, SCALE: scale}
    return model.clone(quantized=True), {**variables, "params": {**params, "layers": layers}}


def dequantized(tree: Mapping[str, Any], dtype: Any = jnp.float32) -> dict[str, Any]:
    """`tree` with each quantized kernel turned back into a `dtype` kernel (`values * scale`)
    and its scale dropped: the float model the int8 one computes."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key == SCALE:
            continue
        if key == "kernel" and SCALE in tree:
            scale = jnp.asarray(tree[SCALE], jnp.float32)
            out[key] = (jnp.asarray(value, jnp.float32) * scale[..., None, :]).astype(dtype)
        elif isinstance(value, Mapping):
            out[key] = dequantized(value, dtype)
        else:
            out[key] = value
    return out


__all__ = ["BITS", "PROJECTIONS", "SCALE", "dequantized", "init_scale", "init_values", "is_quantized", "quantize_base",
           "quantized"]
