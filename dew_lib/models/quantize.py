"""A quantized frozen base under low-rank adapters (QLoRA): int8, or QLoRA's 4-bit NF4.

`quantize_base` replaces each layer projection's kernel (q/k/v/o and gate/up/down, the stacked
`[L, in, out]` kernels) by int8 values and a float32 scale per output channel, their absmax over
the input axis divided by 127: `kernel` becomes int8 `[L, in, out]` and `kernel_scale` `[L, out]`
appears beside it. The embedding, the norms, any attention biases and the output head stay as
they were. The quantized model (`quantized=True`) dequantizes an int8 kernel (`q * scale`) inside the
layer scan, one layer at a time, so a full-precision copy of the whole base never exists.

The projections' bytes fall to `1/4 + 1/in` of float32 (int8 plus one float32 per output
channel): 0.27x at an input width of 50, 0.251x at 1024.

`bits=4` stores them as NF4 instead (Dettmers et al.'s 4-bit NormalFloat: 16 levels at the
normal distribution's quantiles, in qwix, the optional `nf4` extra): each block of `NF4_BLOCK`
(64) input rows of an output column is scaled by its absmax, and each weight becomes the index of
its nearest level. Two indices are packed into a byte, `kernel` uint8 `[L, in/2, out]`, beside
`kernel_absmax` float32 `[L, in/block, out]`: `1/8 + 1/block` of float32, 0.1406x at block 64
(QLoRA's second quantization of the absmax, which would bring it to 0.129x, is not done). An
input width that 64 does not divide takes the largest block that divides both (16 at width 16).

Only an adapted model is quantized: the Trainer trains the adapters alone and leaves the int8
leaves frozen, where a model without adapters would ask it to differentiate integers.
`dequantized` turns the leaves back into float kernels, which `lora.merged`, `Pretrained.save`
and `export` do before folding the adapters in.

Not here: NF4's double quantization of the absmax, other 4-bit formats (FP4, int4), quantizing
the embedding or head, quantizing activations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dew_lib.models import partitioning

BITS = (8, 4)  # int8, NF4
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCALE = "kernel_scale"
ABSMAX = "kernel_absmax"  # an NF4 kernel's absmax per block of input rows and output column
NF4_BLOCK = 64  # QLoRA's block size
_LEVELS = 127  # symmetric int8: -127..127, so 0 is exact and the range is the same both ways

# On a mesh an NF4 absmax splits like its kernel's output, never along its blocks (few: one at width 64).
partitioning.declare({("layers", name, ABSMAX): ("layers", None, out) for name, out in
                      (("q_proj", "heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads"), ("o_proj", "embed"),
                       ("gate_proj", "mlp"), ("up_proj", "mlp"), ("down_proj", "embed"))})

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
    """Whether any leaf of `tree` (variables, params) is a quantized kernel's scale or absmax."""
    return any(getattr(path[-1], "key", None) in (SCALE, ABSMAX)
               for path, _ in jax.tree_util.tree_leaves_with_path(tree))


def nf4_block(in_features: int) -> int:
    """The NF4 block (input rows per absmax) of a kernel with `in_features` inputs: NF4_BLOCK,
    or the largest divisor of the width below it that divides NF4_BLOCK."""
    return math.gcd(in_features, NF4_BLOCK)


def _qwix():
    try:
        import qwix  # type: ignore[import-untyped]
    except ImportError:
        raise ImportError("NF4 quantization (bits=4, lora.quantize='nf4') uses qwix: pip install 'dew[nf4]' "
                          "(or qwix>=0.1.8), or quantize to int8 (bits=8)") from None
    return qwix


