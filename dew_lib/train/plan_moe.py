"""The planner's arithmetic for mixtures of experts: a Hugging Face config's parameters counted
from its fields, the expert-parallel dispatch's buffers and each layer's traffic on a mesh, the
meshes of a device count that an `expert` axis allows, and the reasons a plan gives for one.

Counting reads the config alone (no JAX): every decoder family Dew loads, dense layers among
sparse ones where `mlp_only_layers` / `decoder_sparse_step` place them (transformers' rule:
layer i is sparse when it is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`;
Mixtral's layers are all sparse), Qwen2-MoE's shared expert and its gate, the routers, the
norms, the embedding and an untied head. "Active" is what one token runs: everything but the
routed experts, plus `k` of them in each sparse layer.

The dispatch's buffers follow models/moe.py: on a device of an expert group of `N`, with `T`
tokens of its own, top-`k`, `E` experts, width `X` and expert width `M` (split over `tensor`),
each sparse layer gathers the group's `N*T` rows (N > 1), sorts their `N*T*k` slots into blocks
of 64 rows for its `E/N` experts (`64 * (ceil(N*T*k / 64) + E/N - 1)` rows of `X` in and out, and
the gate and up products of `M` kept for the backward pass), writes the per-slot outputs
(`N*T*k` rows of `X`), uses its `E/N` experts' weights whole (gathered over `fsdp`) and sums
their gradients in float32 in the backward loop. XLA's temporary peak holds these (the plan's
compiled step); this is the arithmetic that says where they come from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from dew_lib.models.pretrained.families import family_of

BLOCK = 64  # models/moe.py's dispatch block (kept here so that counting needs no JAX)
GB = 10**9


@dataclasses.dataclass(frozen=True)
class ParameterCount:
    """A config's parameters by part. experts: the routed experts' MLPs; dense_mlp: the MLPs
    of dense layers; shared: Qwen2-MoE's shared experts and their gates."""

    embedding: int
    head: int
    attention: int
    norms: int
    dense_mlp: int
    router: int
    experts: int
    shared: int
    expert_count: int = 0
    per_token: int = 0
    sparse_layers: tuple[int, ...] = ()
    layers: int = 0

    @property
    def total(self) -> int:
        return (self.embedding + self.head + self.attention + self.norms + self.dense_mlp + self.router
                + self.experts + self.shared)

    @property
    def active(self) -> int:
        """Parameters one token runs through: all but the routed experts it is not sent to."""
        if not self.expert_count:
            return self.total
        return self.total - self.experts + self.experts * self.per_token // self.expert_count

    def describe(self) -> str:
        line = f"model: {_count(self.total)} parameters"
        if not self.expert_count:
            return line
        dense = self.layers - len(self.sparse_layers)
        mix = f" and {dense} dense" if dense else ""
        return (f"{line}, {_count(self.active)} active a token ({self.expert_count} experts, "
                f"{self.per_token} a token, in {len(self.sparse_layers)} sparse layers{mix}; the experts hold "
                f"{_count(self.experts)}, {self.experts / self.total:.0%})")


def _count(n: float) -> str:
    """30.53B, 3.69M, 13,360: a parameter count as a plan prints it."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{int(n):,}"


def sparse_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The indices of a config's sparse layers (none for a dense family)."""
    family = family_of(config)
    layers = int(config["num_hidden_layers"])
    if not family.moe or expert_count(config) < 1:
        return ()
    if family.model_type == "mixtral":
        return tuple(range(layers))
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def expert_count(config: Mapping[str, Any]) -> int:
    """Routed experts per sparse layer (0: dense), from whichever field the family names."""
    family = family_of(config)
    if not family.moe:
        return 0
    names = ("num_experts", "num_local_experts") if family.model_type in ("qwen3_moe", "mixtral") \
        else (str(family.experts_field),)
    return max((int(config[name]) for name in names if config.get(name)), default=0)


