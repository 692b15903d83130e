"""What one training step needs on each device, known before any weight is loaded.

`plan` builds the stage's real objective and Trainer on abstract shapes, over a mesh of host
devices shaped like the target, and compiles the real update ahead of time. The state's parts
(parameters, optimizer moments, the frozen reference, an accumulation window's gradient sum)
are read from their shardings, exactly; the batch's too; and XLA's own memory analysis of the
compiled step gives the temporary peak (activations kept for the backward pass, gradients,
gathered weights). The sum is compared with the device's memory, and a plan that does not fit
says what would make it fit. Under an `expert` axis the experts' weights and moments are read
from their shardings like the rest (each device's `experts / expert` of them), and the peak
includes the expert-parallel exchange's buffers (models/moe.py). A plan of a mixture of experts
also reports the config's parameter count, the experts' split, one sparse layer's dispatch
buffers and one layer's traffic (train/plan_moe.py), and `suggest` plans every `fsdp x expert`
mesh of a device count and chooses one, saying why.

Compiled for the CPU, the temporary peak is XLA:CPU's, not XLA:GPU's or XLA:TPU's: their
fusions and attention kernels differ (the plan compiles the XLA-only `blockwise` attention,
which like cuDNN's flash kernel never holds a whole score matrix). Read it as an estimate; the
state's bytes are exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dew_lib.models.partitioning import BATCH_AXES
from dew_lib.plan_tables import DEVICE_BYTES, MODELS, STAGES
from dew_lib.train import plan_moe
from dew_lib.train.mesh import MeshSpec, batch_shards

GB = 10**9


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes one device holds during a step of `stage` (the most loaded device: device 0)."""

    stage: str
    mesh: dict[str, int]
    rows: int
    width: int
    parameters: int
    optimizer: int
    reference: int
    gradients: int
    batch: int
    temporary: int
    device_bytes: int | None
    advice: tuple[str, ...] = ()
    accumulate: int = 1
    notes: tuple[str, ...] = ()  # a mixture of experts: its count, experts' split, dispatch, traffic

    @property
    def state(self) -> int:
        return self.parameters + self.optimizer + self.reference + self.gradients

    @property
    def total(self) -> int:
        return self.state + self.batch + self.temporary

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.total <= self.device_bytes

    def report(self) -> str:
        """The plan as a table, its verdict and, when it does not fit, what to change."""
        mesh = " x ".join(f"{name}={size}" for name, size in self.mesh.items() if name != "expert" or size > 1)
        lines = [f"{self.stage}: {self.rows} rows of {self.width} ids a step on {mesh}; bytes per device:"]
        for name, value in (("parameters", self.parameters), ("optimizer state", self.optimizer),
                            ("reference", self.reference), ("gradient sum", self.gradients),
                            ("batch", self.batch), ("temporary peak (XLA)", self.temporary),
                            ("total", self.total)):
            lines.append(f"  {name:<22}{value / GB:>10.2f} GB")
        lines += self.notes
        if self.device_bytes is None:
            lines.append("no device size given (--device or --device-bytes): no verdict")
        else:
            share = self.total / self.device_bytes
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"{verdict}: {share:.0%} of the device's {self.device_bytes / GB:.1f} GB")
        lines += [f"  - {line}" for line in self.advice]
        return "\n".join(lines)


def model_config(name: str) -> dict[str, Any]:
    """A known model's Hugging Face config (`qwen3-8b`), or the config.json at a path."""
    if name.lower() in MODELS:
        return dict(MODELS[name.lower()])
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise ValueError(f"{name!r} is neither a known model ({', '.join(MODELS)}) nor a config.json "
                         "or a checkpoint directory holding one")
    with open(path) as handle:
        return json.load(handle)


def device_bytes(device: str | None, given: int | None = None) -> int | None:
    """The memory of a named device (`h200`), or `given` bytes."""
    if given is not None:
        return given
    if device is None:
        return None
    if device.lower() not in DEVICE_BYTES:
        raise ValueError(f"unknown device {device!r}; known: {', '.join(DEVICE_BYTES)} (or give --device-bytes)")
    return DEVICE_BYTES[device.lower()]


