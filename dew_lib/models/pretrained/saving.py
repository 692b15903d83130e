"""Writing the decoder's variables out in a Hugging Face architecture's tensor names and layouts.

`export(pretrained, variables)` is what `Pretrained.export` runs: every tensor by its Hugging Face
name, in that layout and a chosen dtype, without touching disk, for pushing weights straight into
a serving engine. `save` (`Pretrained.save`) writes them to a directory transformers, vLLM and
SGLang load: safetensors (bfloat16 by default, sharded above a size), config.json,
generation_config.json and the tokenizer, staged beside the target and swapped in.

Not here: reading checkpoints (`loading`), multi-process gathering before a save (gather to host
first; `export` and `save` need every leaf's data on this process).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.models.pretrained import files, layout
from dew_lib.models.pretrained.formats import CONFIG, GENERATION_CONFIG, SAVE_DTYPES, numpy_dtype

if TYPE_CHECKING:
    from dew_lib.models.pretrained.pretrained import Pretrained


def _params_of(variables: Mapping[str, Any]) -> Mapping[str, Any]:
    """The `params` collection of full Flax variables (a bare params mapping is accepted too)."""
    if "params" in variables:
        return variables["params"]
    if "embed_tokens" in variables:
        return variables
    raise ValueError(
        f"expected Flax variables with a 'params' collection, got keys {sorted(variables)[:8]}"
    )


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def export(pretrained: Pretrained, variables: Mapping[str, Any], *, dtype: Any = jnp.bfloat16
           ) -> Iterator[tuple[str, Any]]:
    """`Pretrained.export`: `(hf_name, array)` for every tensor `save` would write, in order."""
    target = None if dtype is None else numpy_dtype(dtype)
    if target is not None and target.name not in SAVE_DTYPES:
        raise ValueError(f"cannot export as {target.name}; use one of {SAVE_DTYPES}")
    flat = _leaves(pretrained, variables)
    for tensor in pretrained.tensors:
        leaf = flat[tensor.path]
        if tensor.layer is not None:
            leaf = leaf[tensor.layer]
        if isinstance(leaf, jax.Array):
            out = leaf if target is None else leaf.astype(target)
            yield tensor.name, (out.T if tensor.transpose else out)
        else:
            array = np.asarray(leaf)
            array = array if target is None else array.astype(target, copy=False)
            yield tensor.name, np.ascontiguousarray(array.T if tensor.transpose else array)


def _leaves(pretrained: Pretrained, variables: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    """The params leaves by path, checked to be exactly the model's, with its shapes."""
    flat = _flatten(_params_of(variables))
    expected = layout.leaf_shapes(pretrained.tensors)
    missing = [".".join(p) for p in expected if p not in flat]
    extra = [".".join(p) for p in flat if p not in expected]
    if missing or extra:
        hint = ("; these variables keep one layers_i subtree per layer: convert them with "
                "dew_lib.models.decoder.stack_layers" if any(p[0] == "layers_0" for p in flat)
                else "")
        raise ValueError(
            f"variables do not match the model: missing params {missing[:10]}, "
            f"unexpected params {extra[:10]}{hint}"
        )
    for path, want in expected.items():
        shape = tuple(np.shape(flat[path]))
        if shape != want:
            raise ValueError(
                f"param {'.'.join(path)} has shape {shape}, the model expects {want}"
            )
    return flat


def save(
    pretrained: Pretrained,
    variables: Mapping[str, Any],
    directory: str | Path,
    *,
    dtype: Any = jnp.bfloat16,
    max_shard_size: int | str = "5GB",
    overwrite: bool = True,
) -> Path:
    """`Pretrained.save`: a Hugging Face checkpoint directory, staged and swapped in."""
    limit = files.parse_size(max_shard_size)
    flat = _leaves(pretrained, variables)
    for path, leaf in flat.items():
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            raise ValueError(
                f"param {'.'.join(path)} spans processes; gather the variables to host "
                "memory (e.g. multihost_utils.process_allgather) before saving"
            )
    target = None if dtype is None else numpy_dtype(dtype)
    dtypes = {numpy_dtype(flat[t.path].dtype) if target is None else target
              for t in pretrained.tensors}
    if len(dtypes) != 1 or next(iter(dtypes)).name not in SAVE_DTYPES:
        raise ValueError(
            f"save writes one float dtype among {SAVE_DTYPES}; the leaves would give "
            f"{sorted(d.name for d in dtypes)} (pass dtype=...)"
        )
    saved = next(iter(dtypes))
    sizes = [(t.name, math.prod(t.shape) * saved.itemsize) for t in pretrained.tensors]
    config = {**pretrained.config, "dtype": saved.name}
    if "torch_dtype" in config:
        config["torch_dtype"] = saved.name
    stream = ((name, np.asarray(array))
              for name, array in pretrained.export(variables, dtype=saved))
    with files.staged_directory(Path(directory), overwrite) as stage:
        files.write(stage, stream, sizes, limit)
        (stage / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if pretrained.generation_config is not None:
            (stage / GENERATION_CONFIG).write_text(
                json.dumps(dict(pretrained.generation_config), indent=2) + "\n"
            )
        if pretrained.tokenizer is not None:
            pretrained.tokenizer.save_pretrained(str(stage))
    return Path(directory)