def count_parameters(config: Mapping[str, Any]) -> ParameterCount:
    """Every parameter of the model a Hugging Face `config` describes, by part (module docstring)."""
    family = family_of(config)
    hidden, vocab, layers = int(config["hidden_size"]), int(config["vocab_size"]), int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or family.default_head_dim or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = 2 * hidden * q + 2 * hidden * kv
    if family.qkv_bias:
        attention += q + 2 * kv
    elif family.bias_option and config.get("attention_bias"):
        attention += q + 2 * kv + hidden  # transformers biases o_proj too
    if family.qk_norm:
        attention += 2 * head_dim
    sparse = sparse_layers(config)
    experts = expert_count(config)
    per_token = int(config.get("num_experts_per_tok") or 0) if sparse else 0
    width = int(config[family.expert_width_field]) if sparse else 0
    shared_width = int(config.get("shared_expert_intermediate_size") or 0) if family.shared_expert else 0
    dense_layers = layers - len(sparse)
    return ParameterCount(
        embedding=vocab * hidden, head=0 if config.get("tie_word_embeddings", False) else vocab * hidden,
        attention=layers * attention, norms=layers * 2 * hidden + hidden,
        dense_mlp=dense_layers * 3 * hidden * int(config["intermediate_size"]),
        router=len(sparse) * hidden * experts, experts=len(sparse) * experts * 3 * hidden * width,
        shared=len(sparse) * (3 * hidden * shared_width + hidden) if shared_width else 0,
        expert_count=experts if sparse else 0, per_token=per_token, sparse_layers=sparse, layers=layers)


