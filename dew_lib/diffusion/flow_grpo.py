"""FlowGRPOObjective: train a rectified-flow policy on its own recorded SDE transitions.

The batch is what `FlowRollout` (flow_rollout.py) returns. `terms` rescores every recorded
transition under the live parameters. The ratio is `exp((log p_new - log p_old) / D)` with D
the coordinates of a latent (the released implementation's mean per-coordinate log
likelihood), the surrogate is PPO's clipped one with advantages clipped to `adv_clip_max`, and
with `beta > 0` each transition adds `beta` times the per-coordinate conditional Gaussian KL to
the frozen starting policy (kept in the EMA slot), whose variance includes the elapsed time. The
loss is the mean over kept stochastic transitions.

A SimpleDiT with low-rank adapters (`dit.attach`, models/dit.py) trains its adapters alone, and
the KL's frozen reference is then its base with the adapters off, not a second copy.

Not here: sampling and rewards (`FlowRollout`), multi-process rollouts, reward models that need
a GPU of their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.data.dataset import describe
from dew_lib.diffusion.denoiser import Denoiser, sample_metrics
from dew_lib.diffusion.inputs import AutoEncoder, InputSpec
from dew_lib.diffusion.preview import EVAL_KEY, Preview, sample_preview
from dew_lib.diffusion.process import CFG, Euler, FlowSDE, Process, Solver, gaussian_log_density, transition_kl
from dew_lib.objectives.base import LossTerms, Metrics, Objective
from dew_lib.objectives.base import loss as loss_view

Variables = Any

FlowReward = Callable[[np.ndarray, Mapping[str, np.ndarray]], Any]
"""`reward(images, batch) -> [N]`: images `[N, H, W, C]` float32 in [-1, 1] and the source batch
with each row repeated for its group (numpy arrays); one finite scalar per sample."""

GROUP_EPSILON = 1e-4
TRAJECTORY_FIELDS = ("latents", "next_latents")
STEP_FIELDS = ("timesteps", "next_timesteps", "old_log_probs", "transition_mask")


class FlowGRPOObjective(Objective):
    """Train a rectified-flow policy on clipped, coordinate-normalized gradients.

    sde: how rollouts explore and how transitions are rescored. beta: weight of the transition
    KL to the frozen starting policy (0: no reference is kept). clip_range: PPO clip of the
    per-coordinate ratio, below at 1 - clip_range and above at 1 + clip_range_high (None: the
    same bound; DAPO's clip-higher makes it wider). adv_clip_max: advantages are clipped to
    +-this. guidance: CFG used in rollouts and rescoring (needs a condition field). sampler,
    steps: deterministic sampling for `evaluate` and `preview`. pretrained: starting variables
    as returned by model.init (or `dit.attach`'s, to train adapters).
    """

    def __init__(self, model, process: Process, inputs: InputSpec, *, sde: FlowSDE = FlowSDE(),
                 beta: float = 0.0, clip_range: float = 0.0001, clip_range_high: float | None = None,
                 adv_clip_max: float = 5.0,
                 autoencoder: AutoEncoder | None = None, guidance: CFG | None = CFG(3.0),
                 sampler: Solver = Euler(), steps: int = 41, pretrained: Variables | None = None):
        if not isinstance(process, Process):
            raise TypeError(f"process must be a Process (e.g. presets.Flow()()), got "
                            f"{type(process).__name__}")
        if process.prediction != "velocity":
            raise ValueError(
                f"FlowGRPOObjective needs a rectified-flow Process with velocity prediction, got "
                f"prediction={process.prediction!r}; build it with presets.Flow()() and a model "
                "trained to predict velocity"
            )
        if not isinstance(sde, FlowSDE):
            raise TypeError(f"sde must be a FlowSDE, got {type(sde).__name__}")
        if not (beta >= 0 and math.isfinite(beta)):
            raise ValueError(f"FlowGRPOObjective.beta must be a finite number >= 0, got {beta}")
        if not 0 < clip_range < 1:
            raise ValueError(f"FlowGRPOObjective.clip_range must be in (0, 1), got {clip_range}")
        if clip_range_high is not None and not clip_range_high > 0:
            raise ValueError(f"FlowGRPOObjective.clip_range_high must be > 0 (or None: clip_range), "
                             f"got {clip_range_high}")
        if not adv_clip_max > 0:
            raise ValueError(f"FlowGRPOObjective.adv_clip_max must be > 0, got {adv_clip_max}")
        if steps < 2:
            raise ValueError(f"FlowGRPOObjective.steps counts time points and must be >= 2, got {steps}")
        if guidance is not None and not inputs.conditioned:
            raise ValueError(
                f"FlowGRPOObjective(guidance={guidance}) needs a condition field in the InputSpec; "
                "pass guidance=None for an unconditioned model"
            )
        if pretrained is not None and "params" not in pretrained:
            raise ValueError("FlowGRPOObjective.pretrained must be a variables dict as returned by "
                             "model.init, with its outer 'params' collection")
        self.denoiser = Denoiser(model, process, inputs, autoencoder)
        self.model, self.process, self.inputs = model, process, inputs
        self.sde, self.beta, self.clip_range, self.adv_clip_max = sde, float(beta), clip_range, adv_clip_max
        self.clip_range_high = clip_range if clip_range_high is None else clip_range_high
        self.autoencoder = self.denoiser.autoencoder
        self.guidance, self.sampler, self.steps = guidance, sampler, steps
        self.pretrained = pretrained
        self.ema_decay = 1.0 if self.beta > 0 else None  # the EMA slot holds the frozen reference
        self._generate: dict[tuple, Callable] = {}  # preview.py's compiled samplers, by signature

    # ----- variables -----------------------------------------------------------------------
    def init(self, key: jax.Array, variables: Variables | None = None) -> Variables:
        if variables is not None:
            return variables
        if self.pretrained is not None:
            return self.held_variables()
        return self.denoiser.init(key)

    def held_variables(self) -> Variables:
        """The starting denoiser this objective was given (`pretrained`), as device arrays."""
        if self.pretrained is None:
            raise ValueError("this FlowGRPOObjective holds no variables: it was built without "
                             "pretrained=...; init(key) draws fresh ones")
        return jax.tree.map(jnp.asarray, self.pretrained)

    # ----- batches -------------------------------------------------------------------------
    @property
    def coordinates(self) -> int:
        return math.prod(self.denoiser.latent_shape)

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse, on the host, a training batch (rollout layout) or source batch that does not fit."""
        if "latents" not in batch:
            self.inputs.check(batch)  # a source batch (evaluation or preview)
            return
        missing = [k for k in (*TRAJECTORY_FIELDS, *STEP_FIELDS, "advantages") if k not in batch]
        if missing:
            raise KeyError(f"a Flow-GRPO batch needs {missing} (FlowRollout makes them); it has "
                           f"{describe(batch)}")
        latent = self.denoiser.latent_shape
        shape = tuple(np.shape(batch["latents"]))
        if len(shape) != 2 + len(latent) or shape[2:] != latent:
            raise ValueError(f"batch field 'latents' has shape {shape}, expected [N, K, *{latent}]")
        rows, k = shape[:2]
        for name in TRAJECTORY_FIELDS:
            if tuple(np.shape(batch[name])) != shape:
                raise ValueError(f"batch field {name!r} has shape {np.shape(batch[name])}, expected {shape}")
        for name in STEP_FIELDS:
            if tuple(np.shape(batch[name])) != (rows, k):
                raise ValueError(f"batch field {name!r} has shape {np.shape(batch[name])}, expected "
                                 f"[N, K] = {(rows, k)}")
        if tuple(np.shape(batch["advantages"])) not in ((rows,), (rows, k)):
            raise ValueError(f"batch field 'advantages' has shape {np.shape(batch['advantages'])}, "
                             f"expected [N] = {(rows,)} or [N, K] = {(rows, k)}")
        if "rewards" in batch and tuple(np.shape(batch["rewards"])) != (rows,):
            raise ValueError(f"batch field 'rewards' has shape {np.shape(batch['rewards'])}, "
                             f"expected {(rows,)}")
        for c in self.inputs.conditions:
            if c.name not in batch or tuple(np.shape(batch[c.name])) != (rows, *c.shape):
                got = np.shape(batch[c.name]) if c.name in batch else "nothing"
                raise ValueError(f"condition field {c.name!r} must be [N, *{c.shape}] = "
                                 f"{(rows, *c.shape)}, got {got}")

    # ----- the loss ------------------------------------------------------------------------
    def _transitions(self, params, batch, reference, key=None):
        """Per-transition terms `[K, N]`: surrogate, KL, kept, clipped, ratio, log-ratio per coordinate.
        key: the training forward's (adapter dropout), folded with each transition's index; the
        reference's velocity never drops."""
        condition = self.inputs.encode(batch)
        advantages = jnp.broadcast_to(
            batch["advantages"].reshape(batch["advantages"].shape[0], -1), batch["timesteps"].shape)

        def time_major(name):
            return jnp.moveaxis(jnp.asarray(batch[name]), 1, 0)

        xs = (time_major("latents"), time_major("next_latents"), time_major("timesteps"),
              time_major("next_timesteps"), time_major("old_log_probs"),
              time_major("transition_mask"), advantages.T, jnp.arange(advantages.shape[1]))
        coordinates = self.coordinates
        kl_needed = self.beta > 0

        def one(_, x):  # nothing carried: each transition stands alone
            latents, next_latents, t, t_next, old, mask, advantage, index = x
            dropout = None if key is None else jax.random.fold_in(key, index)
            v = self.denoiser.velocity(params, latents, t, condition, self.guidance, frozen_uncond=True,
                                       dropout_key=dropout)
            mean, std = self.sde.transition(latents, v, t, t_next)
            std_row = std.reshape(std.shape[0], -1)[:, 0]
            kept = mask.astype(bool) & self.sde.stochastic(t) & (std_row > 0)
            safe_std = jnp.where(kept.reshape(std.shape[:1] + (1,) * (std.ndim - 1)), std, 1.0)
            log_ratio = (gaussian_log_density(next_latents, mean, safe_std) - old) / coordinates
            log_ratio = jnp.where(kept, log_ratio, 0.0)
            ratio = jnp.exp(log_ratio)
            advantage = jnp.clip(advantage, -self.adv_clip_max, self.adv_clip_max)
            low, high = 1.0 - self.clip_range, 1.0 + self.clip_range_high
            bounded = jnp.clip(ratio, low, high)
            surrogate = jnp.maximum(-advantage * ratio, -advantage * bounded)
            if kl_needed:
                v_ref = jax.lax.stop_gradient(
                    self.denoiser.velocity(reference, latents, t, condition, self.guidance))
                mean_ref, _ = self.sde.transition(latents, v_ref, t, t_next)
                kl = transition_kl(mean, mean_ref, safe_std)
            else:
                kl = jnp.zeros_like(surrogate)
            clipped = (ratio < low) | (ratio > high)
            return None, (surrogate, kl, kept.astype(jnp.float32), clipped, ratio, log_ratio)

        _, out = jax.lax.scan(one, None, xs)
        return out

    def terms(self, params, batch, *, step, reference, key) -> LossTerms:
        del step
        if self.beta > 0 and reference is None:
            raise ValueError("FlowGRPOObjective(beta > 0) needs the frozen reference; the Trainer "
                             "passes it from the EMA slot (ema_decay is 1.0)")
        surrogate, kl, kept, clipped, ratio, log_ratio = self._transitions(params, batch, reference, key)
        weight = kept.sum()
        policy = (kept * surrogate).sum()
        total = policy + self.beta * (kept * kl).sum() if self.beta > 0 else policy
        rows = jnp.asarray(batch["advantages"].shape[0], jnp.float32)
        metrics: Metrics = {
            "loss": (total, weight),
            "pg_loss": (policy, weight),  # the names GRPO reports (docs/store.md has the old ones)
            "clipfrac": ((kept * clipped).sum(), weight),
            "approx_kl": ((kept * 0.5 * log_ratio**2).sum(), weight),
            "ratio": ((kept * ratio).sum(), weight),
            "kept_transitions": (weight, jnp.ones(())),
            "advantage_abs": (jnp.abs(batch["advantages"]).reshape(-1).astype(jnp.float32).sum(),
                              jnp.asarray(batch["advantages"].size, jnp.float32)),
        }
        if self.beta > 0:
            metrics["kl"] = ((kept * kl).sum(), weight)
        if "rewards" in batch:
            metrics["reward"] = (batch["rewards"].astype(jnp.float32).sum(), rows)
        return LossTerms(total, weight, metrics)

    def loss(self, params, batch, step=0, *, reference=None):
        """`(mean loss over kept transitions, metric means)`: a view of `terms`."""
        return loss_view(self, params, batch, step, reference, None)

    def log_probs(self, params: Variables, batch) -> jax.Array:
        """Rescore joint transition log densities `[N, K]` with the rollout's guidance (0 where a
        transition is deterministic)."""
        condition = self.inputs.encode(batch)
        xs = tuple(jnp.moveaxis(jnp.asarray(batch[k]), 1, 0)
                   for k in ("latents", "next_latents", "timesteps", "next_timesteps"))

        def one(_, x):
            latents, next_latents, t, t_next = x
            v = self.denoiser.velocity(params, latents, t, condition, self.guidance)
            mean, std = self.sde.transition(latents, v, t, t_next)
            std_row = std.reshape(std.shape[0], -1)[:, 0]
            stochastic = self.sde.stochastic(t) & (std_row > 0)
            safe_std = jnp.where(stochastic.reshape(std.shape[:1] + (1,) * (std.ndim - 1)), std, 1.0)
            return None, jnp.where(stochastic, gaussian_log_density(next_latents, mean, safe_std), 0.0)

        _, out = jax.lax.scan(one, None, xs)
        return out.T

    # ----- sampling with the live policy ---------------------------------------------------
    def generate(self, params, batch, key, *, steps: int | None = None) -> jax.Array:
        """One deterministic sample per source row (image field optional), decoded to [-1, 1]."""
        return self.denoiser.generate(params, self.inputs.condition_batch(batch) or batch, key,
                                      steps=steps or self.steps, guidance=self.guidance, solver=self.sampler)

    def evaluate(self, params, batch, step=0) -> Metrics:
        """Generate one live-policy sample per source row (prompt-only batches too) and report its
        pixel statistics; rewards and FID-like metrics are the caller's, on `preview`'s images."""
        del step
        return sample_metrics(self.generate(params, batch, jax.random.key(EVAL_KEY)))

    def preview(self, params, batch, step=0, *, scored: FlowReward | None = None) -> Preview:
        """Live-policy samples for `batch`'s rows, materialized on the host before captions are
        decoded; `scored` adds each sample's reward. `.png()` renders the grid."""
        return sample_preview(self, params, batch, step, scored)
