"""A distillation step with the student drawing in its trainer, on the native server, and on
`dew serve` over HTTP, against drawing in the trainer.

The 8M-parameter Llama of bench/common.py is the student, a copy of it with other weights the
teacher (in process), `reverse_kl` at temperature 1 without EOS, so each step draws exactly
`--new` ids for each of `--batch` `--prompt`-id prompts. A step is the time between the starts of
two consecutive rollout calls: the draw (with the weight push before it on a server), the
teacher's scoring and the update. Each side trains `--warmup + --steps` steps in its own
process; the table shows each side's median step, the share of it spent drawing, and its ratio
to the in-process step, per round (rounds alternate the sides).

- generate: `DistillRollout` with `generate`, one compiled loop over the batch;
- native: a `NativeRolloutServer` with `--batch` slots, pushed the weights (a device copy) each step;
- dew serve: `remote_server` on a `dew serve` app in a thread on 127.0.0.1, each push the policy
  written in bf16 to the launch directory and reloaded (vLLM's route calls), then the draws over
  vLLM's completions wire format.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import LLAMA_8M, in_subprocess, report  # noqa: E402

SIDES = ("generate", "native", "dew serve")


def step_times(side: str, batch: int, prompt_len: int, new_tokens: int, warmup: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from dew_lib import models
    from dew_lib.data.dataset import Dataset
    from dew_lib.inference import NativeRolloutServer, Server, ServeTask
    from dew_lib.models.pretrained import Pretrained
    from dew_lib.objectives import DistillObjective
    from dew_lib.recipes import RemoteEngine, remote_server
    from dew_lib.recipes.recorded import RecordedRollout
    from dew_lib.rollouts.distill import DistillRollout
    from dew_lib.sampling import Sampling
    from dew_lib.serve import ServedPolicy, create_app, running
    from dew_lib.train.trainer import Trainer

    config = dict(LLAMA_8M, max_seq_len=prompt_len + new_tokens)
    model = models.build("causal_transformer", **config)
    teacher = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))
    objective = DistillObjective(model, prompt_len + new_tokens - 1, teacher_model=model, teacher=teacher,
                                 loss="reverse_kl")
    sampling = Sampling(temperature=1.0)
    rng = np.random.default_rng(0)

    def prompts(partition):
        while True:
            yield {"prompt": rng.integers(1, config["vocab_size"], (batch, prompt_len)).astype(np.int32),
                   "prompt_length": np.full(batch, prompt_len, np.int32)}

    starts, draws = [], []

    def fit(server):
        inner = DistillRollout(objective, max_new_tokens=new_tokens, sampling=sampling, server=server)

        class Timed(RecordedRollout):
            def __call__(self, state, batch, key):
                starts.append(time.perf_counter())
                return super().__call__(state, batch, key)

        rollout = Timed(inner, lambda state, batch, seconds: draws.append(seconds))
        trainer = Trainer(objective, optax.adam(1e-4), key=jax.random.key(0), rollout=rollout)
        state = trainer.fit(Dataset(train=prompts, batch=batch), steps=warmup + steps, log_every=warmup + steps,
                            sinks=[])
        jax.block_until_ready(state.params)
        starts.append(time.perf_counter())  # the last step's update has finished
        rollout.close()

    if side == "generate":
        fit(None)
    elif side == "native":
        start = jax.jit(objective.init)(jax.random.key(0))
        task = ServeTask(model=model, variables=start, sampling=sampling)
        fit(NativeRolloutServer(Server.from_task(task, slots=batch, capacity=prompt_len + new_tokens)))
    else:
        pretrained = Pretrained.from_model(model)
        with tempfile.TemporaryDirectory() as launch:
            pretrained.save(teacher, launch, dtype=jnp.bfloat16)  # other weights: the first push replaces them
            policy = ServedPolicy.load(launch, slots=batch, capacity=prompt_len + new_tokens, sampling=sampling)
            try:
                with running(create_app(policy, dev_endpoints=True)) as url:
                    fit(remote_server(RemoteEngine(url=url, directory=launch), pretrained)(sampling))
            finally:
                policy.close()
    step = np.diff(starts)[warmup:]
    return {"step": float(np.median(step)), "draw": float(np.median(np.asarray(draws[warmup:]) / step))}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurement rounds")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.batch, args.prompt, args.new, args.warmup, args.steps)
    if args.child:
        print(json.dumps(step_times(args.child, *shape)))
        return
    common = ("--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new),
              "--warmup", str(args.warmup), "--steps", str(args.steps))
    measured: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(args.rounds):
        for side in SIDES:
            measured[side].append(in_subprocess(__file__, side, *common))
    rows = []
    for side in SIDES:
        steps = [m["step"] for m in measured[side]]
        ratios = [m["step"] / g["step"] for m, g in zip(measured[side], measured["generate"], strict=True)]
        rows.append((f"{side}: step seconds (median), drawing share",
                     f"{statistics.median(steps):.3f} s, {statistics.median(m['draw'] for m in measured[side]):.0%}"))
        if side != "generate":
            rows.append((f"{side}: step / generate's step (median; rounds)",
                         f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"))
    report(f"distillation step, student drawing three ways: batch {args.batch}, prompt {args.prompt}, "
           f"{args.new} new ids, {os.cpu_count()} CPU cores", rows)


if __name__ == "__main__":
    main()
