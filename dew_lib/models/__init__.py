"""Model constructors by name: `models.build("causal_transformer", vocab_size=..., ...)`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from dew_lib.models.decoder import CausalTransformer, KVCache, RMSNorm
from dew_lib.models.dit import SimpleDiT
from dew_lib.models.pretrained import Pretrained, load_pretrained

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def _causal_transformer(**options: Any) -> CausalTransformer:
    for field in ("dtype", "param_dtype"):
        if isinstance(options.get(field), str):
            name = options[field]
            if name not in _DTYPES:
                raise ValueError(f"{field}={name!r} is not a known dtype; use one of {sorted(_DTYPES)}")
            options[field] = _DTYPES[name]
    scaling = options.get("rope_scaling")
    if isinstance(scaling, Mapping):
        options["rope_scaling"] = tuple(sorted(scaling.items()))
    return CausalTransformer(**options)


REGISTRY: dict[str, Callable[..., Any]] = {"causal_transformer": _causal_transformer}


def build(name: str, **options: Any):
    """Build a registered model; unknown names and options are errors that list what exists."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; registered models: {sorted(REGISTRY)}")
    try:
        return REGISTRY[name](**options)
    except TypeError as error:
        raise TypeError(f"models.build({name!r}): {error}") from None


__all__ = [
    "CausalTransformer", "KVCache", "RMSNorm", "Pretrained", "SimpleDiT", "build", "load_pretrained",
    "REGISTRY",
]
