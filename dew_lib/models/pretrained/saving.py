"""Writing the decoder's variables out in a Hugging Face architecture's tensor names and layouts.

`export(pretrained, variables)` is what `Pretrained.export` runs: every tensor by its Hugging Face
name, in that layout and a chosen dtype, without touching disk, for pushing weights straight into
a serving engine. `save` (`Pretrained.save`) writes them to a directory transformers, vLLM and
SGLang load: safetensors (bfloat16 by default, sharded above a size), config.json,
generation_config.json and the tokenizer, staged beside the target and swapped in.

Both take variables however they lie: NumPy, device arrays, arrays split over a mesh (FSDP,
tensor parallelism) and, in a multi-process job, arrays split across the processes. A tensor is
sliced, cast and transposed where it lives and comes to the host alone, just before it is
written: a leaf split across processes is gathered one tensor at a time (a collective every
process takes part in, so every process runs the export or the save, and only one writes:
`save(..., write=False)` on the others). The host never holds more than the tensor being written.
An adapted model is written with its adapters folded in, and an int8 base (models/quantize.py)
dequantized to the model's param dtype: a plain checkpoint either way. An MoE model's experts go
out one tensor per expert under the Hub's names (layout.py), never transformers 5's fused ones.

Not here: reading checkpoints (`loading`), the safetensors files (`files`), which process writes
(the caller's choice).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dew_lib.models import lora, quantize
from dew_lib.models.pretrained import families, files, layout
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
    flat = _leaves(pretrained, _plain(pretrained, variables))
    for tensor in pretrained.tensors:
        leaf = flat[tensor.path]
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable and leaf.is_fully_replicated:
            leaf = leaf.addressable_data(0)  # this process's own copy: no collective
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            # Split across processes: this tensor alone, gathered onto every process's host.
            out = multihost_utils.process_allgather(
                _prepared(leaf, tensor.index, target=target, transpose=tensor.transpose), tiled=True)
        elif isinstance(leaf, jax.Array):
            unchanged = not (tensor.index or tensor.transpose or target not in (None, leaf.dtype))
            out = leaf if unchanged else _prepared(leaf, tensor.index, target=target, transpose=tensor.transpose)
        else:
            array = np.asarray(leaf)
            array = array[tensor.index] if tensor.index else array
            array = array if target is None else array.astype(target, copy=False)
            out = np.ascontiguousarray(array.T if tensor.transpose else array)
            del array
        yield tensor.name, out
        del out, leaf  # not held while the next tensor is gathered


@functools.partial(jax.jit, static_argnames=("target", "transpose"))
def _prepared(leaf: jax.Array, index: tuple[int, ...], *, target: np.dtype | None, transpose: bool
              ) -> jax.Array:
    """One tensor of a leaf as `export` yields it (its layer and expert, cast, transposed). The
    indices are arguments, so a leaf compiles once, not once per layer as op-by-op slicing does."""
    out = leaf[index] if index else leaf
    out = out if target is None else out.astype(target)
    return out.T if transpose else out


def _plain(pretrained: Pretrained, variables: Mapping[str, Any]) -> Mapping[str, Any]:
    """`variables` with an int8 base dequantized (models/quantize.py) and any low-rank adapters
    folded into their kernels (models/lora.py), as a Hugging Face checkpoint holds the model."""
    if not lora.has_adapters(variables):
        if quantize.is_quantized(variables):
            return quantize.dequantized(variables, pretrained.model.param_dtype)
        return variables
    if getattr(pretrained.model, "lora", None) is None:
        raise ValueError("these variables hold LoRA adapters but the Pretrained's model has none, so their "
                         "scale is unknown; save through the adapted model's Pretrained "
                         "(dataclasses.replace(pretrained, model=adapted_model))")
    return lora.merged(pretrained.model, variables)[1]


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
    write: bool = True,
) -> Path:
    """`Pretrained.save`: a Hugging Face checkpoint directory, staged and swapped in."""
    limit = files.parse_size(max_shard_size)
    variables = _plain(pretrained, variables)
    flat = _leaves(pretrained, variables)
    target = None if dtype is None else numpy_dtype(dtype)
    dtypes = {numpy_dtype(flat[t.path].dtype) if target is None else target
              for t in pretrained.tensors}
    if len(dtypes) != 1 or next(iter(dtypes)).name not in SAVE_DTYPES:
        raise ValueError(
            f"save writes one float dtype among {SAVE_DTYPES}; the leaves would give "
            f"{sorted(d.name for d in dtypes)} (pass dtype=...)"
        )
    saved = next(iter(dtypes))
    exported = pretrained.export(variables, dtype=saved)
    if not write:  # take part in the gathers of leaves split across processes, write nothing
        for _ in exported:
            pass
        return Path(directory)
    planned = [files.Planned(t.name, t.shape, saved) for t in pretrained.tensors]
    config = {**families.hub_config(pretrained.config), "dtype": saved.name}
    if "torch_dtype" in config:
        config["torch_dtype"] = saved.name
    with files.staged_directory(Path(directory), overwrite) as stage:
        files.write(stage, _on_host(exported, flat.values()), planned, limit)
        (stage / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if pretrained.generation_config is not None:
            (stage / GENERATION_CONFIG).write_text(
                json.dumps(dict(pretrained.generation_config), indent=2) + "\n"
            )
        if pretrained.tokenizer is not None:
            pretrained.tokenizer.save_pretrained(str(stage))
    return Path(directory)


def _on_host(exported: Iterator[tuple[str, Any]], leaves: Iterable[Any]) -> Iterator[tuple[str, np.ndarray]]:
    """Each exported tensor copied to the host as the writer asks for it (a split one assembled
    from its shards), no reference kept once the writer has it. A tensor that is one of the
    variables' own leaves (the embedding, a norm) is copied on its devices first: a jax.Array
    keeps the host copy NumPy takes of it, which would outlive the save on the leaf."""
    own = {id(leaf) for leaf in leaves if isinstance(leaf, jax.Array)}
    for name, array in exported:
        host = np.asarray(jnp.copy(array) if id(array) in own else array)
        del array
        yield name, host
        del host
