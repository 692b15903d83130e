"""What a mixture of experts costs against the dense decoder of the same active size, in one run.

The LM training step (forward, backward, AdamW) of a 4-layer, 512-wide decoder on 16 rows of 256
ids, float32: dense with an MLP of 1,536 hidden units, against MoE layers of 8 experts of 768
units with top-2 routing (the same 1,536 active units per token, four times the MLP weights)
plus the router's aux and z losses. Tokens/s of each, in alternating rounds, and MoE / dense per
round; the issue's target is 0.7x or more. A second line gives the MoE's routed work's share: the
same step with every expert's MLP run on every token (the dense-equivalent of dispatching
nothing) against the dropless dispatch, which shows what the sorting and block loop save. A
third gives routing replay's cost: GRPO's scoring forward and backward on the MoE decoder with
the routes of every token replayed (`routing_replay="rollout"`) against free routing, in
alternating rounds; the issue's target is under 5%.

Run: `python bench/moe.py [--rounds N] [--steps N]` (a few minutes on two cores).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import per_round, report  # noqa: E402

SHAPE = dict(vocab_size=8192, emb_features=512, num_layers=4, num_heads=8, max_seq_len=256)
DENSE = dict(SHAPE, mlp_features=1536)
MOE = dict(SHAPE, mlp_features=1536, experts=8, experts_per_token=2, expert_features=768,
           router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
ROWS, WIDTH = 16, 256


def tokens_per_second(options: dict, steps: int) -> float:
    """Median tokens/s of the LM step on a decoder built with `options`."""
    import jax
    import jax.numpy as jnp
    import optax

    from dew_lib import Dataset, LMObjective, Trainer, models
    from dew_lib.train.sinks import MemorySink

    model = models.build("causal_transformer", **options)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    rows = np.random.default_rng(0).integers(0, options["vocab_size"], size=(ROWS, WIDTH + 1)).astype(np.int32)
    data = Dataset(train=lambda partition: itertools.repeat({"text": rows}), batch=ROWS)
    trainer = Trainer(LMObjective(model, seq_len=WIDTH, pretrained=variables, ema_decay=None), optax.adamw(1e-4),
                      key=jax.random.key(0))
    sink = MemorySink()
    trainer.fit(data, steps=steps + 2, log_every=1, sinks=[sink])
    return float(np.median([metrics["tokens_per_second"] for _, metrics in sink.history[2:]]))


def dispatch(repeats: int) -> list[tuple[str, str]]:
    """One MoE layer's MLP, forward and backward on ROWS x WIDTH tokens: the dropless dispatch
    against running every expert on every token and keeping the chosen ones."""
    import jax
    import jax.numpy as jnp
    from common import median_seconds

    from dew_lib.models import moe

    tokens, width, experts, hidden, k = ROWS * WIDTH, MOE["emb_features"], MOE["experts"], MOE["expert_features"], 2
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (tokens, width))
    gate, up = (jax.random.normal(key, (experts, width, hidden)) * 0.02 for key in keys[1:3])
    down = jax.random.normal(keys[3], (experts, hidden, width)) * 0.02
    chosen = jax.random.randint(keys[4], (tokens, k), 0, experts)
    weights = jnp.full((tokens, k), 1.0 / k)

    def every_expert(x, gate, up, down):
        h = jax.nn.silu(jnp.einsum("td,edh->teh", x, gate)) * jnp.einsum("td,edh->teh", x, up)
        out = jnp.einsum("teh,ehd->ted", h, down)  # [T, E, D]
        picked = jnp.take_along_axis(out, chosen[:, :, None], axis=1)
        return jnp.sum(picked * weights[:, :, None], axis=1)

    def dropless(x, gate, up, down):
        return moe.grouped_mlp(x, chosen, weights, gate, up, down)

    times = {}
    for name, fn in (("dropless", dropless), ("every expert", every_expert)):
        step = jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3)))
        jax.block_until_ready(step(x, gate, up, down))
        times[name] = median_seconds(lambda step=step: jax.block_until_ready(step(x, gate, up, down)), repeats)
    return [("layer", f"{tokens} tokens, top-{k} of {experts} experts, {width} x {hidden}, forward and backward"),
            ("dropless", f"{times['dropless'] * 1e3:.1f} ms"),
            ("every expert", f"{times['every expert'] * 1e3:.1f} ms"),
            ("every expert / dropless", f"{times['every expert'] / times['dropless']:.2f}x")]


def replay_cost(rounds: int, repeats: int) -> list[tuple[str, str]]:
    """GRPO's scoring pass (forward and backward of the sampled ids' log-probs) with routes
    replayed against routing freely, on the same packed rows."""
    import jax
    import jax.numpy as jnp
    from common import median_seconds

    from dew_lib import models
    from dew_lib.objectives import GRPOObjective

    model = models.build("causal_transformer", **MOE)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(0)
    shape = (ROWS, WIDTH + 1)
    experts = np.argsort(rng.random(shape + (MOE["num_layers"], MOE["experts"])), axis=-1)
    batch = {"input_ids": rng.integers(0, MOE["vocab_size"], size=shape).astype(np.int32),
             "text_segment_ids": np.ones(shape, np.int32),
             "text_positions": np.broadcast_to(np.arange(WIDTH + 1, dtype=np.int32), shape),
             "routed_experts": experts[..., :MOE["experts_per_token"]].astype(np.int32),
             "routed": np.ones(shape, bool)}
    steps = {}
    for replay in ("none", "rollout"):
        objective = GRPOObjective(model, WIDTH, routing_replay=replay)
        step = jax.jit(jax.grad(lambda params, batch, o=objective: jnp.sum(o.target_log_probs(params, batch))))
        jax.block_until_ready(step(variables, batch))
        steps[replay] = step
    ratios = []
    for _ in range(rounds):
        free, replayed = (median_seconds(lambda s=steps[r]: jax.block_until_ready(s(variables, batch)), repeats)
                          for r in ("none", "rollout"))
        ratios.append(replayed / free)
    return [("pass", f"{ROWS} x {WIDTH} ids, log-probs of every id, forward and backward"),
            ("replayed / free (target < 1.05x)", per_round(ratios))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"dense": [], "moe": []}
    for _ in range(args.rounds):
        for name, options in (("dense", DENSE), ("moe", MOE)):
            rates[name].append(tokens_per_second(options, args.steps))
    ratios = [b / a for a, b in zip(rates["dense"], rates["moe"], strict=True)]
    report("LM step: MoE (8 experts of 768, top-2) against dense (1,536), same active units", [
        ("model", "4 layers x 512, vocabulary 8,192, 16 x 256 ids, float32, AdamW"),
        ("dense tokens/s", f"{np.median(rates['dense']):,.0f}"),
        ("moe tokens/s", f"{np.median(rates['moe']):,.0f}"),
        ("moe / dense (target >= 0.7x)", per_round(ratios))])
    report("one MoE layer: dropless dispatch against every expert on every token", dispatch(repeats=5))
    report("routing replay: GRPO's scoring pass with the rollout's routes against free routing",
           replay_cost(args.rounds, repeats=3))


if __name__ == "__main__":
    main()