def plan(config: Mapping[str, Any], *, stage: str, mesh: MeshSpec, seq_len: int, batch: int,
         dtype: str = "bfloat16", remat: bool = False, accumulate: int = 1,
         device: int | None = None) -> MemoryPlan:
    """Compile `stage`'s update for a model of `config` on this process's devices arranged as
    `mesh` and return what device 0 holds. seq_len: ids per row; batch: rows (SFT, GRPO, PPO,
    distill: packed rows; DPO: pairs) per step, split over `accumulate` micro-steps. device: its
    memory. Distill plans a teacher of the model's own config held in process (`_distill`)."""
    import optax

    from dew_lib import models
    from dew_lib.models.pretrained.families import decoder_options
    from dew_lib.train.trainer import Trainer

    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, got {stage!r}")
    _, options = decoder_options(config)
    options["max_seq_len"] = max(options["max_seq_len"], seq_len)
    width = jnp.dtype(dtype)
    model = models.build("causal_transformer", **options, dtype=width, param_dtype=width,
                         attention_kernel="blockwise", remat=remat)
    trainer = Trainer(_objective(stage, model, seq_len - 1), optax.adamw(1e-6), key=jax.random.key(0),
                      mesh=mesh, accumulate=accumulate)
    found = measure(trainer, stage, rows=batch, width=seq_len, device=device, remat=remat, dtype=dtype)
    notes = tuple(plan_moe.moe_notes(config, found, width.itemsize))
    advice = found.advice + tuple(_expert_advice(config, found))
    return dataclasses.replace(found, notes=notes, advice=advice)


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    """The plans of every mesh `suggest` tried, the one it chose (None: none fits) and why."""

    plans: tuple[MemoryPlan, ...]
    chosen: MemoryPlan | None
    reasons: tuple[str, ...]

    def report(self) -> str:
        first = self.plans[0]
        devices = math.prod(first.mesh.values())
        lines = [f"{first.stage}: {first.rows} rows of {first.width} ids a step on {devices} devices, every "
                 "fsdp x expert mesh; GB per device:",
                 f"  {'mesh':<20}{'params':>8}{'optimizer':>11}{'reference':>11}{'temporary':>11}{'total':>8}"]
        for found in self.plans:
            verdict = "" if not found.device_bytes else f"  {found.total / found.device_bytes:.0%} " + (
                "fits" if found.fits else "does NOT fit")
            lines.append(f"  {plan_moe.mesh_text(found.mesh):<20}{found.parameters / GB:>8.2f}"
                         f"{found.optimizer / GB:>11.2f}{found.reference / GB:>11.2f}"
                         f"{found.temporary / GB:>11.2f}{found.total / GB:>8.2f}{verdict}")
        lines.append(first.notes[0] if first.notes else "")
        return "\n".join([*lines, *(f"  - {line}" for line in self.reasons)])


