"""The decoder's stacked layers when dense and sparse layers mix in one mixture-of-experts model.

Qwen2-MoE and Qwen3-MoE configs can keep a dense MLP in some layers (`mlp_only_layers`, and
`decoder_sparse_step`: layer i is sparse when it is not in `mlp_only_layers` and
`(i + 1) % decoder_sparse_step == 0`). The decoder takes the resolved list as `dense_layers`.

Layout: `params["layers"]` stays one subtree. The parts every layer has (norms, attention
projections, their adapters) are stacked over all `L` layers, as in a homogeneous model; the
parts of one kind of MLP are stacked over the layers of that kind only: `router`, `experts`,
`shared_expert*` on `[S, ...]` over the sparse layers in order, `gate_proj`/`up_proj`/
`down_proj` on `[D, ...]` over the dense layers. A model whose layers are all one kind has the
same tree as before (S = L or D = L), and the partitioning rules, LoRA (attention projections,
`[L, ...]`) and checkpoint code that read `params["layers"]` keep working.

Running: the stack is cut into runs of consecutive layers of one kind, and each run is one
`lax.scan` (or a loop) over its slice of the shared leaves and of its kind's leaves. A model of
one kind is a single run over the unsliced leaves: the same program as before. An alternating
pattern (`decoder_sparse_step=2`) is a run per layer, so its program grows with depth like the
looped layout.

Routes (`[B, S, layers, k]`) hold the sparse layers only, in order, as vLLM and SGLang report
them; dense layers have no entry.

Also here: `stack_layers` / `unstack_layers`, between this layout and the `layers_i` subtrees of
one layer each that the decoder kept before it stacked its layers (homogeneous stacks only).

Not here: a periodic super-layer scan for alternating patterns; the layer itself
(`decoder_layer.Block`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The top-level names under `params["layers"]` that belong to one kind of MLP; the rest are
# stacked over every layer.
SPARSE_PARTS = ("router", "experts", "shared_expert", "shared_expert_gate")
DENSE_PARTS = ("gate_proj", "up_proj", "down_proj")


class Run(NamedTuple):
    """Consecutive layers `[start, stop)` of one kind; `offset` is the first one's index among
    the layers of its kind (its row in that kind's stacked MLP leaves)."""

    sparse: bool
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def check_dense_layers(num_layers: int, experts: int, dense_layers: Sequence[int]) -> None:
    """Refuse `dense_layers` that are not sorted distinct indices of a mixture of experts that
    keeps at least one sparse layer."""
    if not dense_layers:
        return
    if not experts:
        raise ValueError(f"dense_layers={tuple(dense_layers)} names the dense layers of a mixture of "
                         "experts, and this model has experts=0 (every layer is dense already)")
    if list(dense_layers) != sorted(set(dense_layers)) or not 0 <= dense_layers[0] <= dense_layers[-1] < num_layers:
        raise ValueError(f"dense_layers={tuple(dense_layers)} must be sorted distinct layer indices in "
                         f"0..{num_layers - 1}")
    if len(dense_layers) == num_layers:
        raise ValueError(f"dense_layers={tuple(dense_layers)} makes every layer dense; build a dense "
                         "model (experts=0) instead")


def sparse_layers(num_layers: int, experts: int, dense_layers: Sequence[int]) -> tuple[int, ...]:
    """The indices of the sparse layers (none for a dense model)."""
    if not experts:
        return ()
    dense = set(dense_layers)
    return tuple(i for i in range(num_layers) if i not in dense)


def runs(num_layers: int, sparse: Sequence[int]) -> tuple[Run, ...]:
    """The stack cut into runs of consecutive layers of one kind, in order."""
    kinds = [i in set(sparse) for i in range(num_layers)]
    out: list[Run] = []
    seen = {True: 0, False: 0}
    for i, kind in enumerate(kinds):
        if out and out[-1].sparse == kind:
            out[-1] = out[-1]._replace(stop=i + 1)
        else:
            out.append(Run(kind, i, i + 1, seen[kind]))
        seen[kind] += 1
    return tuple(out)


def local_index(layer: int, sparse: Sequence[int]) -> int:
    """Layer `layer`'s row in its kind's stacked MLP leaves."""
    chosen = set(sparse)
    kind = layer in chosen
    return sum(1 for i in range(layer) if (i in chosen) == kind)


def _own(name: str) -> bool:
    """Whether the part `name` is stacked over the layers of its kind only."""
    return name in SPARSE_PARTS or name in DENSE_PARTS


def stack(layers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-layer parameter subtrees -> the stacked `layers` subtree: each part stacked over the
    layers that have it (every layer for the shared parts, one kind's layers for an MLP's)."""
    names = list(dict.fromkeys(name for layer in layers for name in layer))
    return {name: jax.tree.map(lambda *leaves: jnp.stack(leaves), *[layer[name] for layer in layers if name in layer])
            for name in names}


def run_params(stacked: Mapping[str, Any], run: Run, sparse: bool, whole: bool) -> dict[str, Any]:
    """The stacked parameters of `run`'s layers: the shared parts' rows `[start, stop)`, its
    kind's MLP parts' rows from `offset`; the other kind's parts left out. `whole`: the run is
    the entire stack, whose leaves are passed as they are."""
    parts = SPARSE_PARTS if sparse else DENSE_PARTS
    if whole:
        return dict(stacked)
    out = {}
    for name, tree in stacked.items():
        if not _own(name):
            out[name] = jax.tree.map(lambda p: p[run.start:run.stop], tree)
        elif name in parts:
            out[name] = jax.tree.map(lambda p: p[run.offset:run.offset + run.size], tree)
    return out


def layer_params(stacked: Mapping[str, Any], layer: int, local: int, sparse: bool) -> dict[str, Any]:
    """One layer's parameters: the shared parts' row `layer`, its kind's MLP parts' row `local`."""
    parts = SPARSE_PARTS if sparse else DENSE_PARTS
    rows = {name: local if _own(name) else layer for name in stacked if not _own(name) or name in parts}
    return {name: jax.tree.map(lambda p, row=row: p[row], stacked[name]) for name, row in rows.items()}


def split(stacked: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """Row i of every stacked part that has one, for i over the longest stack (the layer count):
    what `decoder.split_layers` gives. Layer i of a mixed model reads its shared parts from
    element i and its MLP from element `local_index(i)` (`pick`)."""
    count = max(jax.tree.leaves(tree)[0].shape[0] for tree in stacked.values())
    return tuple({name: jax.tree.map(lambda p, i=i: p[i], tree) for name, tree in stacked.items()
                  if jax.tree.leaves(tree)[0].shape[0] > i} for i in range(count))


def pick(rows: Sequence[Mapping[str, Any]], layer: int, local: int, sparse: bool) -> dict[str, Any]:
    """Layer `layer`'s parameters from `split`'s rows."""
    parts = SPARSE_PARTS if sparse else DENSE_PARTS
    out = {name: tree for name, tree in rows[layer].items() if not _own(name)}
    out.update({name: tree for name, tree in rows[local].items() if name in parts})
    return out


def concat_routing(routings: Sequence[Any]) -> Any:
    """The sparse runs' stacked `moe.LayerRouting`s joined on their layer axis, in order."""
    if len(routings) == 1:
        return routings[0]
    return jax.tree.map(lambda *a: jnp.concatenate(a), *routings)


def _is_per_layer(node) -> bool:
    return isinstance(node, Mapping) and "layers_0" in node and "layers" not in node


def _is_stacked(node) -> bool:
    return isinstance(node, Mapping) and isinstance(node.get("layers"), Mapping)


def stack_layers(tree):
    """Convert the per-layer layout (`layers_0`, `layers_1`, ... subtrees, what the decoder
    kept before its parameters were stacked) to one `layers` subtree stacked on a leading axis.

    Works on variables, bare params and anything holding params-shaped dicts (a train state
    with its optimizer moments); other nodes pass through. NumPy leaves stay NumPy.
    """
    def convert(node):
        if not _is_per_layer(node):
            return node
        count = sum(1 for key in node if key.startswith("layers_"))
        names = [f"layers_{i}" for i in range(count)]
        if any(name not in node for name in names):
            raise ValueError(f"per-layer subtrees are not numbered 0..{count - 1}: "
                             f"{sorted(k for k in node if k.startswith('layers_'))}")
        rest = {key: value for key, value in node.items() if not key.startswith("layers_")}

        def stack(*leaves):
            if all(isinstance(leaf, np.ndarray) for leaf in leaves):
                return np.stack(leaves)
            return jnp.stack(leaves)

        return {**rest, "layers": jax.tree.map(stack, *[node[name] for name in names])}

    return jax.tree.map(convert, tree, is_leaf=_is_per_layer)


def unstack_layers(tree):
    """The inverse of `stack_layers`: one `layers_i` subtree per index of the stacked axis. A
    stack of mixed dense and sparse layers (leaves of different lengths) is left as it is.

    Leaves may be arrays or `jax.ShapeDtypeStruct`s (an abstract state to restore into).
    """
    def cut(leaf, i):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=leaf.sharding)
        return leaf[i]

    def convert(node):
        if not _is_stacked(node):
            return node
        stacked = node["layers"]
        sizes = {leaf.shape[0] for leaf in jax.tree.leaves(stacked)}
        if len(sizes) > 1:  # dense and sparse layers mixed: never written one layer a subtree
            return node
        count = sizes.pop()
        rest = {key: value for key, value in node.items() if key != "layers"}
        return {**rest, **{f"layers_{i}": jax.tree.map(lambda p, i=i: cut(p, i), stacked)
                           for i in range(count)}}

    return jax.tree.map(convert, tree, is_leaf=_is_stacked)


__all__ = ["DENSE_PARTS", "SPARSE_PARTS", "Run", "check_dense_layers", "concat_routing", "layer_params", "local_index",
           "pick", "run_params", "runs", "sparse_layers", "split", "stack", "stack_layers", "unstack_layers"]
