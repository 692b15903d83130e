"""Synchronous against asynchronous GRPO: the same updates with SampledRollout and with the
RolloutScheduler (ahead=1) over a PromptSource on the native rollout server.

Both sides train the same model from the same prompts for `--steps` updates: `--prompts` prompts
x `--groups` completions of `--new` ids (temperature 1, no EOS, so every completion has the same
length and the same work), with a reward that counts the even ids of the completion, once as it
is ("plain") and once after sleeping `--wait` seconds per sample like an I/O-bound verifier
("waiting"). Both score on `--workers` threads (8, the sources' default, so scoring a batch of
32 takes four rounds of the wait). The model is the demo's decoder (`--layers` 4, width 128).
With ahead=1 a batch is drawn and scored while the trainer updates on the one before, so the
waiting hides only behind an update that lasts longer than the drawing plus four rounds of
50 ms: the default rows (32-id prompts, 64 new ids) give it that; 16-id prompts with 32 new ids
update in about the time of the scoring alone, and the trainer then waits about a fifth of
the time (README, "Speed"). Synchronous:
each update waits for its batch to be drawn on the trainer's device (`sampling.generate`) and
scored. Asynchronous: batch i+1 is drawn and
scored on the server's thread while the trainer updates on batch i (max_lag=1; the update
scores the proximal policy in its own forward pass and applies a TIS cap of 2).

The clock starts when the trainer asks for its second batch (the first update, which compiles,
is left out) and stops when `fit` returns. A rollout call is timed from the moment the previous
update has finished (JAX dispatches updates asynchronously; the wait for one is the update's
time, not the rollout's). The wait share is the trainer's time waiting for rollouts over that
span: for the scheduler, `SchedulerRecord.waited`; for SampledRollout, its whole call (the
trainer does nothing else meanwhile). The rollout-call share is the time inside the rollout call
on both sides (for the scheduler: waiting, pushing the weights, packing and rescoring the
proximal log-probs). Each side runs in its own process, rounds alternate, and the table shows medians and
the ratio sync / async per round (above 1: async is faster).

Then the native server's decode tokens/s at 1, 8 and 32 concurrent requests (bench/native_server.py's
server side, its 8M-parameter model, as many slots as requests).

Run: `python bench/async_grpo.py [--steps 8 --rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import in_subprocess, report  # noqa: E402

NATIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_server.py")
CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".pytest_cache", "jax")
MODEL = dict(vocab_size=512, emb_features=128, num_heads=4, num_kv_heads=4, mlp_features=384)


def even_share(wait: float):
    """The reward: the share of even ids among the completion's; sleeps `wait` seconds first."""
    def reward(data_source, completion, ground_truth, extra_info):
        if wait:
            time.sleep(wait)
        ids = [int(i) for i in completion.split()]
        return sum(i % 2 == 0 for i in ids) / max(len(ids), 1)
    return reward


