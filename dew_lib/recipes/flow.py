"""Stage builders for rectified-flow image models: flow-matching pre-training and Flow-GRPO.

The image counterpart of build.py, and the one place that maps these stages' options to objects
(options.py declares them; tasks/flow_train.py's forms are those options):

    images   + FlowPretrainOptions -> DiffusionObjective (no EMA), shuffled image batches
    a model  + FlowGRPOOptions     -> FlowGRPOObjective (unguided, FlowSDE exploration) with a
                                      FlowRollout; each step's batch is only a size (fresh noise)

Both return `Built` (build.py) with no evaluation; the caller picks the optimizer and key and
wraps the rollout to record or preview it.

Not here: conditioned models (prompts or labels), guidance, reading images or saved models
(the caller), previews and the run store (tasks/flow_train.py), Prefect.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from dew_lib.data import Dataset
from dew_lib.diffusion import DiffusionObjective, Field, FlowGRPOObjective, FlowRollout, FlowSDE, InputSpec
from dew_lib.options import integer
from dew_lib.recipes.build import Built, adapted
from dew_lib.recipes.options import FlowGRPOOptions, FlowPretrainOptions


def image_batches(images: np.ndarray, batch: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Endless shuffled batches of `{"image": uint8 [batch, H, W, C]}`, a new order every epoch."""
    if len(images) < batch:
        raise ValueError(f"the training set has {len(images)} images, fewer than batch={batch}; "
                         "lower the batch or add images")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(images))
        for start in range(0, len(order) - batch + 1, batch):
            yield {"image": images[order[start:start + batch]]}


def build_flow_pretrain(model, process, variables, images: np.ndarray, options: FlowPretrainOptions, *,
                        seed: int = 0) -> Built:
    """Flow-matching pre-training of `model` under `process` on uint8 `images` [N, H, W, C],
    starting from `variables` (None: a fresh init). seed: the order the images are shuffled in,
    a new one every epoch."""
    integer("build_flow_pretrain seed", seed, at_least=0)
    inputs = InputSpec(Field("image", tuple(images.shape[1:])))
    objective = DiffusionObjective(model, process, inputs, ema_decay=None, steps=options.preview_steps,
                                   pretrained=variables)
    dataset = Dataset(train=lambda partition: image_batches(images, options.batch, seed),
                      records=len(images), batch=options.batch)
    return Built(objective=objective, dataset=dataset)


def build_flow_grpo(model, process, variables, shape: Sequence[int], reward,
                    options: FlowGRPOOptions, *, key: jax.Array | None = None) -> Built:
    """Flow-GRPO of the unconditioned `model` (its `variables` also the frozen reference) on
    images of `shape` (H, W, C), scored by `reward(images, batch) -> [N]`. With `options.lora`
    adapters drawn from `key` train on the frozen `variables` (`Built.model` carries them)."""
    model, variables = adapted(model, variables, options, key)
    inputs = InputSpec(Field("image", shape))
    objective = FlowGRPOObjective(model, process, inputs, sde=FlowSDE(noise_level=options.noise_level),
                                  beta=options.beta, clip_range=options.epsilon_low,
                                  clip_range_high=options.epsilon_high, guidance=None,
                                  steps=options.preview_steps, pretrained=variables)
    rollout = FlowRollout(objective, reward, groups=options.groups, steps=options.rollout_steps,
                          train_steps=options.train_steps)
    source = {"image": np.zeros((options.batch, *shape), np.uint8)}  # only its size is used
    dataset = Dataset(train=lambda partition: itertools.repeat(source), batch=options.batch)
    return Built(objective=objective, dataset=dataset, rollout=rollout, model=model)


__all__ = ["build_flow_grpo", "build_flow_pretrain", "image_batches"]