def suggest(config: Mapping[str, Any], *, devices: int, stage: str, seq_len: int, batch: int,
            dtype: str = "bfloat16", remat: bool = False, accumulate: int = 1, tensor: int = 1,
            device: int | None = None) -> MeshChoice:
    """Plan `stage` on every `fsdp x expert` mesh of `devices` devices (`tensor` kept; an
    expert size divides the expert count) on this process's devices, and choose: of the meshes
    that fit, the one that moves the fewest bytes a layer (weights gathered over fsdp, tokens
    over expert), the least loaded when the device's size is not given."""
    if devices % tensor or (batch // accumulate) % (devices // tensor):
        raise ValueError(f"{batch // accumulate} rows a micro-step do not split over the data x fsdp x expert "
                         f"of {devices} devices with tensor={tensor}")
    plans = tuple(plan(config, stage=stage, mesh=MeshSpec(**sizes), seq_len=seq_len, batch=batch, dtype=dtype,
                       remat=remat, accumulate=accumulate, device=device)
                  for sizes in plan_moe.candidate_meshes(devices, plan_moe.expert_count(config), tensor))
    itemsize = jnp.dtype(dtype).itemsize
    chosen = plan_moe.choose(config, plans, itemsize)
    return MeshChoice(plans, chosen, tuple(plan_moe.reasons(config, plans, chosen, itemsize)))


def _expert_advice(config: Mapping[str, Any], found: MemoryPlan) -> list[str]:
    """A plan of an MoE model that does not fit: the `expert` axis among its remedies."""
    counted = plan_moe.count_parameters(config)
    if found.fits is not False or not counted.expert_count:
        return []
    devices = math.prod(found.mesh.values())
    sizes = [n for n in range(2, counted.expert_count + 1) if counted.expert_count % n == 0][:4]
    return [f"the experts hold {counted.experts / counted.total:.0%} of the parameters: expert=N (N dividing "
            f"{counted.expert_count}: {', '.join(map(str, sizes))}, ...) splits them and their moments as fsdp "
            "does without gathering them each layer, while fsdp also splits the rest; "
            f"`dew plan --suggest {devices}` plans every fsdp x expert mesh of {devices} devices"]


def measure(trainer: Any, stage: str, *, rows: int, width: int, device: int | None = None,
            remat: bool = False, dtype: str = "float32") -> MemoryPlan:
    """Compile `trainer`'s update ahead of time for a `stage` batch of `rows` rows (DPO: pairs)
    of `width` ids, split into the trainer's `accumulate` micro-steps, and return what device 0
    holds. Nothing is allocated: the state and batch are abstract. remat and dtype only shape
    the advice of a plan that does not fit."""
    accumulate = trainer.accumulate
    if rows % accumulate:
        raise ValueError(f"batch={rows} does not split into accumulate={accumulate} equal micro-batches")
    micro_rows = rows // accumulate
    shards = batch_shards(trainer.mesh)
    if micro_rows % shards:
        axes = " x ".join(name for name in BATCH_AXES if name != "expert" or trainer.mesh.shape["expert"] > 1)
        raise ValueError(f"{micro_rows} rows a micro-step do not split over the mesh's {axes} = {shards}")
    state = trainer.abstract_state()
    placed = NamedSharding(trainer.mesh, PartitionSpec(BATCH_AXES))
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed),
                         _batch(stage, micro_rows, width, trainer.objective))
    analysis = trainer._steps[True].lower(state, micro).compile().memory_analysis()
    if analysis is None:
        raise ValueError(f"the {jax.default_backend()} compiler of this JAX gives no memory analysis, "
                         "which the plan reads")
    parts = {name: _held(getattr(state, name)) for name in ("params", "opt_state", "ema", "grads")}
    found = MemoryPlan(stage=stage, mesh=dict(trainer.mesh.shape), rows=rows, width=width, accumulate=accumulate,
                       parameters=parts["params"], optimizer=parts["opt_state"], reference=parts["ema"],
                       gradients=parts["grads"], batch=_held(micro),
                       temporary=int(analysis.temp_size_in_bytes), device_bytes=device)
    return dataclasses.replace(found, advice=_advice(found, remat, dtype, accumulate))


