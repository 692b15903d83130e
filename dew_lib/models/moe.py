"""Mixture-of-experts MLPs: the router, dropless grouped dispatch, routing replay, the router's losses.

A sparse layer sends each token to the `k` experts its router scores highest (softmax over all
experts in float32, then top-k, ties to the lower index as `torch.topk` and `lax.top_k` break
them; with `norm_topk_prob` the k weights are renormalised to sum to 1) and adds their SiLU-gated
MLPs, weighted. Qwen2-MoE adds an always-on shared expert behind a sigmoid gate. This is the math
of transformers' Qwen3-MoE, Qwen2-MoE and Mixtral blocks.

Dispatch is dropless: the token slots (`T * k`) are sorted by expert, each expert's group padded
to a whole number of `BLOCK` rows, and a loop over the used blocks runs each block through its
expert's weights; its backward pass is a second loop that adds each block's weight gradients into
its expert's in place. Fixed shapes (at most `E * (BLOCK - 1)` padding rows), no token ever
dropped, and the work is that of the routed slots, not of every expert on every token.
`jax.lax.ragged_dot` would be the grouped matmul, but XLA:CPU computes it densely: measured here
(4096 slots, width 256, expert width 512) it took as long as running all 8 or 32 experts on
every row (0.056 s vs 0.059 s at 8 experts, 0.24 s vs 0.25 s at 32). Forward and backward at
2048 tokens, top-2, on this 2-core CPU: 0.095 s against 0.53 s for every expert at 8 experts,
0.13 s against 2.1 s at 32; one dense MLP per slot (the routed work alone) took 0.054 s and
0.094 s.

Expert parallelism: under a mesh with an `expert` axis larger than one (the Trainer's step traces
under its mesh), `Experts` runs `expert_parallel_mlp`. The experts are split over the axis and the
rows over the batch axes; each device all-gathers its expert group's rows, runs the slots that
name its own experts through the same block loop and reduce-scatters the sums back. A gather, not
an all-to-all: at fixed shapes a dropless all-to-all must size each device's send and receive
buffers for all its `T * k` slots going to any one device (`expert * T * k` rows each way), where
the gather holds the group's `expert * T` rows; both hold a block buffer for the group's
`expert * T * k` slots, of which the loop computes only those its experts get (docs/moe.md).

Routing replay: given `routes` `[T, k]` and `routed` `[T]`, a routed token uses exactly those
experts, weighted by the router's current probabilities at them (renormalised when the model
does), so the router keeps its gradient; other tokens route freely.

Not here: the layer that calls this (`decoder_layer.Block`), replay's options and the losses'
coefficients (objectives/routing.py), Hugging Face names (models/pretrained/layout.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dew_lib.models import partitioning

BLOCK = 64  # rows per dispatch block: each expert's group is padded to a multiple of it


@dataclasses.dataclass(frozen=True)
class Sparse:
    """A sparse layer's shape: `experts` routed experts of MLP width `features`, `per_token`
    of them per token, weights renormalised when `normalize`, and a shared expert of width
    `shared_features` (0: none)."""

    experts: int
    per_token: int
    features: int
    normalize: bool = True
    shared_features: int = 0


class Routing(NamedTuple):
    """What the routers of a forward pass did, over its real tokens (segment id > 0).

    `layers` are the sparse layers only, in order (`CausalTransformer.moe_layers`; all of them
    unless the model has `dense_layers`), as vLLM and SGLang report routes.
    experts: `[B, S, layers, k]` the experts each token used. load: `[layers, experts]` each
    expert's share of the layer's token slots. aux_loss: transformers' load-balancing loss over
    all layers (without its coefficient). z_loss: the mean squared log-sum-exp of the router
    logits over tokens and layers.
    """

    experts: jax.Array
    load: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array


class LayerRouting(NamedTuple):
    """One layer's share of a `Routing`, summed over its real tokens (what the layer scan stacks)."""

    experts: jax.Array  # [B, S, k]
    chosen: jax.Array  # [k, E]: how many real tokens put each expert in each top-k place
    probability: jax.Array  # [E]: the router's probabilities summed over real tokens
    z: jax.Array  # sum over real tokens of logsumexp(logits) ** 2
    tokens: jax.Array  # how many real tokens


