"""The rectified-flow process, its stochastic sampler and the transition densities Flow-GRPO needs.

Time runs from 1 (pure noise) to 0 (data): `x_t = (1 - t) x_0 + t noise`, and the velocity is
`noise - x_0`, so an Euler step `x + v (t_next - t)` with `t_next < t` moves toward the data.

`FlowSDE` turns the deterministic flow into a stochastic one with the same marginals (the
Flow-GRPO paper, arXiv:2505.05470, section 4): a transition from `t` to `t_next` is Gaussian with

    sigma   = noise_level * sqrt(t / (1 - t))        (at t = 1, the 1 - t uses 1 - t_next)
    mean    = x (1 + sigma^2 dt / (2 t)) + v (1 + sigma^2 (1 - t) / (2 t)) dt,   dt = t_next - t
    std     = sigma * sqrt(-dt)

Its log density is summed over coordinates (a joint density); losses divide by the coordinate
count themselves. Transitions outside the SDE's window are plain Euler steps: they have no
density, carry log density 0 and are marked not stochastic.

Not here: other schedules (variance-preserving diffusion), higher-order solvers, SDE samplers
other than the Flow-GRPO one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.options import choice

PREDICTIONS = ("velocity", "noise", "data")
# Denominators of noise/data -> velocity conversions never drop below this (t = 0 or t = 1).
_CONVERSION_FLOOR = 1e-4


def _expand(t: jax.Array, like: jax.Array) -> jax.Array:
    """Broadcast a per-row time `[N]` (or a scalar) against `[N, ...]`."""
    t = jnp.asarray(t, like.dtype)
    if t.ndim == 0:
        return t
    return t.reshape(t.shape + (1,) * (like.ndim - t.ndim))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Process:
    """A rectified-flow process.

    prediction: what the model outputs: "velocity" (`noise - x_0`), "noise" or "data" (`x_0`).
    shift: time shift of the sampling grid, `t -> shift t / (1 + (shift - 1) t)` (SD3 uses 3);
    values above 1 spend more steps at high noise.
    """

    prediction: str = "velocity"
    shift: float = 1.0

    def __post_init__(self):
        choice("Process.prediction", self.prediction, PREDICTIONS)
        if not self.shift > 0:
            raise ValueError(f"Process.shift must be positive, got {self.shift}")

    def times(self, steps: int) -> np.ndarray:
        """`steps` time points from 1 to 0, both ends included (`steps - 1` transitions).

        Computed on the host in float64 and rounded once to float32, so every caller (rollout,
        rescoring, parity fixtures) sees bit-identical times.
        """
        if steps < 2:
            raise ValueError(f"steps counts time points including both ends and must be >= 2, got {steps}")
        t = np.linspace(1.0, 0.0, steps, dtype=np.float64)
        if self.shift != 1.0:
            t = self.shift * t / (1.0 + (self.shift - 1.0) * t)
        return t.astype(np.float32)

    def interpolate(self, data: jax.Array, noise: jax.Array, t: jax.Array) -> jax.Array:
        """`x_t = (1 - t) data + t noise`, with `t` of shape `[N]`."""
        t = _expand(t, data)
        return (1.0 - t) * data + t * noise

    def target(self, data: jax.Array, noise: jax.Array) -> jax.Array:
        """What the model should output for this pair, per `prediction`."""
        if self.prediction == "velocity":
            return noise - data
        return noise if self.prediction == "noise" else data

    def velocity(self, output: jax.Array, x: jax.Array, t: jax.Array) -> jax.Array:
        """The velocity a model output stands for at `(x, t)`."""
        if self.prediction == "velocity":
            return output
        t = _expand(t, x)
        if self.prediction == "noise":  # x_0 = (x - t eps) / (1 - t), v = (eps - x) / (1 - t)
            return (output - x) / jnp.maximum(1.0 - t, _CONVERSION_FLOOR)
        return (x - output) / jnp.maximum(t, _CONVERSION_FLOOR)  # data prediction


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowSDE:
    """The stochastic sampler Flow-GRPO explores with.

    noise_level: the `a` in `sigma = a sqrt(t / (1 - t))` (0.7 in the released configs); 0 makes
    every transition deterministic.
    window: `(low, high)`; a transition is stochastic when its start time t has low < t <= high.
    The default makes every transition stochastic; `(0.5, 1.0)` explores only at high noise.
    """

    noise_level: float = 0.7
    window: tuple[float, float] = (0.0, 1.0)

    def __post_init__(self):
        if not self.noise_level >= 0 or not math.isfinite(self.noise_level):
            raise ValueError(f"FlowSDE.noise_level must be a finite number >= 0, got {self.noise_level}")
        low, high = self.window
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"FlowSDE.window must be (low, high) with 0 <= low < high <= 1, got {self.window}")
        object.__setattr__(self, "window", (float(low), float(high)))

    def stochastic(self, t: jax.Array) -> jax.Array:
        """Whether a transition starting at `t` is stochastic."""
        low, high = self.window
        return (t > low) & (t <= high) & (self.noise_level > 0)

    def transition(self, x: jax.Array, v: jax.Array, t: jax.Array, t_next: jax.Array):
        """`(mean, std)` of `x_next` given `x`, the velocity `v` and times `[N]`."""
        return sde_transition(x, v, t, t_next, self.noise_level)


def sde_transition(x, v, t, t_next, noise_level):
    """Gaussian transition `(mean, std)` of the Flow-GRPO SDE; see the module docstring."""
    t, t_next = _expand(t, x), _expand(t_next, x)
    dt = t_next - t
    at_one = t >= 1.0
    safe_t = jnp.where(t > 0, t, 1.0)
    sigma = noise_level * jnp.sqrt(safe_t / (1.0 - jnp.where(at_one, t_next, t)))
    mean = x * (1.0 + sigma**2 / (2.0 * safe_t) * dt) + v * (1.0 + sigma**2 * (1.0 - t) / (2.0 * safe_t)) * dt
    std = sigma * jnp.sqrt(jnp.maximum(-dt, 0.0))
    return mean, std


def gaussian_log_density(x: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
    """Joint log density of `x` under independent Gaussians, summed over all but the first axis."""
    z = (x - mean) / std
    per = -0.5 * z**2 - jnp.log(std) - 0.5 * math.log(2.0 * math.pi)
    return per.reshape(per.shape[0], -1).sum(axis=1)


def transition_kl(mean: jax.Array, reference_mean: jax.Array, std: jax.Array) -> jax.Array:
    """Per-coordinate KL between two Gaussian transitions sharing `std`, averaged per row `[N]`.

    The variance is the transition's own (elapsed time included); the released SD3 script's
    regularizer equals this value times the elapsed time `-dt`.
    """
    per = (mean - reference_mean) ** 2 / (2.0 * std**2)
    return per.reshape(per.shape[0], -1).mean(axis=1)


@dataclasses.dataclass(frozen=True)
class CFG:
    """Classifier-free guidance: `v = v_uncond + scale (v_cond - v_uncond)`; the unconditional
    branch sees an all-zero condition."""

    scale: float = 3.0

    def __post_init__(self):
        if not math.isfinite(self.scale):
            raise ValueError(f"CFG.scale must be finite, got {self.scale}")


class Solver(Protocol):
    """A deterministic ODE step from `t` to `t_next` for a velocity function."""

    def step(self, velocity: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array,
             t: jax.Array, t_next: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class Euler:
    """First-order ODE step: `x + v(x, t) (t_next - t)`."""

    def step(self, velocity, x, t, t_next):
        return x + velocity(x, t) * _expand(t_next - t, x)


class FlowTrajectory(NamedTuple):
    """A sampled path: `states [N, T, ...]` from noise to sample at `times [T]`.

    log_probs `[N, T - 1]`: joint log density of each transition (0 where deterministic).
    stochastic `[N, T - 1]`: which transitions are Gaussian and may enter a policy loss.
    """

    states: jax.Array
    times: jax.Array
    log_probs: jax.Array
    stochastic: jax.Array

    @property
    def final(self) -> jax.Array:
        return self.states[:, -1]


def sample_trajectory(velocity: Callable[[jax.Array, jax.Array], jax.Array], noise: jax.Array,
                      times: jax.Array, key: jax.Array, *, sde: FlowSDE | None = None,
                      solver: Solver = Euler()) -> FlowTrajectory:
    """Integrate from `noise` at `times[0]` to `times[-1]` in one `lax.scan`.

    velocity: `(x [N, ...], t [N]) -> v`. With `sde`, each transition inside its window draws a
    Gaussian step and records its joint log density; the others (and every transition without an
    `sde`) take a `solver` step. Jit-friendly: shapes are fixed by `noise` and `times`.
    """
    rows = noise.shape[0]
    times = jnp.asarray(times, jnp.float32)
    keys = jax.random.split(key, times.shape[0] - 1)

    def transition(x, inputs):
        t, t_next, step_key = inputs
        t_rows, next_rows = jnp.full((rows,), t), jnp.full((rows,), t_next)
        if sde is None:
            return solver.step(velocity, x, t_rows, next_rows), (x, jnp.zeros((rows,)), jnp.zeros((rows,), bool))
        v = velocity(x, t_rows)
        mean, std = sde.transition(x, v, t_rows, next_rows)
        marked = sde.stochastic(t)
        safe_std = jnp.where(marked & (std > 0), std, 1.0)
        drawn = mean + safe_std * jax.random.normal(step_key, x.shape, x.dtype)
        log_prob = gaussian_log_density(drawn, mean, safe_std)
        euler = x + v * _expand(next_rows - t_rows, x)
        x_next = jnp.where(marked, drawn, euler)
        return x_next, (x, jnp.where(marked, log_prob, 0.0), jnp.full((rows,), marked))

    final, (states, log_probs, marks) = jax.lax.scan(transition, noise, (times[:-1], times[1:], keys))
    states = jnp.concatenate([states, final[None]], axis=0)  # [T, N, ...]
    return FlowTrajectory(jnp.moveaxis(states, 0, 1), times, log_probs.T, marks.T)