def run_side(mode: str, wait: float, args) -> dict:
    import jax
    import optax

    jax.config.update("jax_compilation_cache_dir", os.path.abspath(CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from dew_lib import Dataset, Trainer, models
    from dew_lib.inference import NativeRolloutServer, Server, ServeTask
    from dew_lib.objectives import GRPOObjective
    from dew_lib.rollouts import PromptSource, RolloutScheduler, SampledRollout, prompt_tasks
    from dew_lib.sampling import Sampling

    width = args.prompt_len + args.new
    model = models.build("causal_transformer", **MODEL, num_layers=args.layers, max_seq_len=width)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, MODEL["vocab_size"], (args.steps + 2, args.prompts, args.prompt_len))
    batches = [{"prompt": p.astype(np.int32), "prompt_length": np.full(args.prompts, args.prompt_len, np.int32),
                "task_id": np.arange(i * args.prompts, (i + 1) * args.prompts)}
               for i, p in enumerate(prompts)]
    data = Dataset(train=lambda partition: iter(batches), batch=args.prompts)
    sampling = Sampling(temperature=1.0)  # no EOS: every completion is --new ids
    reward = even_share(wait)
    calls: list[tuple[float, float]] = []  # (start, end) of every rollout call

    def timed(rollout):
        def call(state, batch, key):
            jax.block_until_ready(state.params)  # the previous update ran until here: not the rollout's
            start = time.perf_counter()
            out = rollout(state, batch, key)
            calls.append((start, time.perf_counter()))
            return out
        return call

    records = []
    if mode == "sync":
        objective = GRPOObjective(model, width - 1)
        variables = objective.init(jax.random.key(0))
        rollout = SampledRollout(objective, reward=reward, groups=args.groups, max_new_tokens=args.new,
                                 sampling=sampling, workers=args.workers)
        trainer = Trainer(objective, optax.adam(1e-4), key=jax.random.key(1), rollout=timed(rollout))
        trainer.fit(data, steps=args.steps, log_every=1, sinks=[])
        end = time.perf_counter()
    else:
        objective = GRPOObjective(model, width - 1, behavior_importance=2.0)
        variables = objective.init(jax.random.key(0))
        task = ServeTask(model=model, variables=variables, sampling=sampling)
        with NativeRolloutServer(Server.from_task(task, slots=args.slots, capacity=width)) as server, \
                PromptSource(server, reward, max_new_tokens=args.new, workers=args.workers) as source:
            scheduler = RolloutScheduler(objective, source, server, width=width,
                                         rows=args.prompts * args.groups, tasks=prompt_tasks,
                                         groups=args.groups, ahead=1, max_lag=1, truncation="score",
                                         log=records.append)
            trainer = Trainer(objective, optax.adam(1e-4), key=jax.random.key(1), rollout=timed(scheduler))
            trainer.fit(scheduler.tasks(data), steps=args.steps, log_every=1, sinks=[])
            end = time.perf_counter()
            scheduler.close()
    del variables
    start = calls[1][0]
    span = end - start
    inside = sum(b - a for a, b in calls[1:])
    waited = sum(r.waited for r in records[1:]) if records else inside
    return {"seconds": span, "wait_share": waited / span, "call_share": inside / span,
            "lag": max((r.lag for r in records), default=0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--wait", type=float, default=0.05, help="seconds the waiting reward sleeps per sample")
    parser.add_argument("--workers", type=int, default=8, help="threads that score samples, on both sides")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the trained model")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds")
    parser.add_argument("--loads", type=int, nargs="*", default=[1, 8, 32],
                        help="concurrent requests for the server's decode rate (none: skip it)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "WAIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_side(args.child[0], float(args.child[1]), args)))
        return
    shape = ("--steps", str(args.steps), "--prompts", str(args.prompts), "--groups", str(args.groups),
             "--prompt-len", str(args.prompt_len), "--new", str(args.new), "--slots", str(args.slots),
             "--workers", str(args.workers), "--layers", str(args.layers))
    rows = []
    for name, wait in (("plain", 0.0), ("waiting", args.wait)):
        sides: dict[str, list[dict]] = {"sync": [], "async": []}
        for round_ in range(args.rounds):  # alternate which side goes first, too
            for mode in (("sync", "async") if round_ % 2 == 0 else ("async", "sync")):
                sides[mode].append(in_subprocess(__file__, mode, str(wait), *shape))
        for mode, label in (("sync", "SampledRollout"), ("async", "scheduler, ahead=1")):
            runs = sides[mode]
            rows.append((f"{name} reward: {label}, seconds for updates 2..{args.steps}",
                         f"{statistics.median(r['seconds'] for r in runs):.2f}"))
            rows.append((f"{name} reward: {label}, wait share / rollout-call share",
                         f"{statistics.median(r['wait_share'] for r in runs):.1%} / "
                         f"{statistics.median(r['call_share'] for r in runs):.1%}"))
        ratios = [s["seconds"] / a["seconds"] for s, a in zip(sides["sync"], sides["async"])]
        rows.append((f"{name} reward: sync / async wall clock (median; rounds)",
                     f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"))
        rows.append((f"{name} reward: async largest lag", str(max(r["lag"] for r in sides["async"]))))
    decode = ("--prompt", "32", "--new", "128", "--repeats", "3")
    for requests in args.loads:
        rates = [in_subprocess(NATIVE, "server", str(requests), str(requests), *decode)["rate"]
                 for _ in range(args.rounds)]
        rows.append((f"native server decode, {requests} concurrent requests, tokens/s (median; rounds)",
                     f"{statistics.median(rates):,.0f} ({', '.join(f'{r:,.0f}' for r in rates)})"))
    report(f"GRPO, {args.steps} updates of {args.prompts} prompts x {args.groups} completions of "
           f"{args.new} ids, {args.layers}-layer model, scored on {args.workers} threads, "
           f"{os.cpu_count()} CPU cores, "
           f"load {os.getloadavg()[0]:.1f}", rows)


if __name__ == "__main__":
    main()
