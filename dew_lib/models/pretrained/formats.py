"""Names of a checkpoint's metadata files, and the float dtypes Dew reads and writes.

Shared by `pretrained` (which reads config.json and generation_config.json), `loading` and
`saving`: a dtype given in any spelling (`jnp.bfloat16`, "bf16", "float32", ...) as a numpy
dtype, and the three float dtypes a model's parameters load in and a checkpoint is saved in.

Not here: the dtypes a safetensors file may store (`files.FLOAT_DTYPES`), tensors (`layout`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16",
                  "fp16": "float16"}
SAVE_DTYPES = ("float32", "bfloat16", "float16")


def numpy_dtype(value: Any) -> np.dtype:
    """A numpy dtype (bfloat16 via ml_dtypes) from a jnp/np dtype or a name such as "bf16"."""
    if isinstance(value, str):
        value = _DTYPE_ALIASES.get(value.lower(), value.lower())
    return np.dtype(jnp.dtype(value))


def model_dtype(value: Any) -> Any:
    """The jnp scalar type (as `models.build` uses) for a float dtype given in any spelling."""
    name = numpy_dtype(value).name
    if name not in SAVE_DTYPES:
        raise ValueError(f"parameters load as one of {SAVE_DTYPES}, not {name}")
    return getattr(jnp, name)
