"""Reading a checkpoint's safetensors into the decoder's Flax variables, tensor by tensor.

`load(pretrained, directory, sharding=...)` is what `Pretrained.load` runs: it checks every
stored tensor's name, shape and dtype against the model before reading any, then streams the
tensors from disk onto the devices (or a given `jax.sharding`, or split over a mesh by the
parameters' declared logical axes, as the Trainer splits them: each process fills only the
shards of its own devices). A tensor stored as Flax wants it is read straight into its final
buffer; the others pass through one reused scratch buffer, so the host holds one copy of the
model plus one scratch tensor. A layer's tensor goes into its index of the stacked `layers` leaf,
an MoE expert's into its `[layer, expert]` slice of the stacked expert leaf (read from the Hub's
per-expert tensors, or from transformers 5's fused `gate_up_proj` / `down_proj`).

Not here: config.json and the tokenizer (`pretrained`), which tensor is which parameter
(`layout`), the safetensors files themselves (`files`), writing checkpoints (`saving`), which
mesh axis splits which parameter (`dew_lib.models.partitioning`). Every process still reads
each whole leaf from disk before keeping its shards.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding

from dew_lib.models import partitioning
from dew_lib.models.pretrained import files, layout
from dew_lib.models.pretrained.files import CheckpointError
from dew_lib.models.pretrained.formats import numpy_dtype

if TYPE_CHECKING:
    from dew_lib.models.pretrained.pretrained import Pretrained
    from dew_lib.train.mesh import MeshSpec

Placement = Callable[[tuple[str, ...], tuple[int, ...]], Sharding]
ShardingSpec = Union[Sharding, Mesh, "MeshSpec", Placement, None]  # noqa: UP007 (a forward reference)


def _placement(spec: ShardingSpec, shapes: Mapping[tuple[str, ...], tuple[int, ...]], dtype: np.dtype
               ) -> Callable[[tuple[str, ...], tuple[int, ...]], Sharding | None]:
    """Where each params leaf goes, from any form `sharding` takes. A mesh's splits are found
    for every leaf here, before a tensor is read, so a mesh that cannot divide one is refused
    (naming the parameter) before any reading."""
    from dew_lib.train.mesh import MeshSpec  # dew_lib.train imports the models, so not at the top

    if isinstance(spec, MeshSpec):
        spec = spec.build()
    if isinstance(spec, Mesh):
        split = mesh_shardings(spec, shapes, dtype)
        return lambda path, shape: split[path]
    if spec is None or isinstance(spec, Sharding):
        fixed = spec
        return lambda path, shape: fixed
    return spec


def mesh_shardings(mesh: Mesh, shapes: Mapping[tuple[str, ...], tuple[int, ...]], dtype: Any = np.float32
                   ) -> dict[tuple[str, ...], NamedSharding]:
    """The sharding of each params leaf (path under `params` -> shape) on `mesh`: what
    `partitioning.tree_shardings` gives the same leaves of `{"params": ...}`, the function the
    Trainer lays its state out with, so a loaded model is already where the Trainer keeps it."""
    abstract = _nest({path: jax.ShapeDtypeStruct(shape, dtype) for path, shape in shapes.items()})
    placed = partitioning.tree_shardings({"params": abstract}, mesh)["params"]
    out = {}
    for path in shapes:
        node = placed
        for key in path:
            node = node[key]
        out[path] = node
    return out


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    """`{("a", "b"): x}` as `{"a": {"b": x}}`."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


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
    located = files.locate(directory)
    stored = files.headers(located)
    # An MoE checkpoint holds its experts one tensor each (the Hub's layout, what Dew writes) or
    # fused as transformers 5 holds them in memory; the stored names say which.
    expected = pretrained.tensors
    if layout.is_fused(stored) and pretrained.family.moe:
        expected = layout.tensors(pretrained.model, pretrained.family, fused=True)
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
        return (not tensor.transpose and tensor.rows is None
                and files.FLOAT_DTYPES[stored[tensor.name][0]] == target)

    # Each params leaf with the tensors that fill it: one, or one per layer (and expert) for a
    # stacked leaf (read into its slice of the leaf's buffer).
    by_leaf: dict[tuple[str, ...], list[layout.Tensor]] = {}
    for tensor in expected:
        by_leaf.setdefault(tensor.path, []).append(tensor)
    shapes = layout.leaf_shapes(expected)
    placement = _placement(sharding, shapes, target)
    # Tensors not read straight into place pass through one scratch buffer, sized for the
    # largest of them.
    scratch_bytes = max(
        [math.prod(t.shape) * files.FLOAT_DTYPES[stored[t.name][0]].itemsize
         for t in expected if not direct(t)] or [0]
    )
    scratch = files.aligned_empty(scratch_bytes) if scratch_bytes else None
    leaves: dict[tuple[str, ...], jax.Array] = {}
    with contextlib.ExitStack() as stack:
        readers = {path: stack.enter_context(files.Reader(path))
                   for path in dict.fromkeys(located[t.name] for t in expected)}
        for path, group in by_leaf.items():
            where = placement(path, shapes[path])
            if group[0].layer is None:
                leaves[path] = _read_one(readers[located[group[0].name]], group[0], direct,
                                         scratch, target, where)
            else:
                leaves[path] = _read_stack(readers, located, group, shapes[path], direct,
                                           scratch, target, where)
    return {"params": _nest(leaves)}


def _read_one(reader, tensor, direct, scratch, target, placement) -> jax.Array:
    """One tensor as one params leaf."""
    if direct(tensor):
        return _place(reader.read(tensor.name), placement, owned=True)
    array = reader.read(tensor.name, scratch[: reader.nbytes(tensor.name)])
    owned = array.dtype != target
    if owned:
        array = array.astype(target)
    leaf = _place(tensor.to_flax(array), placement, owned=owned)
    leaf.block_until_ready()  # the scratch buffer is reused next
    return leaf


def _read_stack(readers, located, group, shape, direct, scratch, target, placement
                ) -> jax.Array:
    """The tensors of every layer (and expert) into one stacked leaf `[L, ...]` or `[L, E, ...]`,
    each at its index: an expert's tensor streams into its slice like a layer's, so the experts
    are stacked without a second copy of the leaf."""
    buffer = files.aligned_empty(math.prod(shape) * target.itemsize)
    stacked = buffer.view(target).reshape(shape)
    lead = shape[:len(group[0].index)]
    per_slice = len(buffer) // math.prod(lead)
    for tensor in group:
        reader = readers[located[tensor.name]]
        if direct(tensor):
            start = int(np.ravel_multi_index(tensor.index, lead)) * per_slice
            reader.read(tensor.name, buffer[start:start + per_slice])
        else:
            array = reader.read(tensor.name, scratch[: reader.nbytes(tensor.name)])
            stacked[tensor.index] = tensor.to_flax(array)
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
