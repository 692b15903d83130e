"""Trainer: one compiled update per batch shape, data parallel, with exact resume.

The fit loop reads a batch on the host, lets the optional rollout turn it into the batch to
train on, shards it across local devices and dispatches the compiled step. Metrics stay on the
device and are read a window later, so the host never waits for the step it just launched.

`step` counts batches consumed and `updates` optimizer updates; with `accumulate=k` an update
happens every k steps and the gradient sum in between lives in the state, so a checkpoint taken
inside an accumulation window resumes bit for bit.

The devices form a named mesh (mesh.py): by default every device is a `data` replica holding
the whole state; `MeshSpec(fsdp=..., tensor=...)` splits the parameters, optimizer moments, the
EMA/reference copy and the gradient sum as their modules declare (models/partitioning.py), and
the compiled step is partitioned by XLA around those layouts (`expert` splits a mixture of
experts' experts, models/moe.py). Batches are split over `data` x `fsdp` x `expert`.

In a multi-process job (distributed.py) the mesh spans every process's devices, each process
reads its own partition of the data and places its rows with the others', and only process 0
writes to the sinks: the metrics are the same everywhere.

Not here: pipeline parallelism, learning-rate schedules (use optax's).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew_lib.data.dataset import Batch, Dataset, Partition
from dew_lib.models import lora, partitioning
from dew_lib.objectives.base import Metrics, Objective, average
from dew_lib.train import distributed, trainable
from dew_lib.train.checkpoint import CheckpointMismatch, Checkpoints
from dew_lib.train.mesh import MeshSpec, batch_shards
from dew_lib.train.sinks import Sink, check_sinks, default_sinks

_LOG = logging.getLogger(__name__)

Rollout = Callable[["TrainState", Batch, jax.Array], Batch]


@flax.struct.dataclass
class TrainState:
    """Everything that changes during training; a pytree.

    params: the full Flax variables mapping being optimized. Only the leaves
    `objective.trainable` marks are trained (the low-rank adapters of models/lora.py alone, when
    the params hold any): the optimizer state and a gradient sum cover those, and the rest stays
    as it started (trainable.py).
    ema: the moving average of params (a frozen reference when the decay is 1), or None; of
    `objective.reference_params(params)` only when the objective names a part (PPO: the policy).
    None for the frozen reference of a part that trains its adapters alone: its base (adapters off).
    step: batches consumed. updates: optimizer updates applied.
    grads, grad_weight: the gradient sum and loss weight of an open accumulation window
    (None when accumulate == 1).
    """

    params: Any
    opt_state: Any
    ema: Any
    step: jax.Array
    updates: jax.Array
    grads: Any = None
    grad_weight: Any = None


class TrainingDiverged(FloatingPointError):
    """The loss became NaN or infinite; carries the step and the last finite metrics."""

    def __init__(self, step: int, last_metrics: Mapping[str, float], checkpoint: str | None):
        self.step, self.last_metrics, self.checkpoint = step, dict(last_metrics), checkpoint
        kept = f"the last good checkpoint is kept at {checkpoint}" if checkpoint else "no checkpoint was written"
        super().__init__(
            f"the loss became non-finite at step {step}; last finite metrics: "
            f"{ {k: round(v, 6) for k, v in self.last_metrics.items()} }; {kept}. Lower the "
            "learning rate, clip gradients (optax.clip_by_global_norm) or inspect that batch"
        )


def _replicated(mesh):
    return NamedSharding(mesh, PartitionSpec())


class Trainer:
    """Optimizes `objective` with an optax `optimizer`.

    key: seeds initialization, per-step randomness (folded with the step) and rollouts.
    rollout: `(state, batch, key) -> batch`, called on the host before each compiled update.
    accumulate: batches per optimizer update.
    devices: the devices to train on; defaults to every device.
    mesh: how they are arranged (default: all on `data`, the state replicated on each).
    """

    def __init__(self, objective: Objective, optimizer: optax.GradientTransformation, *,
                 key: jax.Array, rollout: Rollout | None = None, accumulate: int = 1,
                 devices: Sequence[jax.Device] | None = None, mesh: MeshSpec | None = None):
        if accumulate < 1:
            raise ValueError(f"Trainer.accumulate must be >= 1, got {accumulate}")
        if not isinstance(objective, Objective):
            raise TypeError(f"Trainer needs a dew_lib.objectives.Objective, got {type(objective).__name__}: "
                            "subclass Objective, which declares init, terms, evaluate and check_batch and the "
                            "optional hooks the Trainer calls (ema_decay, reference_params, trainable, "
                            "derive, derive_training)")
        if jax.process_count() > 1 and devices is not None:
            raise ValueError("Trainer(devices=...) is for single-process runs; multi-process "
                             "training uses every device of every process")
        self.objective = objective
        self.optimizer = optimizer
        self.rollout = rollout
        self.accumulate = accumulate
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key) if key.shape == (2,) else key
        self.init_key, self.step_key, self.rollout_key = jax.random.split(key, 3)
        self.mesh: Mesh = (mesh or MeshSpec()).build(devices)
        self.compilations: dict[str, int] = {"init": 0, "train_step": 0, "eval_step": 0}
        # `objective.init` under one jit: its shapes here and the init program below share one trace
        self._init_params = jax.jit(self.objective.init)
        shapes = jax.eval_shape(self._init_params, self.init_key)
        # which leaves train (by default the low-rank adapters alone, when there are any)
        self.trainable_marks = trainable.marks(objective, shapes)
        self.partial = not all(jax.tree.leaves(self.trainable_marks))
        self.reference_is_base = trainable.reference_is_base(objective, shapes, self.trainable_marks)
        # The state's shapes, from the parameters' without tracing `objective.init` again (seconds
        # for a decoder of many layers, whose init traces each layer).
        self._abstract = jax.eval_shape(self._state_from, shapes)
        self.state_sharding = self._state_sharding()
        self._init = jax.jit(self._count("init", self._build_state), out_shardings=self.state_sharding)
        self._steps = {
            apply: jax.jit(self._make_step(apply), donate_argnums=0,
                           out_shardings=(self.state_sharding, _replicated(self.mesh)))
            for apply in (True, False)
        }
        self._eval = jax.jit(self._eval_step, out_shardings=_replicated(self.mesh))

    def _count(self, name: str, function):
        """`function`, counting its traces under `name` (one per compiled shape)."""

        def counted(*args):
            self.compilations[name] += 1
            return function(*args)

        return counted

    # ----- state -------------------------------------------------------------------------------
    def _state_sharding(self) -> Any:
        """Where each part of the state lives: one replicated sharding for a data-only mesh, else
        a TrainState of shardings from the declared logical axes (undeclared parameters are
        refused, since they could not be split)."""
        if not partitioning.splits_parameters(self.mesh):
            return _replicated(self.mesh)
        partitioning.tree_specs(self._abstract.params, self.mesh, required=True)
        return partitioning.tree_shardings(self._abstract, self.mesh, what="state leaf")

    def _build_state(self, key) -> TrainState:
        return self._state_from(self._init_params(key))

    def _state_from(self, params) -> TrainState:
        """The starting state around the objective's initial `params`."""
        trained = self._split(params)[0]
        accumulating = self.accumulate > 1
        zeros = jax.tree.map(jnp.zeros_like, trained) if accumulating else None
        return TrainState(
            params=params,
            opt_state=self.optimizer.init(trained),
            ema=(jax.tree.map(jnp.copy, self.objective.reference_params(params)) if self._keeps_ema else None),
            step=jnp.zeros((), jnp.int32),
            updates=jnp.zeros((), jnp.int32),
            grads=zeros,
            grad_weight=jnp.zeros((), jnp.float32) if accumulating else None,
        )

    def initial_state(self) -> TrainState:
        """The starting state: the one `fit` starts from, by the same compiled program."""
        return self._init(self.init_key)

    def abstract_state(self) -> TrainState:
        """The state's shapes, dtypes and shardings on this mesh, computing nothing: what a
        checkpoint restores into, whatever mesh wrote it."""
        shardings = self.state_sharding
        if isinstance(shardings, NamedSharding):
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings), self._abstract)
        return jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                            self._abstract, shardings)

    @property
    def _keeps_ema(self) -> bool:
        """Whether the state holds a moving average: not for a frozen reference that is the
        reference part's base with its adapters off (no copy)."""
        return self.objective.ema_decay is not None and not self.reference_is_base

    def _split(self, params) -> tuple[Any, Any]:
        """(what the optimizer trains, what stays frozen): the leaves `objective.trainable`
        marks and the others, or all of them and nothing when it marks every leaf."""
        return trainable.split(params, self.trainable_marks) if self.partial else (params, None)

    # ----- compiled update ---------------------------------------------------------------------
    def _make_step(self, apply: bool):
        objective, optimizer, accumulate = self.objective, self.optimizer, self.accumulate
        decay, partial, reference_is_base = objective.ema_decay, self.partial, self.reference_is_base

        def total_and_aux(trained, frozen, batch, step, reference, key):
            params = lora.merge(trained, frozen) if partial else trained
            terms = objective.terms(params, batch, step=step, reference=reference, key=key)
            return terms.total, (terms.weight, terms.metrics)

        grad_fn = jax.value_and_grad(total_and_aux, has_aux=True)  # of the trained part only

        def step_fn(state: TrainState, batch):
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # the model's row splits
                return split_step(state, batch)

        def split_step(state: TrainState, batch):
            self.compilations["train_step"] += 1
            key = jax.random.fold_in(self.step_key, state.step)
            trained, frozen = self._split(state.params)
            reference = state.ema
            if reference_is_base:
                reference = lora.without_adapters(objective.reference_params(state.params))
            (total, (weight, metrics)), grads = grad_fn(
                trained, frozen, batch, state.updates, reference, key
            )
            metrics = dict(metrics)
            metrics["finite"] = (jnp.isfinite(total).astype(jnp.float32), jnp.ones(()))
            if accumulate > 1:
                grads = jax.tree.map(jnp.add, state.grads, grads)
                weight = state.grad_weight + weight
            if not apply:
                return state.replace(step=state.step + 1, grads=grads, grad_weight=weight), metrics
            scale = 1.0 / jnp.maximum(weight, 1e-12)
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
            metrics["grad_norm"] = (optax.tree.norm(grads), jnp.ones(()))
            updates, opt_state = optimizer.update(grads, state.opt_state, trained)
            trained = optax.apply_updates(trained, updates)
            params = lora.merge(trained, frozen) if partial else trained
            ema = state.ema
            if ema is not None and decay is not None and decay != 1.0:
                ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema,
                                   objective.reference_params(params))
            new = state.replace(
                params=params, opt_state=opt_state, ema=ema,
                step=state.step + 1, updates=state.updates + 1,
            )
            if accumulate > 1:
                new = new.replace(
                    grads=jax.tree.map(jnp.zeros_like, grads), grad_weight=jnp.zeros_like(weight)
                )
            return new, metrics

        return step_fn

    def _eval_step(self, params, batch) -> Metrics:
        self.compilations["eval_step"] += 1
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            return self.objective.evaluate(params, batch)

    # ----- data placement ----------------------------------------------------------------------
    def _shard(self, batch: Batch) -> Batch:
        """Split every field's leading axis over the mesh's `data` x `fsdp` x `expert`; refuse what
        does not divide. The batch keeps its type (a dict, or a typed pytree such as PackedBatch)."""
        local = max(1, batch_shards(self.mesh) // jax.process_count())
        rows = NamedSharding(self.mesh, PartitionSpec(partitioning.BATCH_AXES))

        def place(name, value):
            value = np.asarray(value)
            if value.ndim == 0:
                return jax.device_put(value, _replicated(self.mesh))
            if value.shape[0] % local:
                raise ValueError(
                    f"batch field {name!r} has {value.shape[0]} rows, which do not divide into this "
                    f"process's {local} slices of the batch (the mesh's data x fsdp x expert); make the batch "
                    f"size a multiple of {local} (or pass Trainer(devices=...) or a smaller mesh)"
                )
            if jax.process_count() == 1:
                return jax.device_put(value, rows)
            return jax.make_array_from_process_local_data(rows, value)

        return jax.tree_util.tree_map_with_path(lambda path, v: place(_field(path), v), batch)

    # ----- the loop ----------------------------------------------------------------------------
    def fit(self, data: Dataset, *, steps: int, log_every: int = 100, eval_every: int | None = None,
            directory: str | None = None, checkpoint_every: int | None = None, keep: int = 2,
            sinks: Sequence[Sink] | None = None, state: TrainState | None = None) -> TrainState:
        """Train until `steps` batches have been consumed and return the final state.

        directory: where checkpoints live; if it already holds one, training continues from it.
        checkpoint_every: save every this many steps (and always at the end) when a directory
        is given. sinks: metric consumers (default: a progress bar on a terminal); in a
        multi-process job only process 0's are written to, the others' are closed.
        state: start from this state instead of a fresh one (ignored when resuming).
        """
        if steps < 0:
            raise ValueError(f"fit(steps=...) must be >= 0, got {steps}")
        if log_every < 1:
            raise ValueError(f"fit(log_every=...) must be >= 1, got {log_every}")
        if eval_every is not None and (eval_every < 1 or data.val is None):
            raise ValueError("fit(eval_every=...) needs a positive interval and a Dataset with val")
        sinks = check_sinks(default_sinks() if sinks is None else sinks)
        if not distributed.is_primary():  # every process has the same metrics; process 0 writes them
            for sink in sinks:
                sink.close()
            sinks = []
        store = Checkpoints(directory, keep=keep) if directory is not None else None
        run = _Run(self, data, steps, log_every, eval_every, store, checkpoint_every, sinks)
        try:
            return run.execute(state)
        finally:
            for sink in sinks:
                sink.close()
            if store is not None:
                store.close()


@dataclasses.dataclass
class _Window:
    """Device-side metrics of consecutive steps, read back together."""

    steps: list[int] = dataclasses.field(default_factory=list)
    metrics: list[Metrics] = dataclasses.field(default_factory=list)


class _Run:
    """The state of one `fit` call: stream, pending metric windows, checkpoints."""

    def __init__(self, trainer, data, steps, log_every, eval_every, store, checkpoint_every, sinks):
        self.trainer, self.data, self.steps = trainer, data, steps
        self.log_every, self.eval_every = log_every, eval_every
        self.store, self.checkpoint_every, self.sinks = store, checkpoint_every, sinks
        self.partition = Partition.current()
        self.open = _Window()
        self.closed: list[_Window] = []
        self.last_metrics: dict[str, float] = {}
        self.last_checkpoint: str | None = None
        self.checked_shapes: set = set()
        self.clock = time.perf_counter()  # when the previous window was known to be finished

    def _start_state(self, state):
        trainer = self.trainer
        if self.store is not None and (latest := self.store.latest()) is not None:
            restored, info = self.store.restore(latest, trainer.abstract_state())
            if info.get("accumulate", 1) != trainer.accumulate:
                raise CheckpointMismatch(
                    f"the checkpoint at step {latest} was written with accumulate="
                    f"{info.get('accumulate')} but this Trainer has accumulate={trainer.accumulate}"
                )
            self.last_checkpoint = f"{self.store.directory}/{latest}"
            streams = info.get("streams")  # one per process, when the stream could say where it was
            stream_state = None
            if streams is not None and len(streams) == self.partition.count:
                stream_state = streams[self.partition.index]
            return restored, int(info["position"]), stream_state
        if state is None:
            return None, 0, None  # built by execute once the first batch has been checked
        return state, int(state.step), None

    def _note(self, step: int, text: str) -> None:
        """Tell the sinks and the log what fit is doing."""
        _LOG.info("step %d: %s", step, text)
        for sink in self.sinks:
            sink.note(step, text)

    def execute(self, state):
        trainer = self.trainer
        state, position, stream_state = self._start_state(state)
        for sink in self.sinks:
            sink.begin(position, self.steps)
        if position >= self.steps:
            if self.last_checkpoint is not None:
                self._note(position, f"nothing to train: the checkpoint {self.last_checkpoint} is "
                                     f"already at step {position} of steps={self.steps}; returning "
                                     "its state (raise steps to train further, or use a new directory)")
            else:
                self._note(position, f"nothing to train: steps={self.steps} and the state is at step "
                                     f"{position}; returning it unchanged")
            return trainer._init(trainer.init_key) if state is None else state
        if self.last_checkpoint is not None:
            self._note(position, f"resuming from the checkpoint {self.last_checkpoint}: steps "
                                 f"{position + 1}..{self.steps} remain")
        stream = self.data.stream(self.partition, position, stream_state)
        first = self._next(stream, position)
        if trainer.rollout is None:
            self._check(first)  # a batch this objective cannot read fails before anything compiles
        if state is None:
            state = trainer._init(trainer.init_key)
        for step in range(position, self.steps):
            batch, first = (first, None) if first is not None else (self._next(stream, step), None)
            for sink in self.sinks:
                sink.before_step(step, state)
            if trainer.rollout is not None:
                batch = trainer.rollout(state, batch, jax.random.fold_in(trainer.rollout_key, step))
            self._check(batch)
            apply = (step + 1) % trainer.accumulate == 0
            state, metrics = trainer._steps[apply](state, trainer._shard(batch))
            done = step + 1
            self._deliver()  # windows closed before this step: read while it runs
            self.open.steps.append(done)
            self.open.metrics.append(metrics)
            if done % self.log_every == 0 or done == self.steps:
                self.closed.append(self.open)
                self.open = _Window()
            if self.eval_every and done % self.eval_every == 0:
                self._deliver(include_open=True)
                self._evaluate(state, done)
                self.clock = time.perf_counter()  # evaluation time is not training throughput
            if self.store is not None and (
                done == self.steps or (self.checkpoint_every and done % self.checkpoint_every == 0)
            ):
                self._deliver(include_open=True)  # a diverged step must never be checkpointed
                info = {"position": done, "accumulate": trainer.accumulate}
                if hasattr(stream, "state"):
                    info["streams"] = distributed.every_process(stream.state())
                self.store.save(done, state, info)
                self.last_checkpoint = f"{self.store.directory}/{done}"
                for sink in self.sinks:  # e.g. the run store records where the checkpoint is
                    sink.checkpoint(done, self.last_checkpoint)
                self.clock = time.perf_counter()
        self._deliver(include_open=True)
        return state

    def _next(self, stream: Iterator[Batch], step: int) -> Batch:
        try:
            return next(stream)
        except StopIteration:
            raise ValueError(
                f"the training stream ended after {step} batches, before steps={self.steps}; "
                "make Dataset.train repeat (e.g. itertools.cycle) or lower steps"
            ) from None

    def _check(self, batch: Batch) -> None:
        signature = (jax.tree.structure(batch),
                     tuple((k, np.shape(v), str(getattr(v, "dtype", ""))) for k, v in batch.items()))
        if signature not in self.checked_shapes:
            self.trainer.objective.check_batch(batch)
            self.checked_shapes.add(signature)

    def _deliver(self, include_open: bool = False) -> None:
        """Read back closed windows (and the open one when asked) and write them to the sinks."""
        ready, self.closed = self.closed, []
        if include_open and self.open.steps:
            ready.append(self.open)
            self.open = _Window()
        for window in ready:
            values = jax.device_get(window.metrics)  # waits for the window's last step
            now = time.perf_counter()
            seconds, self.clock = now - self.clock, now
            for step, metrics in zip(window.steps, values, strict=True):
                if metrics["finite"][0] < 1:
                    raise TrainingDiverged(step, self.last_metrics, self.last_checkpoint)
            means = average(values)
            means.pop("finite", None)
            means = self.trainer.objective.derive_training(means)  # ratios of window means
            means["steps_per_second"] = len(window.steps) / max(seconds, 1e-9)
            if "tokens" in means:
                means["tokens_per_second"] = means["tokens"] * means["steps_per_second"]
            means["compilations"] = float(self.trainer.compilations["train_step"])
            self.last_metrics = means
            for sink in self.sinks:
                sink.write(window.steps[-1], means)

    def _evaluate(self, state, step: int) -> None:
        trainer = self.trainer
        batches = []
        for batch in self.data.val(self.partition):
            self._check(batch)
            batches.append(trainer._eval(state.params, trainer._shard(batch)))
        means = trainer.objective.derive(average(jax.device_get(batches)))
        for sink in self.sinks:
            sink.write(step, {f"val/{k}": v for k, v in means.items()})


def _field(path) -> str:
    """A batch leaf's field name, for errors."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
