"""Reading a checkpoint's safetensors into the decoder's Flax variables, tensor by tensor.

`load(pretrained, directory, sharding=...)` is what `Pretrained.load` runs: it checks every
stored tensor's name, shape and dtype against the model before reading any, then streams the
tensors from disk onto the devices (or a given `jax.sharding`). A tensor stored as Flax wants it
is read straight into its final buffer; the others pass through one reused scratch buffer, so the
host holds one copy of the model plus one scratch tensor. A layer's tensor goes into its index of
the stacked `layers` leaf.

Not here: config.json and the tokenizer (`pretrained`), which tensor is which parameter
(`layout`), the safetensors files themselves (`files`), writing checkpoints (`saving`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from dew_lib.models.pretrained import files, layout
from dew_lib.models.pretrained.files import CheckpointError
from dew_lib.models.pretrained.formats import numpy_dtype

if TYPE_CHECKING:
    from dew_lib.models.pretrained.pretrained import Pretrained

ShardingSpec = Sharding | Mesh | Callable[[tuple[str, ...], tuple[int, ...]], Sharding] | None


def _sharding_for(spec: ShardingSpec, path: tuple[str, ...], shape: tuple[int, ...]):
    if spec is None or isinstance(spec, Sharding):
        return spec
    if isinstance(spec, Mesh):
        return NamedSharding(spec, PartitionSpec())
    return spec(path, shape)


def _place(array: np.ndarray, sharding: Sharding | None, *, owned: bool) -> jax.Array:
    """Put a host array (possibly a strided view) onto devices.

    `owned`: nothing else will touch the array's memory, so a CPU device may adopt it as its
    buffer instead of copying; otherwise (a reused scratch buffer) a copy is forced.
    """
    if sharding is None:
        return jax.device_put(array, may_alias=owned)
    if sharding.is_fully_addressable:
        return jax.device_put(array, sharding, may_alias=owned)
    # Multi-process: every process reads the same file and fills only its own shards.
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def load(pretrained: Pretrained, directory: str | Path, *, sharding: ShardingSpec = None
         ) -> dict[str, Any]:
    """`Pretrained.load`: the safetensors under `directory` as Flax variables `{"params": ...}`."""
    directory = Path(directory)
    expected = pretrained.tensors
    located = files.locate(directory)
    stored = files.headers(located)
    _check_stored(pretrained, stored, expected)
    embedding = expected[0].name
    if pretrained.model.tie_embeddings and layout.TIED_COPY in located and not files.same_tensor(
            located, layout.TIED_COPY, embedding):
        raise CheckpointError(
            f"tie_word_embeddings is true but the checkpoint's {layout.TIED_COPY} differs "
            f"from {embedding}; transformers would use them untied, so set "
            "tie_word_embeddings to false in config.json (or drop the copy)"
        )
    target = numpy_dtype(pretrained.model.param_dtype)

    def direct(tensor):  # stored exactly as Flax wants it: read into the final buffer
        return not tensor.transpose and files.FLOAT_DTYPES[stored[tensor.name][0]] == target

    # Each params leaf with the tensors that fill it: one, or one per layer for a stacked
    # layer leaf (read into its slice of the leaf's buffer).
    by_leaf: dict[tuple[str, ...], list[layout.Tensor]] = {}
    for tensor in expected:
        by_leaf.setdefault(tensor.path, []).append(tensor)
    shapes = layout.leaf_shapes(expected)
    # Tensors not read straight into place pass through one scratch buffer, sized for the
    # largest of them.
    scratch_bytes = max(
        [math.prod(t.shape) * files.FLOAT_DTYPES[stored[t.name][0]].itemsize
         for t in expected if not direct(t)] or [0]
    )
    scratch = files.aligned_empty(scratch_bytes) if scratch_bytes else None
    params: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        readers = {path: stack.enter_context(files.Reader(path))
                   for path in dict.fromkeys(located[t.name] for t in expected)}
        for path, group in by_leaf.items():
            placement = _sharding_for(sharding, path, shapes[path])
            if group[0].layer is None:
                leaf = _read_one(readers[located[group[0].name]], group[0], direct,
                                 scratch, target, placement)
            else:
                leaf = _read_stack(readers, located, group, shapes[path], direct,
                                   scratch, target, placement)
            node = params
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = leaf
    return {"params": params}


def _read_one(reader, tensor, direct, scratch, target, placement) -> jax.Array:
    """One tensor as one params leaf."""
    if direct(tensor):
        return _place(reader.read(tensor.name), placement, owned=True)
    array = reader.read(tensor.name, scratch[: reader.nbytes(tensor.name)])
    owned = array.dtype != target
    if owned:
        array = array.astype(target)
    leaf = _place(array.T if tensor.transpose else array, placement, owned=owned)
    leaf.block_until_ready()  # the scratch buffer is reused next
    return leaf


def _read_stack(readers, located, group, shape, direct, scratch, target, placement
                ) -> jax.Array:
    """The tensors of every layer into one stacked leaf `[L, ...]`, each at its index."""
    buffer = files.aligned_empty(math.prod(shape) * target.itemsize)
    stacked = buffer.view(target).reshape(shape)
    per_layer = len(buffer) // shape[0]
    for tensor in group:
        reader = readers[located[tensor.name]]
        if direct(tensor):
            start = tensor.layer * per_layer
            reader.read(tensor.name, buffer[start:start + per_layer])
        else:
            array = reader.read(tensor.name, scratch[: reader.nbytes(tensor.name)])
            stacked[tensor.layer] = array.T if tensor.transpose else array
    return _place(stacked, placement, owned=True)


def _check_stored(pretrained: Pretrained, stored: Mapping[str, tuple[str, tuple[int, ...]]],
                  expected: list[layout.Tensor]) -> None:
    names = {t.name for t in expected}
    missing = [t.name for t in expected if t.name not in stored]
    if missing:
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s) the "
            f"{pretrained.family.architecture} config requires: {missing[:10]}"
        )
    extra = [n for n in stored if n not in names and not layout.ignorable(n, pretrained.model)]
    if extra:
        raise CheckpointError(
            f"checkpoint has {len(extra)} tensor(s) the {pretrained.family.architecture} config "
            f"does not account for: {extra[:10]}"
        )
    for t in expected:
        dtype, shape = stored[t.name]
        if shape != t.shape:
            raise CheckpointError(
                f"tensor {t.name} has shape {shape} in the checkpoint but the config implies "
                f"{t.shape}"
            )
        if dtype not in files.FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {t.name} is stored as {dtype}; Dew loads float tensors only "
                f"({sorted(files.FLOAT_DTYPES)})"
            )
