"""Where a native server's weights and per-slot state live when it serves from a mesh.

`serving_mesh(n)` puts n local devices on the `tensor` axis. The weights follow the logical axes
their modules declare (`partitioning.place`); the server's state is laid out here: each layer's
KV cache `[slots, kv_heads, capacity, head_dim]` split by KV heads like the projections that fill
it, the per-slot bookkeeping whole on every device. `laid_out` pins a compiled call's output
state to that layout, so the next call takes it as it is and nothing recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew_lib.models import partitioning
from dew_lib.options import integer
from dew_lib.train.mesh import MeshSpec


def serving_mesh(tensor_parallel_size: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of `tensor_parallel_size` devices (default: the first local ones) on the `tensor`
    axis, for a server that splits attention heads, KV heads and the MLP across them."""
    size = integer("tensor_parallel_size", tensor_parallel_size)
    devices = list(devices) if devices is not None else jax.local_devices()
    if size > len(devices):
        raise ValueError(f"tensor_parallel_size={size} needs {size} devices; this process has "
                         f"{len(devices)} ({devices[0].platform})")
    return MeshSpec(data=1, tensor=size).build(devices[:size])


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """The sharding of each leaf of a server's state on `mesh`: its rank-4 leaves (each layer's
    keys and values) split by KV heads, the rest whole on every device."""
    def leaf(x):
        if x.ndim != 4:
            return NamedSharding(mesh, PartitionSpec())
        spec = partitioning.spec_for(("batch", "kv_heads", None, None), x.shape, mesh, "the KV cache")
        return NamedSharding(mesh, spec)

    return jax.tree.map(leaf, state)


def place_state(state: Any, mesh: Mesh) -> Any:
    """A fresh server state put on `mesh` in its layout."""
    return jax.device_put(state, state_shardings(state, mesh))


def laid_out(state: Any, mesh: Mesh | None) -> Any:
    """`state` pinned to its layout on `mesh` inside a compiled call (unchanged without a mesh)."""
    return state if mesh is None else jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))


__all__ = ["laid_out", "place_state", "serving_mesh", "state_shardings"]
