"""What the run store costs: writing a GRPO step's sessions, and querying a million of them.

1. A GRPO step on the demo's decoder (128 wide, 4 layers, vocabulary 320): SampledRollout draws
   16 prompts x 4 samples of 64 ids after 24-token prompts, scores and packs them, and
   GRPOObjective (beta 0.04) updates on the 64 rows. Timed with and without writing the step's
   sessions to the store (alternating rounds, medians): the time the training thread spends in
   `stage.sessions(...)` and the writer thread's CPU time, each as a share of the step's time.
2. The same step while every step writes 100x its rollouts (6,400 sessions): the write runs on
   the writer's thread, so what the step pays is that thread's CPU on the same cores.
3. Sessions per second through a stage writer (Arrow conversion, zstd Parquet, fsync, flush)
   against pyarrow writing the same converted rows to one Parquet file.
4. A GROUP BY over one million session rows through the store's views (the part layout of a
   running stage, and after the stage finished and compacted) against DuckDB reading the same
   rows from one Parquet file, with the same memory limit and threads.

Run: `python bench/store.py [--rounds 3] [--steps 6]`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import report  # noqa: E402

PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 16, 4, 24, 64


def demo_step():
    """A GRPO trainer at the demo's sizes whose rollout hook writes the step's sessions (and the
    prompts of tasks it has not written yet) to the store when `step.stage` is set (as
    dew_lib.recipes.RecordedRollout does)."""
    import jax
    import optax

    from dew_lib import Dataset, Trainer, models
    from dew_lib.objectives import GRPOObjective
    from dew_lib.rollouts import SampledRollout
    from dew_lib.sampling import Sampling

    width = PROMPT_LEN + NEW_TOKENS
    model = models.build("causal_transformer", vocab_size=320, emb_features=128, num_layers=4,
                         num_heads=4, mlp_features=384, max_seq_len=width)
    objective = GRPOObjective(model, width - 1, beta=0.04)

    def reward(data_source, completion, ground_truth, extra_info):
        return float(completion.count("7")) / 10  # cheap, as a verifier's reading of the text

    rollout = SampledRollout(objective, reward=reward, groups=SAMPLES, max_new_tokens=NEW_TOKENS,
                             sampling=Sampling(temperature=1.0))
    rng = np.random.default_rng(0)
    batch = {"prompt": rng.integers(3, 320, (PROMPTS, PROMPT_LEN)).astype(np.int32),
             "prompt_length": np.full(PROMPTS, PROMPT_LEN, np.int32)}

    class Step:
        stage = None
        extra: list = []  # sessions written beside the step's own (the 100x case)
        in_write: list = []

        def __call__(self, state, batch, key):
            packed = rollout(state, batch, key)
            if self.stage is not None:
                written = rollout.last_sessions + self.extra
                latencies = [0.5] * len(written)
                update = int(jax.device_get(state.updates))
                start = time.perf_counter()
                self.stage.prompts(rollout.last_tasks, update=update, decode=rollout.decode)
                self.stage.sessions(written, update=update, latencies=latencies, causes="admitted",
                                    truncation="score")
                self.in_write.append(time.perf_counter() - start)
            return packed

    step = Step()
    trainer = Trainer(objective, optax.adamw(1e-4), key=jax.random.key(0), rollout=step)
    data = Dataset(train=lambda partition: itertools.repeat(batch), batch=PROMPTS)
    return trainer, data, step


def step_shares(rounds: int, steps: int, store_dir: str) -> list[tuple[str, str]]:
    from dew_lib.records.sessions import Call, Session
    from dew_lib.store import Store

    trainer, data, step = demo_step()
    trainer.fit(data, steps=2, log_every=1, sinks=[])  # compile the update and generation
    # 100x the rollouts: 99 more copies of a step's worth of sessions, built once, outside the timing.
    rng = np.random.default_rng(1)
    base = [Call(prompt_ids=rng.integers(3, 320, PROMPT_LEN), sampled_ids=rng.integers(3, 320, NEW_TOKENS),
                 behavior_log_probs=-rng.random(NEW_TOKENS), raw_log_probs=-rng.random(NEW_TOKENS),
                 finish_reason="length") for _ in range(PROMPTS * SAMPLES)]
    extra = [Session(task=f"x{k}-{i // SAMPLES}", group=i // SAMPLES, sample=i % SAMPLES, calls=(call,),
                     reward=1.0, components={"format": 1.0}) for k in range(99) for i, call in enumerate(base)]
    store = Store(store_dir)
    wall: dict[str, list[float]] = {"none": [], "demo": [], "100x": []}
    cpu: dict[str, list[float]] = {"none": [], "demo": [], "100x": []}
    in_write: dict[str, list[float]] = {"demo": [], "100x": []}
    writer_cpu: dict[str, list[float]] = {"demo": [], "100x": []}
    for r in range(rounds):
        for mode in ("none", "demo", "100x"):
            run = store.writer(f"{mode}-{r}") if mode != "none" else None
            step.stage = run.stage("grpo") if run else None
            step.extra = extra if mode == "100x" else []
            step.in_write = []
            start, start_cpu = time.perf_counter(), time.process_time()
            trainer.fit(data, steps=steps, log_every=steps, sinks=[])
            elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
            if run is not None:
                run.close()
                in_write[mode].append(statistics.median(step.in_write))
                writer_cpu[mode].append(run.write_seconds[1] / steps)
            wall[mode].append(elapsed / steps)
            cpu[mode].append(used / steps)
            print(f"round {r} {mode}: {elapsed / steps:.3f} s/step wall, {used / steps:.3f} s/step process CPU"
                  + (f", writer thread {1e3 * run.write_seconds[1] / steps:.0f} ms CPU/step" if run else ""),
                  flush=True)
    base_wall, base_cpu = statistics.median(wall["none"]), statistics.median(cpu["none"])
    out = [("GRPO-sized step without the store", f"{base_wall:.3f} s wall, {base_cpu:.3f} s CPU (medians; "
            "wall time is inflated by other load on this machine)")]
    for mode, label in (("demo", "64 sessions/step"), ("100x", "6,400 sessions/step")):
        spent, thread = statistics.median(in_write[mode]), statistics.median(writer_cpu[mode])
        out.append((f"writing {label}: training thread inside stage.sessions",
                    f"{1e3 * spent:.1f} ms = {100 * spent / base_wall:.2f}% of the step's wall time, "
                    f"{100 * spent / base_cpu:.2f}% of its CPU time"))
        out.append(("  writer thread (convert, Parquet, fsync, compaction)",
                    f"{1e3 * thread:.1f} ms CPU per step = {100 * thread / base_cpu:.2f}% of the step's CPU time"))
        out.append(("  whole step with the writes", f"{statistics.median(wall[mode]):.3f} s wall, "
                    f"{statistics.median(cpu[mode]):.3f} s CPU (medians)"))
    return out


def write_rate(rounds: int, store_dir: str) -> list[tuple[str, str]]:
    import pyarrow.parquet as pq

    from dew_lib.records.sessions import Call, Session
    from dew_lib.store import Store, rows

    rng = np.random.default_rng(2)
    sessions = [Session(task=str(i // SAMPLES), group=i // SAMPLES, sample=i % SAMPLES,
                        calls=(Call(prompt_ids=rng.integers(3, 320, PROMPT_LEN),
                                    sampled_ids=rng.integers(3, 320, NEW_TOKENS),
                                    behavior_log_probs=-rng.random(NEW_TOKENS),
                                    raw_log_probs=-rng.random(NEW_TOKENS)),),
                        reward=1.0, components={"format": 1.0}) for i in range(6400)]
    writes = 10
    store, ours, peer = Store(store_dir), [], []
    for r in range(rounds):
        start = time.perf_counter()
        with store.writer(f"rate-{r}") as run, run.stage("grpo") as stage:
            for update in range(writes):
                stage.sessions(sessions, update=update, latencies=[0.5] * len(sessions), causes="admitted")
        ours.append(writes * len(sessions) / (time.perf_counter() - start))
        tables = rows.session_tables(sessions, run="r", stage="s", update=0, trained=[True] * len(sessions),
                                     latencies=[0.5] * len(sessions), causes=["admitted"] * len(sessions),
                                     when=rows.now())
        start = time.perf_counter()
        for update in range(writes):
            for k, table in enumerate(tables):
                pq.write_table(table, os.path.join(store_dir, f"peer-{r}-{update}-{k}.parquet"))
        peer.append(writes * len(sessions) / (time.perf_counter() - start))
    a, b = statistics.median(ours), statistics.median(peer)
    return [("sessions/s through a stage writer (6,400 per write, 64+24 ids each, with calls)", f"{a:,.0f}"),
            ("  pyarrow write_table of the same rows, already converted", f"{b:,.0f} ({a / b:.2f}x)")]


def query_ratio(rounds: int, store_dir: str, total: int = 1_000_000) -> list[tuple[str, str]]:
    import duckdb

    from dew_lib.records.sessions import Call, Session
    from dew_lib.store import Store

    per_write = 6400
    rng = np.random.default_rng(3)
    sessions = [Session(task=str(i // SAMPLES), group=i // SAMPLES, sample=i % SAMPLES,
                        calls=(Call(prompt_ids=rng.integers(3, 320, 4), sampled_ids=rng.integers(3, 320, 4),
                                    behavior_log_probs=-rng.random(4)),),
                        reward=float(rng.random()), components={"format": 1.0}) for i in range(per_write)]
    store = Store(store_dir)
    run = store.writer("million")
    stage = run.stage("grpo")
    latencies = rng.random(per_write).tolist()
    start = time.perf_counter()
    for update in range(-(-total // per_write)):
        stage.sessions(sessions, update=update, latencies=latencies, causes="admitted")
    stage.flush()
    print(f"wrote {total:,} session rows in {time.perf_counter() - start:.1f} s", flush=True)
    query = ("SELECT update, count(*) AS n, avg(reward) AS reward, max(latency) AS slowest "
             "FROM {} WHERE stage = 'grpo' GROUP BY update")
    one = os.path.join(store_dir, "one.parquet")
    connection = store.connect()
    connection.execute(f"COPY (SELECT * FROM sessions WHERE run = 'million') TO '{one}' (FORMAT parquet)")
    (rows_in_one,), = connection.sql(f"SELECT count(*) FROM read_parquet('{one}')").fetchall()
    connection.close()

    def measure(label):
        parts = len(os.listdir(os.path.realpath(os.path.join(store.directory, "sessions", "million", "grpo"))))
        plain = duckdb.connect(config={"memory_limit": store.memory_limit})
        through, direct = [], []
        for _ in range(rounds):
            for side in ("store", "file"):
                times = []
                for _ in range(5):
                    begin = time.perf_counter()
                    if side == "store":
                        store.sql(query.format("sessions"))
                    else:
                        plain.sql(query.format(f"read_parquet('{one}')")).fetchall()
                    times.append(time.perf_counter() - begin)
                (through if side == "store" else direct).append(statistics.median(times))
        plain.close()
        a, b = statistics.median(through), statistics.median(direct)
        return [(f"GROUP BY over {rows_in_one:,} sessions, {label} ({parts} parts)",
                 f"{1e3 * a:.0f} ms vs one Parquet file {1e3 * b:.0f} ms: {a / b:.2f}x")]

    out = measure("while the stage runs")
    stage.finish()
    run.close()
    out += measure("after the stage finished")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round and mode")
    parser.add_argument("--skip-step", action="store_true", help="skip the GRPO-step measurement")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    where = tempfile.mkdtemp(prefix="dew-bench-store-")
    try:
        results = []
        if not args.skip_step:
            results += step_shares(args.rounds, args.steps, os.path.join(where, "steps"))
        results += write_rate(args.rounds, os.path.join(where, "rate"))
        results += query_ratio(args.rounds, os.path.join(where, "query"))
        report(f"run store ({os.cpu_count()} cores, store under {tempfile.gettempdir()})", results)
    finally:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
