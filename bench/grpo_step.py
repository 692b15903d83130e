"""One GRPO step taken apart: generation, reward, packing, rescoring and the update.

Prints each part's median time, generated tokens/s, the GRPO update's time against the LM
objective's update on the same packed rows (GRPO adds a reference forward when beta > 0), and
generation inside the rollout against a bare `sampling.generate` call at the same batch.
Run: `python bench/grpo_step.py [--prompts 8 --groups 4 --new 32 --repeats 5]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import LLAMA_8M, median_seconds, report  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import jax
    import optax

    from dew_lib import LMObjective, Trainer, models
    from dew_lib.objectives import GRPOObjective
    from dew_lib.rollouts import SampledRollout
    from dew_lib.sampling import Sampling, generate

    config = dict(LLAMA_8M, max_seq_len=args.prompt_len + args.new)
    model = models.build("causal_transformer", **config)
    width = args.prompt_len + args.new
    rng = np.random.default_rng(0)
    prompts = {"prompt": rng.integers(1, config["vocab_size"], (args.prompts, args.prompt_len)).astype(np.int32),
               "prompt_length": np.full(args.prompts, args.prompt_len, np.int32)}
    n = args.prompts * args.groups

    def reward(data_source, completion, ground_truth, extra_info):
        return float(completion.count("7")) / 10  # a cheap text reward, as a verifier would read

    objective = GRPOObjective(model, width - 1, beta=0.04)
    sampling = Sampling(temperature=1.0)  # no EOS: every completion uses the whole budget
    rollout = SampledRollout(objective, reward=reward, groups=args.groups, max_new_tokens=args.new,
                             sampling=sampling)
    grpo = Trainer(objective, optax.adamw(1e-4), key=jax.random.key(0), rollout=rollout)
    state = grpo.initial_state()

    repeated = np.repeat(prompts["prompt"], args.groups, axis=0)
    lengths = np.repeat(prompts["prompt_length"], args.groups)

    def bare():
        out = generate(model, state.params, repeated, lengths, key=jax.random.key(1),
                       max_new_tokens=args.new, sampling=sampling)
        out.tokens.block_until_ready()

    bare()
    bare_seconds = median_seconds(bare, args.repeats)

    import dew_lib.rollouts.sampled as rollout_module

    timings = {"rollout": [], "generate": []}
    original = rollout_module.generate

    def timed_generate(*a, **k):  # the rollout's own generate call, waited on
        started = time.perf_counter()
        out = jax.block_until_ready(original(*a, **k))
        timings["generate"].append(time.perf_counter() - started)
        return out

    rollout_module.generate = timed_generate
    batch = None
    for i in range(args.repeats + 1):
        started = time.perf_counter()
        batch = rollout(state, prompts, jax.random.key(i))
        timings["rollout"].append(time.perf_counter() - started)
    rollout_module.generate = original
    rollout_seconds = float(np.median(timings["rollout"][1:]))
    rollout_generation = float(np.median(timings["generate"][1:]))
    host = rollout_seconds - rollout_generation
    rescoring = median_seconds(lambda: objective.packed_log_probs(state.params, batch).block_until_ready(),
                               args.repeats)
    objective.packed_log_probs(state.params, batch).block_until_ready()

    sharded = grpo._shard(batch)
    step = grpo._steps[True]
    state, _ = step(state, sharded)

    def grpo_update():
        nonlocal state
        state, metrics = step(state, sharded)
        jax.block_until_ready(metrics)

    grpo_seconds = median_seconds(grpo_update, args.repeats)

    lm = Trainer(LMObjective(model, width - 1, ema_decay=None), optax.adamw(1e-4), key=jax.random.key(0))
    lm_state = lm.initial_state()
    lm_batch = lm._shard({"text": batch["input_ids"], "text_segment_ids": batch["text_segment_ids"],
                          "text_positions": batch["text_positions"]})
    lm_step = lm._steps[True]
    lm_state, _ = lm_step(lm_state, lm_batch)

    def lm_update():
        nonlocal lm_state
        lm_state, metrics = lm_step(lm_state, lm_batch)
        jax.block_until_ready(metrics)

    lm_seconds = median_seconds(lm_update, args.repeats)
    total = rollout_seconds + grpo_seconds  # SampledRollout keeps the sampler's raw log-probs
    report(f"GRPO step: {args.prompts} prompts x {args.groups} samples x {args.new} new tokens, "
           f"{sum(x.size for x in jax.tree.leaves(state.params)) / 1e6:.1f}M-parameter Llama, "
           f"{jax.device_count()} device(s)", [
        ("rollout (generate + decode + reward + pack)", f"{rollout_seconds:.3f} s"),
        ("  of which host work (decode, reward, pack)", f"{host:.3f} s"),
        ("generated tokens/s", f"{n * args.new / rollout_generation:,.0f}"),
        ("rescoring (packed_log_probs; the scheduler's proximal pass)", f"{rescoring:.3f} s"),
        ("GRPO update (policy + reference forward)", f"{grpo_seconds:.3f} s"),
        ("LM update on the same rows", f"{lm_seconds:.3f} s"),
        ("GRPO update / LM update", f"{grpo_seconds / lm_seconds:.2f}x (target <= 2x)"),
        ("generation in the rollout / bare generate", f"{rollout_generation / bare_seconds:.2f}x (target <= 1.2x)"),
        ("whole step (rollout + update)", f"{total:.3f} s"),
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
