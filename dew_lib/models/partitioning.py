"""Where each parameter lives on a mesh: logical axes, declared once by the module that owns
the parameter, and the rules that map them to the mesh axes `data`, `fsdp`, `expert` and `tensor`.

A module declares, for the trailing names of a parameter's path, one logical axis per dimension
(`declare({("q_proj", "kernel"): ("layers", "embed", "heads")})`). Any tree whose leaves end in
those names (the parameters, Adam's moments, an EMA copy, a gradient sum) then gets the same
partition: `embed` over `fsdp` (FSDP: every device holds a slice of each weight and gathers it
for the layer it computes), `heads`, `kv_heads`, `mlp` and `vocab` over `tensor` (Megatron's
column and row pairs), a mixture of experts' `experts` over `expert` (expert parallelism: each
device holds its share of the experts, models/expert_parallel.py sends it their tokens), and
nothing ever over the stacked `layers` axis, which the scanned body slices. A mesh axis serves
one dimension of a parameter: the first that asks for it.

The batch's rows, and every activation's, are split over `data`, `fsdp` and `expert`: the
devices of an expert group hold different tokens, as in the usual expert parallelism, so the
axis costs no replicated attention or dense-layer work; on a dense model it is one more data
axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the rows of a batch and every activation are split over these

# logical axis -> the mesh axes that split it (absent or empty: kept whole on every device)
RULES: Mapping[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": ("expert",),
}

_DECLARED: dict[tuple[str, ...], tuple[str | None, ...]] = {}


def declare(axes: Mapping[tuple[str, ...], Sequence[str | None]]) -> None:
    """Declare the logical axes of the parameters whose path ends with each key's names; a
    module calls this once, beside the code that creates them. Redeclaring a path must agree."""
    for names, logical in axes.items():
        logical = tuple(logical)
        if _DECLARED.setdefault(tuple(names), logical) != logical:
            raise ValueError(f"the parameter path {'/'.join(names)} is declared twice, as "
                             f"{_DECLARED[tuple(names)]} and {logical}")


def path_names(path: Sequence[Any]) -> tuple[str, ...]:
    """The dict keys and attribute names of a pytree path, the way parameters are named."""
    names = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str):
            names.append(name)
    return tuple(names)


def logical_axes(names: Sequence[str], ndim: int) -> tuple[str | None, ...] | None:
    """The declared logical axes of a leaf with these path names and rank (the longest declared
    suffix of its names with as many axes as it has dimensions), or None when none is declared."""
    names = tuple(names)
    for start in range(len(names)):
        logical = _DECLARED.get(names[start:])
        if logical is not None and len(logical) == ndim:
            return logical
    return None


def spec_for(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, where: str) -> PartitionSpec:
    """The PartitionSpec of a leaf of `shape` with these logical axes on `mesh`: each dimension
    over the mesh axes its rule names that are larger than one and not used by an earlier one.
    Refuses a dimension its mesh axes do not divide, naming the leaf and the axis."""
    used: set[str] = set()
    entries: list[Any] = []
    for axis, size in zip(logical, shape, strict=True):
        mesh_axes = tuple(name for name in RULES.get(axis or "", ()) if mesh.shape.get(name, 1) > 1
                          and name not in used)
        if mesh_axes:
            split = math.prod(mesh.shape[name] for name in mesh_axes)
            if size % split:
                raise ValueError(
                    f"{where}: its {axis} dimension of {size} does not divide across the mesh's "
                    f"{' x '.join(f'{name}={mesh.shape[name]}' for name in mesh_axes)}; choose a "
                    f"mesh whose {'/'.join(mesh_axes)} size divides {size}")
            used.update(mesh_axes)
        entries.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def splits_parameters(mesh: Mesh) -> bool:
    """Whether `mesh` splits parameters at all (an `fsdp`, `expert` or `tensor` axis larger than one)."""
    return any(mesh.shape.get(name, 1) > 1 for name in ("fsdp", "expert", "tensor"))


def tree_specs(tree: Any, mesh: Mesh, *, required: bool = False, what: str = "parameter") -> Any:
    """The PartitionSpec of every array leaf of `tree` (parameters, optimizer state, an EMA):
    from its declared logical axes, or whole on every device when none is declared. With
    `required`, an undeclared leaf of rank >= 1 is refused instead, naming its path."""

    def spec(path, leaf):
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0:
            return PartitionSpec()
        names = path_names(path)
        where = f"the {what} {'/'.join(names) or jax.tree_util.keystr(path)} {tuple(shape)}"
        logical = logical_axes(names, len(shape))
        if logical is None:
            if required:
                raise ValueError(
                    f"{where} has no declared logical axes, so it cannot be split over the mesh; "
                    "declare them with dew_lib.models.partitioning.declare({(..., 'name', 'kernel'): "
                    "(logical axes, one per dimension)}) in the module that creates it")
            return PartitionSpec()
        return spec_for(logical, shape, mesh, where)

    return jax.tree_util.tree_map_with_path(spec, tree)


def constrain_rows(x: jax.Array, axis: int = 0) -> jax.Array:
    """`x` with its rows (`axis`, the batch's) split over the `data`, `fsdp` and `expert` axes of
    the mesh the caller traces under (the Trainer's step sets its mesh), else unchanged.

    Without it, XLA may partition a matmul whose weight is split over `fsdp` along its input by
    computing partial products for the whole global batch on every device and summing them,
    which keeps every activation whole on every device; pinned to the batch split, it gathers
    the weight instead, as FSDP means to."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = tuple(name for name in BATCH_AXES if dict(mesh.shape).get(name, 1) > 1)
    if not axes:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*[None] * axis, axes))


def tree_shardings(tree: Any, mesh: Mesh, **options) -> Any:
    """`tree_specs` as a NamedSharding per leaf: what `jax.device_put` and `jit` take."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree_specs(tree, mesh, **options),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def place(tree: Any, mesh: Mesh) -> Any:
    """A copy of `tree` laid out on `mesh` by the declared axes, e.g. a decoder's variables split
    over a `tensor` axis for `dew_lib.sampling.generate` to run tensor-parallel."""
    return jax.tree.map(copy_to, tree, tree_shardings(tree, mesh))


def copy_to(leaf: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """`leaf` on `sharding` in buffers of its own, which a later donation of `leaf` leaves alone.

    `jax.device_put(..., may_alias=False)` is not enough: an array replicated over several
    devices put on one of them comes back as that device's buffer (JAX 0.10), so a trainer that
    donates its state would delete the weights a server holds. A device array is therefore placed
    and then copied on its new devices; a host array is copied by the transfer itself."""
    if not isinstance(leaf, jax.Array):
        return jax.device_put(leaf, sharding)
    return jax.numpy.array(jax.device_put(leaf, sharding), copy=True)


__all__ = ["BATCH_AXES", "MESH_AXES", "RULES", "constrain_rows", "copy_to", "declare", "logical_axes", "path_names",
           "place", "spec_for", "splits_parameters", "tree_shardings", "tree_specs"]
