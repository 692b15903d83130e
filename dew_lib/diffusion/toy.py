"""The toy Flow-GRPO run: pre-train a tiny DiT on coloured shapes, then push it toward red.

    python -m dew_lib.diffusion.toy [--out docs] [--pretrain-steps 800] [--grpo-steps 40] [--beta 0.05]

Stage 1 fits SimpleDiT to 8x8 RGB squares and crosses of random colours by flow matching
(`DiffusionObjective`). Stage 2 runs Flow-GRPO from those weights (beta 0.05 keeps it near
them) with a "redness" reward on the colour of the lit pixels, groups of 4, six time points per
rollout. It writes `flow_grpo_before.png` (samples of the pre-trained model) and
`flow_grpo_after.png` (the same noise after Flow-GRPO) into `--out`, and prints the reward curve
and the update rate. CPU only: about a minute of CPU time (a few minutes on a busy two-core box).

Not here: a real dataset or reward model; this shows the mechanics, not image quality.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import jax
import numpy as np
import optax

from dew_lib import models
from dew_lib.data import Dataset
from dew_lib.diffusion import DiffusionObjective, Field, FlowGRPOObjective, FlowRollout, InputSpec, presets
from dew_lib.train.sinks import MemorySink
from dew_lib.train.trainer import Trainer

SIZE = 8


def coloured_shapes(seed: int, count: int) -> np.ndarray:
    """uint8 `[count, 8, 8, 3]`: a square or a cross of a random bright colour on black."""
    rng = np.random.default_rng(seed)
    out = np.zeros((count, SIZE, SIZE, 3), np.uint8)
    for i in range(count):
        colour = rng.integers(64, 256, size=3)
        r, c = rng.integers(1, SIZE - 4, size=2)
        if rng.random() < 0.5:
            out[i, r:r + 3, c:c + 3] = colour
        else:
            out[i, r + 1, c:c + 3] = colour
            out[i, r:r + 3, c + 1] = colour
    return out


def redness(images: np.ndarray, batch) -> np.ndarray:
    """How red the lit pixels are, per sample: the brightness-weighted mean colour's red minus the
    mean of its green and blue (in [0, 1] units). It does not grow with the lit area, so painting
    the background does not pay."""
    rgb = (np.asarray(images, np.float64) + 1.0) / 2.0  # [N, H, W, 3] in [0, 1]
    weight = rgb.max(axis=-1, keepdims=True)
    colour = (weight * rgb).sum(axis=(1, 2)) / np.maximum(weight.sum(axis=(1, 2)), 1e-6)  # [N, 3]
    return colour[:, 0] - 0.5 * (colour[:, 1] + colour[:, 2])


def run(out: str, pretrain_steps: int, grpo_steps: int, seed: int = 0, beta: float = 0.05,
        learning_rate: float = 1e-3, width: int = 32, layers: int = 2) -> dict:
    """Both stages; returns the curves, rates and the paths of the two grids."""
    inputs = InputSpec(Field("image", (SIZE, SIZE, 3)))
    model = models.SimpleDiT(output_channels=3, patch_size=2, emb_features=width, num_layers=layers,
                             num_heads=4, mlp_ratio=2)
    process = presets.Flow()()
    images = coloured_shapes(seed, 512)
    batches = [{"image": images[i:i + 32]} for i in range(0, len(images), 32)]
    pretrain = DiffusionObjective(model, process, inputs, ema_decay=None, steps=11)
    pre_sink = MemorySink()
    pre_state = Trainer(pretrain, optax.adam(2e-3), key=jax.random.key(seed)).fit(
        Dataset(train=lambda partition: itertools.cycle(batches), batch=32),
        steps=pretrain_steps, log_every=max(1, pretrain_steps // 5), sinks=[pre_sink])

    objective = FlowGRPOObjective(model, process, inputs, guidance=None, steps=11, beta=beta,
                                  pretrained=pre_state.params)
    curve: list[float] = []
    rollout = FlowRollout(objective, redness, groups=4, steps=6,
                          records=lambda record: curve.append(float(record.rewards.mean())))
    source = {"image": np.zeros((8, SIZE, SIZE, 3), np.uint8)}  # 8 prompts-free rows -> 32 samples
    grid_rows = {"image": np.zeros((16, SIZE, SIZE, 3), np.uint8)}
    before = objective.preview(pre_state.params, grid_rows, scored=redness)
    sink = MemorySink()
    trainer = Trainer(objective, optax.adam(learning_rate), key=jax.random.key(seed + 1), rollout=rollout)
    started = time.perf_counter()
    state = trainer.fit(Dataset(train=lambda partition: itertools.repeat(source), batch=8),
                        steps=grpo_steps, log_every=max(1, grpo_steps // 8), sinks=[sink])
    seconds = time.perf_counter() - started
    after = objective.preview(state.params, grid_rows, scored=redness)

    os.makedirs(out, exist_ok=True)
    paths = {}
    for name, preview in (("before", before), ("after", after)):
        paths[name] = os.path.join(out, f"flow_grpo_{name}.png")
        with open(paths[name], "wb") as handle:
            handle.write(preview.png(columns=8))
    rates = [m["steps_per_second"] for _, m in sink.history[1:]]  # the first window compiles
    return {
        "pretrain_loss": [round(v, 4) for _, v in pre_sink.series("loss")],
        "reward_curve": curve,
        "preview_reward_before": float(before.scores.mean()),
        "preview_reward_after": float(after.scores.mean()),
        "updates_per_second": float(np.median(rates)) if rates else grpo_steps / seconds,
        "seconds": seconds,
        "paths": paths,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Toy Flow-GRPO run with before/after preview grids")
    parser.add_argument("--out", default="docs")
    parser.add_argument("--pretrain-steps", type=int, default=800)
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beta", type=float, default=0.05)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args(argv)
    result = run(args.out, args.pretrain_steps, args.grpo_steps, args.seed, args.beta, args.learning_rate)
    print("flow-matching loss:", result["pretrain_loss"])
    curve = result["reward_curve"]
    print("mean redness per rollout (every 5th):", [round(v, 3) for v in curve[::5]], "last", round(curve[-1], 3))
    print(f"preview redness (same noise, deterministic sampler): before {result['preview_reward_before']:.3f}, "
          f"after {result['preview_reward_after']:.3f}")
    print(f"Flow-GRPO updates per second (median over logged windows): {result['updates_per_second']:.1f}")
    print("grids:", result["paths"]["before"], result["paths"]["after"])


if __name__ == "__main__":
    main()
