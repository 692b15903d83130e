"""Low-rank adapters (LoRA) on the decoder's projections, initialised and scaled as PEFT does.

A targeted projection keeps its kernel `W` `[in, out]` and gains two leaves beside it,
`lora_a` `[in, r]` and `lora_b` `[r, out]`, so its output is `x W + s (x A) B` with
`s = alpha / r` (`alpha / sqrt(r)` under rsLoRA). `A` starts Kaiming-uniform as PEFT draws it
(bounds of `1 / sqrt(in)`) and `B` at zero, so a fresh adapter changes no output. The adapters
are ordinary leaves of the params tree under the stacked layer axis (`[L, in, r]`), so the
scanned body, remat, the fused attention, checkpoints and the mesh (their logical axes are
declared with the decoder's) take them as they are.

The Trainer trains what the objective marks (`Objective.trainable`; by default the adapters
alone once the params hold any): the base is frozen, the optimizer's moments exist for the
trained leaves only, and the frozen reference of DPO, GRPO, PPO (its policy) and Flow-GRPO is
the base with its adapters switched off (`without_adapters`), never a second copy. PPO's critic
trains its own adapters and value head, or all of it without adapters; a SimpleDiT's adapters
are in models/dit.py (`DiTLoRA`, `dit.attach`, `dit.merged`). An int8 base (models/quantize.py)
stays frozen the same way.

Adapter dropout (`LoRA.dropout`, PEFT's `lora_dropout`) drops units of a targeted projection's
input on the adapter's path only (`s B A dropout(x)`), and only in a forward that is given a
`dropout` rng: the training forwards of the LM, DPO, GRPO and PPO objectives. Evaluation, the frozen
reference, rescoring, sampling and serving pass none and never drop.

`merged` folds the adapters into their kernels, which is what `Pretrained.save` and `export`
write for an adapted model: a plain Hugging Face checkpoint (a quantized base, models/quantize.py,
is dequantized first).

Not here: PEFT's files (models/pretrained/peft.py), serving several adapters (dew_lib/serve/adapters.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew_lib.models import quantize

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = ("lora_a", "lora_b")

# PEFT's kaiming_uniform_(a=sqrt(5)) on a [r, in] weight: uniform within 1 / sqrt(in); on Flax's
# transposed [in, r] layout the fan-in is the second-to-last axis, as variance_scaling reads it.
A_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Which projections get adapters and how large they are.

    rank: r, the adapters' inner width. alpha: the scale's numerator (PEFT's `lora_alpha`).
    targets: projection names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)
    or "all-linear" for all seven (PEFT's name; the output head is never adapted). rslora: scale
    by alpha / sqrt(r) instead of alpha / r (rank-stabilised LoRA). dropout: the probability
    that a unit of a targeted projection's input is dropped on the adapter's path while training
    (PEFT's `lora_dropout`; kept units are scaled by 1 / (1 - dropout)).
    """

    rank: int = 8
    alpha: float = 8.0
    targets: tuple[str, ...] | str = ("q_proj", "v_proj")
    rslora: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA.rank must be a whole number >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA.alpha must be > 0, got {self.alpha!r}")
        targets = TARGETS if self.targets == "all-linear" else self.targets
        if isinstance(targets, str):
            targets = (targets,)
        unknown = [name for name in targets if name not in TARGETS]
        if unknown or not targets:
            raise ValueError(f"LoRA.targets must name projections among {', '.join(TARGETS)} or be "
                             f"'all-linear'; got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(name for name in TARGETS if name in targets))
        object.__setattr__(self, "alpha", float(self.alpha))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA.dropout must be a probability with 0 <= dropout < 1 (PEFT's lora_dropout; "
                             f"0 turns it off), got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        """What the adapters' product is multiplied by."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def dropped(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout of `x`: each unit zeroed with probability `rate`, the rest scaled by
    `1 / (1 - rate)` so the expected value is unchanged. What an adapter reads while training."""
    if not rate:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def is_adapter(path: Any) -> bool:
    """Whether a pytree path ends at an adapter leaf (`.../q_proj/lora_a`)."""
    last = path[-1] if path else None
    return getattr(last, "key", getattr(last, "name", None)) in ADAPTERS


def has_adapters(tree: Any) -> bool:
    """Whether any leaf of `tree` (params, variables, a train state's params) is an adapter."""
    return any(is_adapter(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree))


def split(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(adapters, base)`: two nested dicts with the adapter leaves and every other leaf."""
    adapters: dict[str, Any] = {}
    base: dict[str, Any] = {}
    for key, value in params.items():
        if key in ADAPTERS:
            adapters[key] = value
        elif isinstance(value, Mapping):
            inner_adapters, inner_base = split(value)
            if inner_adapters:
                adapters[key] = inner_adapters
            if inner_base:
                base[key] = inner_base
        else:
            base[key] = value
    return adapters, base


def merge(adapters: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `split`: one tree with both sets of leaves."""
    out = dict(base)
    for key, value in adapters.items():
        out[key] = merge(value, base.get(key, {})) if isinstance(value, Mapping) else value
    return out


def without_adapters(params: Any) -> Any:
    """`params` with every `lora_b` at zero: the base model's outputs exactly (the adapters add
    `(x A) 0 = 0`), without copying the base."""
    def off(path, leaf):
        last = path[-1] if path else None
        return jnp.zeros_like(leaf) if getattr(last, "key", None) == "lora_b" else leaf

    return jax.tree_util.tree_map_with_path(off, params)


def merged(model: Any, variables: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The model without adapters and `variables` with each adapter folded into its kernel
    (`W + s A B`): what a Hugging Face checkpoint of the adapted model holds. A quantized base
    (models/quantize.py) is dequantized first, so the result is a plain full-precision model."""
    if quantize.is_quantized(variables):
        variables = quantize.dequantized(variables, model.param_dtype)
    if getattr(model, "quantized", False):
        model = model.clone(quantized=False)
    config = getattr(model, "lora", None)
    if config is None:
        return model, dict(variables)
    params = variables["params"]
    layers = dict(params["layers"])
    for name in config.targets:
        part = dict(layers[name])
        a, b = part.pop("lora_a"), part.pop("lora_b")
        kernel = part["kernel"]
        product = jnp.einsum("lir,lro->lio", a.astype(jnp.float32), b.astype(jnp.float32))
        part["kernel"] = (kernel.astype(jnp.float32) + config.scale * product).astype(kernel.dtype)
        layers[name] = part
    return model.clone(lora=None), {**variables, "params": {**params, "layers": layers}}


def check_expert_targets(experts: int, targets: tuple[str, ...] | str) -> None:
    """Refuse adapters on MLP projections of a mixture-of-experts model (`experts` > 0), whose
    experts replace those projections: its adapters go on the attention projections."""
    if experts and set(targets) & {"gate_proj", "up_proj", "down_proj"}:
        raise ValueError("LoRA on a mixture-of-experts model adapts the attention projections only "
                         f"(q_proj, k_proj, v_proj, o_proj); the targets {targets} include MLP "
                         "projections, which its experts replace")


def attach(model: Any, variables: Mapping[str, Any], lora: LoRA, key: jax.Array) -> tuple[Any, dict[str, Any]]:
    """`model` with adapters as `lora` says, and `variables` with fresh ones beside its weights
    (A drawn from `key`, B zero: the same outputs as before). The base is not copied."""
    if not isinstance(lora, LoRA):
        raise TypeError(f"attach needs a dew_lib.models.lora.LoRA, got {type(lora).__name__}")
    if getattr(model, "lora", None) is not None or has_adapters(variables):
        raise ValueError("the model already has adapters; attach them to the base model once")
    if getattr(model, "quantized", False) or quantize.is_quantized(variables):
        raise ValueError("the base is already quantized; attach adapters to the full-precision base, then "
                         "quantize it (lora.attach, then quantize.quantize_base)")
    check_expert_targets(getattr(model, "experts", 0), lora.targets)
    adapted = model.clone(lora=lora)
    params = variables["params"]
    layers = dict(params["layers"])
    for index, name in enumerate(lora.targets):
        kernel = layers[name]["kernel"]  # [L, in, out]
        count, width_in, width_out = kernel.shape
        keys = jax.random.split(jax.random.fold_in(key, index), count)
        a = jax.vmap(functools.partial(A_INIT, shape=(width_in, lora.rank), dtype=kernel.dtype))(keys)
        b = jnp.zeros((count, lora.rank, width_out), kernel.dtype)
        layers[name] = {**layers[name], "lora_a": a, "lora_b": b}
    return adapted, {**variables, "params": {**params, "layers": layers}}


__all__ = ["ADAPTERS", "TARGETS", "LoRA", "attach", "check_expert_targets", "dropped", "has_adapters", "is_adapter",
           "merge", "merged", "split", "without_adapters"]