def quantized_nf4(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(codes, absmax)` of a kernel `[..., in, out]` in NF4: uint8 `[..., in/2, out]` holding two
    4-bit level indices each (input row 2i in the low half, 2i+1 in the high), and float32
    `[..., in/block, out]`. One leading index at a time (`lax.map`): qwix picks each weight's
    level by comparing it with all 16, which whole would take 64 bytes a weight."""
    qwix = _qwix()
    kernel = jnp.asarray(kernel, jnp.float32)
    if kernel.shape[-2] % 2:
        raise ValueError(f"NF4 packs two input rows into a byte, and this kernel has {kernel.shape[-2]} (odd); "
                         "quantize it to int8 (bits=8)")
    block = nf4_block(kernel.shape[-2])

    def one(matrix):  # [in, out]
        q = qwix.quantize(matrix, "nf4", channelwise_axes=(1,), tiled_axes={0: block})
        codes = q.qvalue.astype(jnp.uint8)
        return codes[0::2] | (codes[1::2] << 4), q.scale.astype(jnp.float32)

    flat = kernel.reshape(-1, *kernel.shape[-2:])
    codes, absmax = jax.lax.map(one, flat)
    return codes.reshape(*kernel.shape[:-2], *codes.shape[1:]), absmax.reshape(*kernel.shape[:-2], *absmax.shape[1:])


def dequantized_kernel(kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 kernel `[..., in, out]` a quantized one stands for: an int8 kernel times its
    scale per output channel `[..., out]`, or NF4 codes (uint8 `[..., in/2, out]`) as their
    levels times their block's absmax `[..., in/block, out]`."""
    scale = jnp.asarray(scale, jnp.float32)
    if kernel.dtype == jnp.int8:
        return kernel.astype(jnp.float32) * scale[..., None, :]
    qwix = _qwix()
    low, high = kernel & 15, kernel >> 4
    codes = jnp.stack([low, high], axis=-2).reshape(*kernel.shape[:-2], 2 * kernel.shape[-2], kernel.shape[-1])
    return qwix.dequantize(qwix.QArray(codes.astype(jnp.uint4), scale, qtype="nf4"))


def init_codes(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.uint8) -> jax.Array:
    """An NF4 model's initial packed codes: two uniform level indices a byte."""
    return jax.random.randint(key, shape, 0, 256).astype(dtype)


def init_absmax(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """An NF4 model's initial absmax: 4 standard deviations of the float init."""
    del key
    return jnp.full(shape, 4 * _INIT_STDDEV, dtype)


def quantize_base(model: Any, variables: Mapping[str, Any], bits: int = 8) -> tuple[Any, dict[str, Any]]:
    """The adapted `model` reading a quantized base, and `variables` with every layer projection's
    kernel quantized: bits=8, `kernel` int8 and `kernel_scale` float32 per output channel; bits=4,
    NF4 (`kernel` uint8, two codes a byte, and `kernel_absmax` per block). Adapters, the
    embedding, norms, biases and the output head are kept as they are."""
    if bits not in BITS:
        raise ValueError(f"quantize_base(bits={bits!r}) is not supported; use bits=8 (int8 weights with a "
                         "float32 scale per output channel) or bits=4 (NF4 with an absmax per block)")
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
        if bits == 4:
            codes, absmax = quantized_nf4(layers[name]["kernel"])
            layers[name] = {**layers[name], "kernel": codes, ABSMAX: absmax}
        else:
            values, scale = quantized(layers[name]["kernel"])
            layers[name] = {**layers[name], "kernel": values, SCALE: scale}
    return model.clone(quantized="nf4" if bits == 4 else True), {**variables, "params": {**params, "layers": layers}}


def dequantized(tree: Mapping[str, Any], dtype: Any = jnp.float32) -> dict[str, Any]:
    """`tree` with each quantized kernel turned back into a `dtype` kernel (`dequantized_kernel`)
    and its scale dropped: the float model the quantized one computes."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key in (SCALE, ABSMAX):
            continue
        if key == "kernel" and (SCALE in tree or ABSMAX in tree):
            out[key] = dequantized_kernel(jnp.asarray(value), tree.get(SCALE, tree.get(ABSMAX))).astype(dtype)
        elif isinstance(value, Mapping):
            out[key] = dequantized(value, dtype)
        else:
            out[key] = value
    return out


__all__ = ["ABSMAX", "BITS", "NF4_BLOCK", "PROJECTIONS", "SCALE", "dequantized", "dequantized_kernel", "init_absmax",
           "init_codes", "init_scale", "init_values", "is_quantized", "nf4_block", "quantize_base", "quantized",
           "quantized_nf4"]