def device_limit(devices: Any = None) -> int | None:
    """The least memory any of `devices` (default: this process's) gives a program, from what
    each reports (`memory_stats()["bytes_limit"]`); None where none reports it, as CPUs."""
    limits = []
    for dev in devices if devices is not None else jax.local_devices():
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        if stats and stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def _held(tree: Any) -> int:
    """Bytes device 0 holds of `tree`'s abstract leaves (each leaf's shard shape)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _objective(stage: str, model: Any, seq_len: int):
    from dew_lib.objectives import DPOObjective, GRPOObjective, LMObjective, PPOObjective, ValueHead

    if stage == "sft":
        return LMObjective(model, seq_len=seq_len, ema_decay=None)  # as the pipeline's SFT
    if stage == "dpo":
        return DPOObjective(model, seq_len=seq_len, beta=0.1)
    if stage == "grpo":
        return GRPOObjective(model, seq_len=seq_len, beta=0.01)
    if stage == "distill":
        return _distill(model, seq_len)
    return PPOObjective(model, seq_len=seq_len, critic=ValueHead(model), beta=0.01)


def _distill(model: Any, seq_len: int):
    """Distillation (the pipeline's default loss, 'jsd', which holds both models' logits) from a
    teacher of the student's own config, frozen in TrainState.ema as the other stages' reference
    is. A bigger teacher holds more, and a remote teacher (on an engine) holds nothing here:
    neither is planned."""
    from dew_lib.objectives import DistillObjective

    class TeacherCopy(DistillObjective):
        def reference_params(self, params):
            return params  # the teacher's shapes and shardings are the student's: nothing is allocated

    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
    return TeacherCopy(model, seq_len, teacher_model=model, teacher=shapes, loss="jsd")


def _batch(stage: str, rows: int, width: int, objective: Any) -> Any:
    """The abstract batch `objective` trains on for `stage`, of these shapes."""
    from dew_lib.objectives.batch import PackedBatch

    ids, floats = jax.ShapeDtypeStruct((rows, width), np.int32), jax.ShapeDtypeStruct((rows, width), np.float32)
    if stage == "sft":  # chat data's roles where the loss counts one role's targets only
        roles = {"text_roles": ids} if getattr(objective, "loss_role", None) is not None else {}
        return {"text": ids, "text_segment_ids": ids, **roles}
    if stage == "dpo":
        pair = jax.ShapeDtypeStruct((rows, 2, width), np.int32)
        return {"input_ids": pair, "completion_mask": pair}
    if stage == "distill":  # DistillRollout's packed rows, with one on_policy flag per row
        packed_ids = ("input_ids", "text_segment_ids", "text_positions", "response_mask", "session_index")
        served = {"teacher_log_probs": floats} if getattr(objective, "remote", False) else {}  # a remote teacher's
        return {**dict.fromkeys(packed_ids, ids), "session_weights": floats,
                "on_policy": jax.ShapeDtypeStruct((rows,), np.int32), **served}
    packed = dict(input_ids=ids, text_segment_ids=ids, text_positions=ids, response_mask=ids,
                  behavior_log_probs=floats, advantages=floats, session_index=ids, versions=ids,
                  call_index=ids, rewards=floats, session_weights=floats, old_log_probs=floats)
    if stage == "ppo":
        packed.update(old_values=floats, returns=floats)
    return PackedBatch(**packed, proximal="recorded")


def _advice(plan: MemoryPlan, remat: bool, dtype: str, accumulate: int) -> tuple[str, ...]:
    """What would bring a plan that does not fit under the device's memory."""
    if plan.fits is not False:
        return ()
    over = plan.total - (plan.device_bytes or 0)
    lines = [f"{over / GB:.1f} GB over. The state ({plan.state / GB:.1f} GB) shrinks with the mesh's fsdp "
             f"(now {plan.mesh['fsdp']}): twice the fsdp halves it, on twice the devices or fewer data replicas"]
    if not remat:
        lines.append(f"remat recomputes each layer's activations in the backward pass instead of keeping "
                     f"them (the temporary peak is {plan.temporary / GB:.1f} GB now)")
    micro = plan.rows // accumulate
    if micro > plan.mesh["data"] * plan.mesh["fsdp"] * plan.mesh.get("expert", 1):
        lines.append(f"a smaller micro-batch: accumulate={accumulate * 2} keeps half of the {micro} rows' "
                     "activations at once")
    if dtype != "bfloat16":
        lines.append("dtype bfloat16 halves the parameters, moments and reference")
    return tuple(lines)


__all__ = ["DEVICE_BYTES", "MODELS", "STAGES", "MemoryPlan", "MeshChoice", "device_bytes", "device_limit",
           "measure", "model_config", "plan", "suggest"]