def route(logits: jax.Array, k: int, normalize: bool, routes: jax.Array | None = None,
          routed: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Experts `[T, k]` and their weights `[T, k]` (float32) from float32 router `logits`
    `[T, E]`, and the probabilities `[T, E]`. `routes`/`routed`: replay those experts where
    `routed` is true (everywhere when it is None)."""
    probabilities = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probabilities, k)
    if routes is not None:
        chosen = jnp.ones(routes.shape[:1], bool) if routed is None else routed
        replayed = jnp.take_along_axis(probabilities, routes, axis=-1)
        experts = jnp.where(chosen[:, None], routes, experts)
        weights = jnp.where(chosen[:, None], replayed, weights)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights, probabilities


def grouped_mlp(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                down: jax.Array, block: int = BLOCK) -> jax.Array:
    """`sum_k weights[t, k] * expert_{experts[t, k]}(x[t])` for rows `x` `[T, X]`, where
    expert e is `down[e](silu(gate[e] x) * up[e] x)`; gate/up `[E, X, M]`, down `[E, M, X]`.
    A slot whose expert is `E` or more adds nothing: how expert parallelism marks the slots
    that another device's experts compute.

    Dropless: every slot is computed, whatever the imbalance (module docstring).
    """
    tokens, k = experts.shape
    count, width = gate.shape[0], x.shape[-1]
    slots = tokens * k
    flat = experts.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)  # slots grouped by expert, skipped ones last
    grouped = flat[order]
    kept = grouped < count
    sizes = jnp.bincount(flat, length=count)  # skipped slots fall outside and are not counted
    padded = (sizes + block - 1) // block * block
    ends = jnp.cumsum(padded)
    blocks = -(-slots // block) + count - 1  # the groups never need more
    within = jnp.arange(slots) - (jnp.cumsum(sizes) - sizes)[grouped]
    # each sorted slot's row in the padded buffer; a skipped slot's is past its end
    row_of = jnp.where(kept, (ends - padded)[grouped] + within, blocks * block)
    rows = jnp.zeros((blocks * block, width), x.dtype).at[row_of].set(x[order // k], mode="drop")
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * block, side="right"), count - 1)
    rows, gate, up, down = _alike(rows, gate.astype(x.dtype), up.astype(x.dtype), down.astype(x.dtype))
    out = _blocks(rows.reshape(blocks, block, width), owner.astype(jnp.int32), ends[-1] // block,
                  gate, up, down).reshape(-1, width)
    per_slot = jnp.zeros((slots, width), x.dtype).at[order].set(out.at[row_of].get(mode="fill", fill_value=0))
    return jnp.einsum("tkx,tk->tx", per_slot.reshape(tokens, k, width), weights.astype(x.dtype))


def expert_parallel_mlp(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                        down: jax.Array, mesh: Any, block: int = BLOCK) -> jax.Array:
    """`grouped_mlp` on `mesh`, each device of an `expert` group computing its own experts.

    `x`, `experts`, `weights` have their rows split over the batch axes (`data`, `fsdp`,
    `expert`); the weights `[E, X, M]` their experts over `expert` and their hidden units over
    `tensor` (gathered over `fsdp` on the way in, the gradients reduce-scattered back by XLA).
    Under `shard_map` each
    device all-gathers its group's rows, routes and weights, runs the slots of its
    `E / expert` experts through `grouped_mlp` (the others marked skipped) and
    reduce-scatters the outputs, so each row comes back summed over the devices that hold its
    experts (module docstring: why a gather rather than an all-to-all).
    """
    shape = dict(mesh.shape)
    groups, count = shape["expert"], gate.shape[0]
    if count % groups:
        raise ValueError(f"experts={count} do not divide over the mesh's expert={groups}: each device of an "
                         f"expert group holds experts / expert of them; choose an expert size that divides {count}")
    local_count = count // groups
    batch = tuple(name for name in partitioning.BATCH_AXES if name in shape)
    if x.shape[0] % math.prod(shape[name] for name in batch):
        # rows that do not split over the batch axes (one decode row): XLA partitions the plain path
        return grouped_mlp(x, experts, weights, gate, up, down, block)

    def local(x, experts, weights, gate, up, down):
        first = jax.lax.axis_index("expert") * local_count
        ids = jax.lax.all_gather(experts, "expert", tiled=True) - first  # [group rows, k], local ids
        ids = jnp.where((ids >= 0) & (ids < local_count), ids, local_count)  # others' slots: skipped
        out = grouped_mlp(jax.lax.all_gather(x, "expert", tiled=True), ids,
                          jax.lax.all_gather(weights, "expert", tiled=True), gate, up, down, block)
        out = jax.lax.psum_scatter(out, "expert", scatter_dimension=0, tiled=True)
        return out if tensor is None else jax.lax.psum(out, tensor)  # the hidden units' partial sums

    # under `tensor`, each device keeps its slice of the experts' hidden units (Megatron's column
    # and row pair) and the rows' partial outputs are summed over the axis
    tensor = "tensor" if shape.get("tensor", 1) > 1 else None
    rows, column, row = (PartitionSpec(batch), PartitionSpec("expert", None, tensor),
                         PartitionSpec("expert", tensor, None))
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, column, column, row),
                         out_specs=rows)(x, experts, weights, gate, up, down)


def expert_mesh() -> Any:
    """The abstract mesh the caller traces under (the Trainer's step sets it) when it has an
    `expert` axis larger than one, else None: the single-device path."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or dict(mesh.shape).get("expert", 1) == 1:
        return None
    return mesh


def _varying(x: jax.Array) -> frozenset:
    """The manual mesh axes `x` varies over inside `shard_map` (none outside it); JAX before
    0.10 named them `vma`."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _alike(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """`arrays` cast to vary over every manual mesh axis one of them varies over, so the block
    loops' carries keep one type under `shard_map`'s checks (a no-op outside it). Autodiff
    transposes each cast into the sum over those axes that a weight's gradient needs."""
    axes = frozenset().union(*map(_varying, arrays))
    return tuple(x if _varying(x) == axes else jax.lax.pcast(x, tuple(sorted(axes - _varying(x))), to="varying")
                 for x in arrays)


def _zeros(shape: tuple[int, ...], dtype: Any, like: jax.Array) -> jax.Array:
    """Zeros that vary over the manual mesh axes `like` varies over: a loop carry beside it."""
    return _alike(jnp.zeros(shape, dtype), like)[0]


@jax.custom_vjp
def _blocks(rows, owner, used, gate, up, down):
    """Block i of `rows` `[blocks, BLOCK, X]` through expert `owner[i]`'s MLP, for the `used`
    blocks in front (the padding blocks behind them stay 0)."""
    return _blocks_forward(rows, owner, used, gate, up, down)[0]


def _blocks_forward(rows, owner, used, gate, up, down):
    """The blocks' outputs, keeping each block's gate and up products for the backward pass."""
    hidden = (rows.shape[0], rows.shape[1], gate.shape[-1])

    def body(i, carry):
        out, gates, ups = carry
        e, part = owner[i], rows[i]
        g, u = part @ gate[e], part @ up[e]
        return out.at[i].set((nn.silu(g) * u) @ down[e]), gates.at[i].set(g), ups.at[i].set(u)

    empty = _zeros(hidden, rows.dtype, rows)
    out, gates, ups = jax.lax.fori_loop(0, used, body, (_zeros(rows.shape, rows.dtype, rows), empty, empty))
    return out, (rows, owner, used, gate, up, down, gates, ups)


def _blocks_backward(saved, d_out):
    """A second loop over the used blocks, adding each block's weight gradients into its expert's
    in place (float32): autodiff through the forward loop summed a whole `[E, X, M]` cotangent
    per block, 1.5-1.8x slower at 8 and 32 experts."""
    rows, owner, used, gate, up, down, gates, ups = saved
    f32 = jnp.float32

    def body(i, carry):
        d_rows, d_gate, d_up, d_down = carry
        e, part, g, u, d = owner[i], rows[i], gates[i], ups[i], d_out[i]
        sigmoid = jax.nn.sigmoid(g)
        activated = g * sigmoid
        d_hidden = d @ down[e].T
        d_up_out = d_hidden * activated
        d_gate_out = d_hidden * u * sigmoid * (1 + g * (1 - sigmoid))
        d_down = d_down.at[e].add(jnp.dot((activated * u).T, d, preferred_element_type=f32))
        d_gate = d_gate.at[e].add(jnp.dot(part.T, d_gate_out, preferred_element_type=f32))
        d_up = d_up.at[e].add(jnp.dot(part.T, d_up_out, preferred_element_type=f32))
        return d_rows.at[i].set(d_gate_out @ gate[e].T + d_up_out @ up[e].T), d_gate, d_up, d_down

    start = (_zeros(rows.shape, rows.dtype, rows), *(_zeros(w.shape, f32, rows) for w in (gate, up, down)))
    d_rows, d_gate, d_up, d_down = jax.lax.fori_loop(0, used, body, start)
    return d_rows, None, None, d_gate.astype(gate.dtype), d_up.astype(up.dtype), d_down.astype(down.dtype)


_blocks.defvjp(_blocks_forward, _blocks_backward)


def layer_routing(experts: jax.Array, probabilities: jax.Array, logits: jax.Array, real: jax.Array,
                  shape: tuple[int, ...]) -> LayerRouting:
    """One layer's routing sums over the real tokens (`real` `[T]`), experts shaped `shape + [k]`."""
    weight = real.astype(jnp.float32)
    count = probabilities.shape[-1]
    chosen = jnp.einsum("tke,t->ke", jax.nn.one_hot(experts, count, dtype=jnp.float32), weight)
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * weight)
    return LayerRouting(experts.reshape(*shape, experts.shape[-1]).astype(jnp.int32), chosen,
                        jnp.einsum("te,t->e", probabilities, weight), z, weight.sum())


def combine(layers: LayerRouting) -> Routing:
    """The forward pass's `Routing` from its layers' sums stacked on a leading layer axis."""
    count = layers.probability.shape[-1]
    k = layers.chosen.shape[-2]
    tokens = jnp.maximum(layers.tokens.sum(), 1.0)  # over every layer, as transformers concatenates
    placed = layers.chosen.sum(0) / tokens  # [k, E]
    probability = layers.probability.sum(0) / tokens  # [E]
    aux = jnp.sum(placed * probability[None, :]) * count
    load = layers.chosen.sum(1) / (k * jnp.maximum(layers.tokens, 1.0))[:, None]  # [L, E]
    return Routing(jnp.moveaxis(layers.experts, 0, -2), load, aux, layers.z.sum() / tokens)


def check_routes(model: Any, shape: tuple[int, ...], routes: Any, routed: Any, return_routing: bool) -> None:
    """Refuse replay or routing on a dense `model`, and routes that are not
    `[B, S, layers, experts_per_token]` with `routed` `[B, S]` (`shape`), or name no expert.
    `layers` counts the sparse layers only (`model.moe_layers`): dense layers have no routes."""
    if not model.experts and (routes is not None or return_routing):
        raise ValueError("this model has no experts (experts=0): there are no routes to replay or "
                         "return; build it with experts > 0 for a mixture of experts")
    if routes is None:
        return
    expected = (*shape, len(model.moe_layers), model.experts_per_token)
    got = None if routed is None else tuple(routed.shape)
    if tuple(routes.shape) != expected or got != tuple(shape):
        raise ValueError(f"routes of shape {tuple(routes.shape)} with routed {got}: replay needs routes "
                         f"[B, S, layers, experts_per_token] = {expected} and routed [B, S] = {tuple(shape)}")
    if not isinstance(routes, jax.core.Tracer):
        ids = np.asarray(routes)
        if ids.size and (ids.min() < 0 or ids.max() >= model.experts):
            raise ValueError(f"routes name experts {int(ids.min())}..{int(ids.max())}; this model's are "
                             f"0..{model.experts - 1}")


class Experts(nn.Module):
    """The routed experts' weights, stacked on a leading expert axis."""

    count: int
    features: int
    hidden: int
    param_dtype: Any = jnp.float32

    def setup(self):
        init = nn.initializers.normal(stddev=0.02)
        self.gate_proj = self.param("gate_proj", init, (self.count, self.features, self.hidden), self.param_dtype)
        self.up_proj = self.param("up_proj", init, (self.count, self.features, self.hidden), self.param_dtype)
        self.down_proj = self.param("down_proj", init, (self.count, self.hidden, self.features), self.param_dtype)

    def __call__(self, x, experts, weights):
        mesh = expert_mesh()
        if mesh is not None:
            return expert_parallel_mlp(x, experts, weights, self.gate_proj, self.up_proj, self.down_proj, mesh)
        return grouped_mlp(x, experts, weights, self.gate_proj, self.up_proj, self.down_proj)


__all__ = ["BLOCK", "Experts", "LayerRouting", "Routing", "Sparse", "check_routes", "combine", "expert_mesh",
           "expert_parallel_mlp", "grouped_mlp", "layer_routing", "route"]
