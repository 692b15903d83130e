"""The job's devices as a named mesh: `data` replicas x `fsdp` shards x `expert` groups x
`tensor` shards.

`data` copies the parameters and splits the batch; `fsdp` splits the batch too and keeps a slice
of every parameter, optimizer moment and EMA copy on each device (gathered per layer as it is
used); `expert` splits the batch too and a mixture of experts' experts, each device holding
`experts / expert` of them whole (models/expert_parallel.py exchanges the tokens); `tensor`
splits attention heads, the MLP's hidden units and the vocabulary. Which dimension of a
parameter goes where is declared by its module (dew_lib/models/partitioning.py). The devices are
laid out process by process with `tensor` innermost and `expert` next, so the groups whose
collectives run every layer stay on one host when they fit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from dew_lib.models.partitioning import BATCH_AXES, MESH_AXES


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the mesh axes. data: None takes every device the other axes leave over."""

    data: int | None = None
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in MESH_AXES:
            size = getattr(self, name)
            if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                raise ValueError(f"MeshSpec.{name} must be a whole number >= 1, got {size!r}")

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """`"fsdp=8"`, `"data=2,fsdp=2,tensor=2"`, `"fsdp=2,expert=4"`: the form the command line
        and forms take."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name.strip() not in MESH_AXES or not value.strip().isdigit():
                raise ValueError(f"cannot read the mesh {text!r}: write axis=size pairs separated by "
                                 f"commas, the axes being {', '.join(MESH_AXES)} (e.g. 'fsdp=8' or "
                                 "'data=2,fsdp=2,tensor=2')")
            sizes[name.strip()] = int(value)
        return cls(**sizes)

    def shape(self, devices: int) -> dict[str, int]:
        """The axes' sizes on `devices` devices; refuses sizes whose product is not the count."""
        split = self.fsdp * self.expert * self.tensor
        data = self.data if self.data is not None else devices // split if devices % split == 0 else 0
        if data * split != devices:
            given = " x ".join(f"{name}={getattr(self, name)}" for name in self._named())
            raise ValueError(f"the mesh {given} does not cover the job's {devices} devices: the sizes "
                             f"of {', '.join(MESH_AXES)} must multiply to {devices} (leave data empty to "
                             "give it every device the others leave)")
        return {"data": data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}

    def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The mesh over `devices` (default: every device of every process)."""
        devices = list(devices) if devices is not None else jax.devices()
        shape = self.shape(len(devices))
        grid = np.array(devices, dtype=object).reshape(tuple(shape.values()))
        return Mesh(grid, MESH_AXES)

    def devices(self, data: int = 1) -> int:
        """How many devices the mesh covers, `data` standing in for an empty data size."""
        return (self.data or data) * self.fsdp * self.expert * self.tensor

    def _named(self) -> list[str]:
        """The axes its text names: those given, `expert` only when it is used, so every mesh
        written before the axis existed reads as it did."""
        return [name for name in MESH_AXES if getattr(self, name) is not None
                and not (name == "expert" and self.expert == 1)]

    def __str__(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in self._named())


def batch_shards(mesh: Mesh) -> int:
    """How many slices a batch's rows are cut into: the `data` x `fsdp` x `expert` size."""
    return math.prod(mesh.shape.get(name, 1) for name in BATCH_AXES)


__all__ = ["MeshSpec", "batch_shards"]
