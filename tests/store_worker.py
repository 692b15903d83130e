"""A run-store writer in its own process, for tests/test_store_processes.py and
tests/test_store_snapshots.py.

Writes updates `start..steps-1` of run RUN, stage STAGE into the project directory PATH: each
update is one GRPO step's worth of sessions (16 tasks x 4 samples, 64 sampled ids each, drawn
from a generator seeded by the update, so a rerun writes identical rows) and its metrics. After
each update is durable it prints `committed U`. Compaction runs often, so readers and kills meet
generation swaps. `--seconds S` writes updates until S seconds have passed instead (`--steps`
then only bounds them), `--prompts` sets the tasks per update, and `--compact-after`,
`--keep-loose` and `--merge-after` the writer's compaction (2, 0, 2: every write compacts).
"""

import argparse
import time

import numpy as np

from dew_lib.records.sessions import Call, Session
from dew_lib.store import Store

PROMPTS, SAMPLES, TOKENS = 16, 4, 64


def sessions_for(update: int, prompts: int = PROMPTS) -> list[Session]:
    rng = np.random.default_rng(update)
    out = []
    for p in range(prompts):
        prompt = rng.integers(1, 300, 24)
        for s in range(SAMPLES):
            call = Call(prompt_ids=prompt, sampled_ids=rng.integers(1, 300, TOKENS),
                        behavior_log_probs=-rng.random(TOKENS), version=update)
            out.append(Session(task=str(update * PROMPTS + p), group=p, sample=s, calls=(call,),
                               reward=float(s % 2), components={"format": 1.0}))
    return out


def two_runs(path, loss=lambda update: 1.0) -> Store:
    """Runs a and b of `path`'s store, each a finished stage `grpo` of 3 updates of two prompts'
    sessions with their calls, and a `loss` metric per update."""
    store = Store(path)
    for run in ("a", "b"):
        with store.writer(run, background=False) as writer:
            writer.start()
            with writer.stage("grpo", kind="grpo") as stage:
                for update in range(3):
                    stage.sessions(sessions_for(update, 2), update=update)
                    stage.metrics(update, {"loss": loss(update)})
            writer.finish()
    return store


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("run")
    parser.add_argument("stage")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--compact-after", type=int, default=4)
    parser.add_argument("--keep-loose", type=int, default=1)
    parser.add_argument("--merge-after", type=int, default=2)
    args = parser.parse_args()
    store = Store(args.path)
    deadline = time.monotonic() + args.seconds
    with store.writer(args.run, compact_after=args.compact_after, keep_loose=args.keep_loose,
                      merge_after=args.merge_after) as run:
        run.start(params={"steps": args.steps})
        stage = run.stage(args.stage, kind="grpo")
        for update in range(args.start, args.steps):
            if args.seconds and time.monotonic() > deadline:
                break
            stage.sessions(sessions_for(update, args.prompts), update=update,
                           latencies=[0.5] * args.prompts * SAMPLES, causes="admitted")
            stage.metrics(update, {"loss": 1.0 / (update + 1), "reward/mean": 0.5})
            stage.flush()
            print(f"committed {update}", flush=True)
            time.sleep(args.pause)
        stage.finish()
        run.finish()
    print("done", flush=True)


if __name__ == "__main__":
    main()