def dispatch_bytes(config: Mapping[str, Any], sizes: Mapping[str, int], tokens: int, itemsize: int) -> dict[str, int]:
    """One sparse layer's dispatch buffers on a device holding `tokens` tokens, under mesh
    `sizes`, in bytes (module docstring); empty for a dense model."""
    counted = count_parameters(config)
    if not counted.expert_count:
        return {}
    group, tensor = sizes.get("expert", 1), sizes.get("tensor", 1)
    family = family_of(config)
    hidden, width = int(config["hidden_size"]), -(-int(config[family.expert_width_field]) // tensor)
    local = counted.expert_count // group
    rows = group * tokens
    slots = rows * counted.per_token
    block_rows = BLOCK * (-(-slots // BLOCK) + local - 1)
    weights = local * 3 * hidden * width
    return {"gathered rows": rows * hidden * itemsize if group > 1 else 0,
            "block rows in and out": 2 * block_rows * hidden * itemsize,
            "gate and up products": 2 * block_rows * width * itemsize,
            "per-slot outputs": slots * hidden * itemsize,
            "experts' weights": weights * itemsize, "their float32 gradients": weights * 4,
            "rows": rows, "slots": slots, "block_rows": block_rows, "local_experts": local}


def layer_traffic(config: Mapping[str, Any], sizes: Mapping[str, int], tokens: int,
                  itemsize: int) -> tuple[int, int, int]:
    """What one layer moves per step (forward and backward) to or from one device, in bytes,
    on average over the layers (the embedding and head apart): (weights over `fsdp`: a device
    of a group of `F` receives `(F - 1) / F` of the layer's weights as the expert and tensor
    groups split them, in the forward pass, again in the backward, and as much gradient is
    reduce-scattered; tokens over `expert`: `(N - 1) * T` rows gathered and as many outputs
    reduce-scattered, forward and backward; gradients summed over the replicas of a weight,
    `data x expert` of them outside the experts, `data` for the experts: `2 (R - 1) / R` of
    their slice, a ring all-reduce)."""
    counted = count_parameters(config)
    data, fsdp = sizes.get("data", 1), sizes.get("fsdp", 1)
    group, tensor = sizes.get("expert", 1), sizes.get("tensor", 1)
    outside = counted.attention + counted.norms - int(config["hidden_size"]) + counted.dense_mlp + counted.router \
        + counted.shared
    others, experts = outside / tensor / counted.layers, counted.experts / (group * tensor) / counted.layers
    weights = 3 * (fsdp - 1) / fsdp * (others + experts) * itemsize
    moved = 4 * (group - 1) * tokens * int(config["hidden_size"]) * itemsize if counted.expert_count else 0
    replicas = data * group
    reduced = 2 * ((replicas - 1) / replicas * others + (data - 1) / data * experts) / fsdp * itemsize
    return int(weights), moved, int(reduced)


def candidate_meshes(devices: int, experts: int, tensor: int = 1) -> list[dict[str, int]]:
    """Every `fsdp x expert x tensor` split of `devices` (data=1: a copy of the state per data
    replica is what full fine-tuning cannot afford) whose expert size divides `experts`, fewest
    expert groups first; a dense model (experts=0) gets fsdp alone."""
    if devices % tensor:
        raise ValueError(f"tensor={tensor} does not divide the {devices} devices")
    split = devices // tensor
    groups = [n for n in range(1, split + 1) if split % n == 0 and (n == 1 or (experts and experts % n == 0))]
    return [{"data": 1, "fsdp": split // n, "expert": n, "tensor": tensor} for n in groups]


def mesh_text(sizes: Mapping[str, int]) -> str:
    shown = [f"{name}={size}" for name, size in sizes.items() if size > 1]
    return ",".join(shown) or "data=1"


def choose(config: Mapping[str, Any], plans: Sequence[Any], itemsize: int) -> Any:
    """Of `plans` (MemoryPlans of one step on meshes of the same devices), the one to train on:
    of those that fit, the one that moves the fewest bytes a layer (weights gathered over fsdp,
    tokens over expert; then the least loaded); without a device size, the least loaded; None
    when none fits."""
    fitting = [p for p in plans if p.fits is not False]
    if not fitting:
        return None
    if any(p.fits is None for p in plans):
        return min(fitting, key=lambda p: p.total)
    return min(fitting, key=lambda p: (sum(layer_traffic(config, p.mesh, tokens_per_device(p), itemsize)), p.total))


def reasons(config: Mapping[str, Any], plans: Sequence[Any], chosen: Any, itemsize: int) -> list[str]:
    """Why `chosen` (a MemoryPlan among `plans`, or None when none fits) is the mesh to train on."""
    counted = count_parameters(config)
    lines = []
    fitting = [p for p in plans if p.fits is not False]
    least = min(plans, key=lambda p: p.total)
    if chosen is None:
        lines.append(f"none of the {len(plans)} meshes fits; the least loaded is {mesh_text(least.mesh)} at "
                     f"{least.total / GB:.1f} GB a device; its advice:")
        lines += [line for line in least.advice if not line.startswith("the experts hold")]
        big = max(plans, key=lambda p: p.mesh.get("expert", 1))
        if counted.expert_count and big is not least and big.mesh.get("expert", 1) > 1:
            buffers = dispatch_bytes(config, big.mesh, tokens_per_device(big), itemsize)
            kept = buffers["block rows in and out"] // 2 + buffers["gate and up products"]
            lines.append(f"a larger expert group does not help here: {mesh_text(big.mesh)}'s dispatch sizes each "
                         f"sparse layer's blocks for the group's {buffers['slots']:,} slots, {kept / GB:.2f} GB of "
                         "them kept for the backward pass (in each of "
                         f"{len(counted.sparse_layers)} layers without remat; temporary peak "
                         f"{big.temporary / GB:.1f} GB against {least.temporary / GB:.1f})")
        return lines
    tokens = tokens_per_device(chosen)
    lines.append(f"{len(fitting)} of the {len(plans)} meshes fit; chosen: {mesh_text(chosen.mesh)} "
                 f"({chosen.total / GB:.1f} GB a device), the one of them that moves the fewest bytes a layer "
                 f"and step: {_traffic_text(config, chosen, itemsize)}")
    if counted.expert_count and chosen.mesh.get("expert", 1) > 1:
        group = chosen.mesh["expert"]
        others = counted.total - counted.experts
        lines.append(f"expert={group} keeps {counted.expert_count // group} of the {counted.expert_count} experts "
                     f"of each layer whole on a device, so their {_count(counted.experts)} parameters and "
                     "moments are split without gathering them; the tokens travel instead "
                     f"({group - 1} x {tokens:,} rows each way a layer)")
        if chosen.mesh.get("fsdp", 1) == 1:
            lines.append(f"the other {_count(others)} parameters (attention, embeddings, routers) are "
                         "whole on every device with fsdp=1, with their moments")
    dense = min(plans, key=lambda p: (p.mesh.get("expert", 1), p.total))
    if dense is not chosen and counted.expert_count:
        lines.append(f"{mesh_text(dense.mesh)} ({dense.total / GB:.1f} GB, "
                     f"{'fits' if dense.fits is not False else 'does not fit'}) gathers every expert of a layer "
                     f"instead: {_traffic_text(config, dense, itemsize)}")
    if least is not chosen:
        lines.append(f"{mesh_text(least.mesh)} holds the least ({least.total / GB:.1f} GB a device): choose it "
                     "if memory, not traffic, is what runs short")
    big = max(plans, key=lambda p: p.mesh.get("expert", 1))
    if counted.expert_count and big.mesh.get("expert", 1) > 1:
        buffers = dispatch_bytes(config, big.mesh, tokens_per_device(big), itemsize)
        lines.append(f"the dispatch buffers grow with the group: under {mesh_text(big.mesh)} a sparse layer "
                     f"gathers {buffers['rows']:,} rows and sizes its blocks for {buffers['slots']:,} slots "
                     f"(dropless: every slot of the group could land on one device), "
                     f"{_buffer_total(buffers) / GB:.2f} GB of the temporary peak")
    return lines


def moe_notes(config: Mapping[str, Any], plan: Any, itemsize: int) -> list[str]:
    """The lines a plan of an MoE model adds: its count, the experts' split, one sparse layer's
    dispatch buffers and one layer's traffic."""
    counted = count_parameters(config)
    lines = [counted.describe()]
    if not counted.expert_count:
        return lines
    sizes, tokens = plan.mesh, tokens_per_device(plan)
    buffers = dispatch_bytes(config, sizes, tokens, itemsize)
    group = sizes.get("expert", 1)
    lines.append(f"experts over expert={group}: {buffers['local_experts']} of {counted.expert_count} a device "
                 f"(their width over fsdp={sizes.get('fsdp', 1)}, their hidden units over "
                 f"tensor={sizes.get('tensor', 1)}); the other {_count(counted.total - counted.experts)} "
                 "parameters over fsdp and tensor only")
    kept = buffers["block rows in and out"] // 2 + buffers["gate and up products"]
    lines.append(f"dispatch, one sparse layer: {buffers['rows']:,} rows ({group} x {tokens:,}), "
                 f"{buffers['slots']:,} slots in {buffers['block_rows']:,} block rows, "
                 f"{_buffer_total(buffers) / GB:.2f} GB of buffers with the layer's experts and their gradients, "
                 f"{kept / GB:.2f} GB of them kept for the backward pass (in the temporary peak)")
    lines.append(f"one layer and step, a device: {_traffic_text(config, plan, itemsize)}")
    return lines


def tokens_per_device(plan: Any) -> int:
    """Tokens a device runs in one micro-step of `plan` (DPO's pairs count twice)."""
    shards = math.prod(plan.mesh.get(name, 1) for name in ("data", "fsdp", "expert"))
    pairs = 2 if plan.stage == "dpo" else 1
    return plan.rows // plan.accumulate // shards * plan.width * pairs


def _traffic_text(config: Mapping[str, Any], plan: Any, itemsize: int) -> str:
    weights, moved, reduced = layer_traffic(config, plan.mesh, tokens_per_device(plan), itemsize)
    return (f"{weights / GB:.2f} GB of weights gathered and their gradients reduce-scattered (fsdp), "
            f"{moved / GB:.2f} GB of tokens exchanged (expert), {reduced / GB:.2f} GB of gradients summed "
            "over replicas")


def _buffer_total(buffers: Mapping[str, int]) -> int:
    return sum(v for k, v in buffers.items() if k not in ("rows", "slots", "block_rows", "local_experts"))


__all__ = ["ParameterCount", "candidate_meshes", "choose", "count_parameters", "dispatch_bytes", "expert_count",
           "layer_traffic", "mesh_text", "moe_notes", "reasons", "sparse_layers", "tokens_per_device"]
