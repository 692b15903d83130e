"""Denoiser: a model bound to its process, inputs and autoencoder, with velocity and sampling.

Both diffusion objectives (flow-matching pre-training and Flow-GRPO) reach the model only
through this: `velocity` applies the model (with classifier-free guidance when asked) and turns
its output into a velocity; `trajectory` samples a whole path in one compiled scan; `decode`
maps final latents to images in [-1, 1].

Not here: losses (the objectives own them), host-side reward or preview handling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dew_lib.diffusion.inputs import AutoEncoder, Identity, InputSpec
from dew_lib.diffusion.process import CFG, Euler, FlowSDE, FlowTrajectory, Process, Solver, sample_trajectory


@dataclasses.dataclass(frozen=True, eq=False)
class Denoiser:
    """model: `(x, t, condition | None) -> output`; see the module docstring."""

    model: Any
    process: Process
    inputs: InputSpec
    autoencoder: AutoEncoder = dataclasses.field(default_factory=Identity)

    def __post_init__(self):
        if not isinstance(self.inputs, InputSpec):
            raise TypeError(f"inputs must be an InputSpec, got {type(self.inputs).__name__}")
        if self.autoencoder is None:
            object.__setattr__(self, "autoencoder", Identity())
        for method in ("latent_shape", "encode", "decode"):
            if not callable(getattr(self.autoencoder, method, None)):
                raise TypeError(f"autoencoder must have a {method}() method (see dew_lib.diffusion.AutoEncoder)")

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.autoencoder.latent_shape(self.inputs.image.shape))

    def init(self, key: jax.Array):
        zeros = self.inputs.zeros(1)
        condition = self.inputs.encode(zeros)
        return jax.jit(self.model.init)(key, jnp.zeros((1, *self.latent_shape), jnp.float32),
                                        jnp.zeros((1,), jnp.float32), condition)

    def velocity(self, params, x, t, condition, guidance: CFG | None = None, *, frozen_uncond=False,
                 dropout_key: jax.Array | None = None):
        """The velocity at `(x [N, ...], t [N])`; with `guidance`, mixed with the unconditional one.

        frozen_uncond: stop gradients through the unconditional branch (as the released Flow-GRPO
        trainer does when it rescores with guidance). dropout_key: given only by a training
        forward, which then drops what the model drops in training (adapter dropout).
        """
        rngs = None if dropout_key is None else {"dropout": dropout_key}
        if guidance is None or condition is None:
            return self.process.velocity(self.model.apply(params, x, t, condition, rngs=rngs), x, t)
        rows = x.shape[0]
        both = self.model.apply(params, jnp.concatenate([x, x]), jnp.concatenate([t, t]),
                                jnp.concatenate([jnp.zeros_like(condition), condition]), rngs=rngs)
        both = self.process.velocity(both, jnp.concatenate([x, x]), jnp.concatenate([t, t]))
        uncond, cond = both[:rows], both[rows:]
        if frozen_uncond:
            uncond = jax.lax.stop_gradient(uncond)
        return uncond + guidance.scale * (cond - uncond)

    def trajectory(self, params, conditions: Mapping[str, jax.Array], key: jax.Array, *, rows: int,
                   steps: int, guidance: CFG | None = None, sde: FlowSDE | None = None,
                   solver: Solver = Euler()) -> FlowTrajectory:
        """Sample `rows` paths of `steps` time points from fresh noise (jit-friendly)."""
        noise_key, path_key = jax.random.split(key)
        condition = self.inputs.encode(conditions)
        noise = jax.random.normal(noise_key, (rows, *self.latent_shape), jnp.float32)

        def velocity(x, t):
            return self.velocity(params, x, t, condition, guidance)

        return sample_trajectory(velocity, noise, self.process.times(steps), path_key, sde=sde,
                                 solver=solver)

    def decode(self, latents: jax.Array) -> jax.Array:
        """Images in [-1, 1] from final latents."""
        return jnp.clip(self.autoencoder.decode(latents), -1.0, 1.0)

    def generate(self, params, batch: Mapping[str, jax.Array], key: jax.Array, *, steps: int,
                 guidance: CFG | None, solver: Solver) -> jax.Array:
        """One deterministic sample per row of `batch` (image field optional), decoded."""
        rows = jax.tree.leaves(dict(batch))[0].shape[0]
        path = self.trajectory(params, self.inputs.condition_batch(batch), key, rows=rows,
                               steps=steps, guidance=guidance, solver=solver)
        return self.decode(path.final)


def sample_metrics(images: jax.Array):
    """`(sum, count)` pixel statistics of generated images in [-1, 1]."""
    count = jnp.asarray(images.size, jnp.float32)
    rows = jnp.asarray(images.shape[0], jnp.float32)
    flat = images.reshape(images.shape[0], -1)
    return {
        "sample_mean": (flat.sum(), count),
        "sample_std": (flat.std(axis=1).sum(), rows),
        "saturated": ((jnp.abs(flat) >= 1.0).sum().astype(jnp.float32), count),
    }
