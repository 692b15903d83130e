"""DiffusionObjective: flow-matching pre-training of a rectified-flow model on images.

For each image `x_0` (the InputSpec's image field, encoded by the autoencoder) it draws a time
`t ~ U(0, 1)` and noise, forms `x_t = (1 - t) x_0 + t noise` and regresses the model output on
the process's target (the velocity `noise - x_0` for velocity prediction). The loss of a row is
the mean squared error over its coordinates; the loss is the mean over rows, reported as
`(sum over rows, rows)`. With conditions, each row's condition is replaced by zeros with
probability `condition_dropout`, so the model also learns the unconditional velocity that
classifier-free guidance needs.

Batch: the InputSpec's fields. Time and noise come from the Trainer's per-step key.

Not here: loss weighting over time, logit-normal time sampling, validation metrics such as FID.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dew_lib.diffusion.denoiser import Denoiser
from dew_lib.diffusion.inputs import AutoEncoder, InputSpec
from dew_lib.diffusion.preview import EVAL_KEY, Preview, sample_preview
from dew_lib.diffusion.process import CFG, Euler, Process, Solver
from dew_lib.objectives.base import LossTerms, Metrics, Objective
from dew_lib.objectives.base import loss as loss_view


class DiffusionObjective(Objective):
    """Flow matching; see the module docstring.

    guidance, sampler, steps: how `preview` samples. ema_decay: as in LMObjective (None: none).
    pretrained: starting variables (a dict as returned by model.init).
    """

    def __init__(self, model, process: Process, inputs: InputSpec, *,
                 autoencoder: AutoEncoder | None = None, condition_dropout: float = 0.1,
                 guidance: CFG | None = None, sampler: Solver = Euler(), steps: int = 41,
                 pretrained: Any = None, ema_decay: float | None = 0.999):
        if not isinstance(process, Process):
            raise TypeError(f"process must be a Process (e.g. presets.Flow()()), got {type(process).__name__}")
        if not 0.0 <= condition_dropout < 1.0:
            raise ValueError(f"DiffusionObjective.condition_dropout must be in [0, 1), got {condition_dropout}")
        if steps < 2:
            raise ValueError(f"DiffusionObjective.steps counts time points and must be >= 2, got {steps}")
        if ema_decay is not None and not 0.0 <= ema_decay <= 1.0:
            raise ValueError(f"DiffusionObjective.ema_decay must be in [0, 1] or None, got {ema_decay}")
        if guidance is not None and not inputs.conditioned:
            raise ValueError("DiffusionObjective(guidance=CFG(...)) needs a condition field in the "
                             "InputSpec; pass guidance=None for an unconditioned model")
        self.denoiser = Denoiser(model, process, inputs, autoencoder)
        self.model, self.process, self.inputs = model, process, inputs
        self.condition_dropout = condition_dropout
        self.guidance, self.sampler, self.steps = guidance, sampler, steps
        self.pretrained = pretrained
        self.ema_decay = ema_decay
        self._generate: dict[tuple, Callable] = {}  # preview.py's compiled samplers, by signature

    def init(self, key, variables=None):
        if variables is not None:
            return variables
        if self.pretrained is not None:
            return jax.tree.map(jnp.asarray, self.pretrained)
        return self.denoiser.init(key)

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        self.inputs.check(batch, image_required=True)

    def _per_row(self, params, batch, key):
        data = self.denoiser.autoencoder.encode(self.inputs.images(batch))
        rows = data.shape[0]
        time_key, noise_key, drop_key = jax.random.split(key, 3)
        t = jax.random.uniform(time_key, (rows,), jnp.float32)
        noise = jax.random.normal(noise_key, data.shape, jnp.float32)
        condition = self.inputs.encode(batch)
        if condition is not None and self.condition_dropout > 0:
            kept = jax.random.uniform(drop_key, (rows, 1)) >= self.condition_dropout
            condition = condition * kept
        x_t = self.process.interpolate(data, noise, t)
        output = self.model.apply(params, x_t, t, condition)
        error = (output - self.process.target(data, noise)) ** 2
        return error.reshape(rows, -1).mean(axis=1)  # [B]

    def terms(self, params, batch, *, step, reference, key) -> LossTerms:
        del step, reference
        per_row = self._per_row(params, batch, key)
        rows = jnp.asarray(per_row.shape[0], jnp.float32)
        return LossTerms(per_row.sum(), rows, {"loss": (per_row.sum(), rows)})

    def loss(self, params, batch, step=0, *, key=None):
        """`(mean loss, metric means)` for one batch: a view of `terms`."""
        return loss_view(self, params, batch, step, None, key)

    def evaluate(self, params, batch, step=0) -> Metrics:
        """The flow-matching loss at fixed times and noise (comparable across evaluations)."""
        del step
        per_row = self._per_row(params, batch, jax.random.key(EVAL_KEY))
        return {"loss": (per_row.sum(), jnp.asarray(per_row.shape[0], jnp.float32))}

    def generate(self, params, batch, key, *, steps: int | None = None):
        """One sample per row, decoded to [-1, 1] (deterministic `sampler`, `guidance`)."""
        return self.denoiser.generate(params, batch, key, steps=steps or self.steps,
                                      guidance=self.guidance, solver=self.sampler)

    def preview(self, params, batch, step=0, *, scored=None) -> Preview:
        """Samples for `batch`'s rows on the host, with captions and optional reward scores."""
        return sample_preview(self, params, batch, step, scored)
