"""Model constructors by name: `models.build("causal_transformer", vocab_size=..., ...)`."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp

from dew_lib.models.decoder import CausalTransformer, KVCache
from dew_lib.models.decoder_layer import RMSNorm
from dew_lib.models.dit import SimpleDiT
from dew_lib.models.pretrained import Pretrained, load_adapter, load_pretrained, save_adapter
from dew_lib.options import integer

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


def options_of(module: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) constructor options of a Flax module class, in declaration order."""
    fields = [f for f in dataclasses.fields(module) if f.init and f.name not in ("parent", "name")]
    required = tuple(f.name for f in fields
                     if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return required, tuple(f.name for f in fields if f.name not in required)


def check_options(module: type, options: Mapping[str, Any]) -> None:
    """Refuse unknown or missing options, listing the valid names (and the closest to a typo);
    `build` puts the model's name in front of the message."""
    required, optional = options_of(module)
    valid = required + optional
    unknown = [name for name in options if name not in valid]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, valid, n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; the "
            f"required options are {', '.join(required)} and the optional ones "
            f"{', '.join(optional)}"
        )
    missing = [name for name in required if name not in options]
    if missing:
        raise TypeError(
            f"missing required option{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}; the required options are {', '.join(required)}"
        )


_SIZES = ("vocab_size", "emb_features", "num_layers", "num_heads", "mlp_features", "max_seq_len")


def _check_sizes(options: dict[str, Any]) -> None:
    """Sizes that would otherwise fail only when the model is first traced, checked at build
    (and kept as Python ints)."""
    for field in (*_SIZES, "num_kv_heads", "head_dim"):
        if options.get(field) is not None or field in _SIZES:
            options[field] = integer(field, options.get(field))
    heads, kv_heads = options["num_heads"], options.get("num_kv_heads") or options["num_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads} (grouped-query "
                         "attention shares each key/value head among a whole group of query heads)")
    if options.get("head_dim") is None and options["emb_features"] % heads:
        raise ValueError(f"emb_features={options['emb_features']} does not divide into num_heads={heads}; "
                         "change one of them or set head_dim explicitly")


def _causal_transformer(**options: Any) -> CausalTransformer:
    check_options(CausalTransformer, options)
    _check_sizes(options)
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
    except (TypeError, ValueError) as error:
        raise type(error)(f"models.build({name!r}): {error}") from None


__all__ = [
    "CausalTransformer", "KVCache", "RMSNorm", "Pretrained", "SimpleDiT", "build", "check_options",
    "load_adapter", "load_pretrained", "options_of", "REGISTRY", "save_adapter",
]
