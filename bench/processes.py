"""SFT tokens/s on this host in one process and as a `dew launch` job, on the same global batch.

Three sides, in alternated rounds (medians and each round's ratio):
  one        one process, one XLA device (XLA's thread pool spans every core)
  devices    one process, one host device per core (data parallel inside the process)
  processes  `dew launch --processes N --local-devices 1`, one process per core, each pinned to
             its own core, gradients summed over gloo
devices/one and processes/one are what data parallelism inside a process and across processes
buy on this machine; processes/devices is the price of the process boundary (gloo's all-reduce,
one Python loop per process).
Run: `python bench/processes.py [--rounds R] [--steps N] [--processes N]`.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
from common import LLAMA_8M, in_subprocess, per_round, report, threads  # noqa: E402


def child(batch: int, seq: int, steps: int) -> None:
    """Train and print process 0's median tokens/s as JSON (every process of a job runs this)."""
    from dew_lib.train import distributed

    topology = distributed.initialize()
    if topology is not None and hasattr(os, "sched_setaffinity"):  # one core per process
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[topology.process_id % len(cores)]})
    import jax
    import optax

    from dew_lib import Dataset, LMObjective, Trainer, models
    from dew_lib.train.sinks import MemorySink

    model = models.build("causal_transformer", **LLAMA_8M)
    rows = np.random.default_rng(0).integers(0, LLAMA_8M["vocab_size"], size=(batch, seq + 1)).astype(np.int32)

    def share(partition):
        per = batch // partition.count
        return itertools.repeat({"text": rows[partition.index * per:(partition.index + 1) * per]})

    trainer = Trainer(LMObjective(model, seq_len=seq, ema_decay=None), optax.adamw(1e-4), key=jax.random.key(0))
    sink = MemorySink()
    trainer.fit(Dataset(train=share, batch=batch), steps=steps + 2, log_every=1, sinks=[sink])
    if distributed.is_primary():
        rates = [m["tokens_per_second"] for _, m in sink.history[2:]]  # the first windows compile
        print(json.dumps({"rate": float(np.median(rates)), "devices": jax.device_count()}), flush=True)


def launched(processes: int, args) -> dict:
    from dew_lib.train.launch import launch

    out = io.StringIO()
    code = launch([sys.executable, __file__, "--child", "--batch", str(args.batch), "--seq", str(args.seq),
                   "--steps", str(args.steps)], processes, local_devices=1, out=out)
    if code != 0:
        raise RuntimeError(f"the {processes}-process job failed ({code}):\n{out.getvalue()[-3000:]}")
    line = next(line for line in reversed(out.getvalue().splitlines()) if line.startswith("[0] {"))
    return json.loads(line[len("[0] "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=threads(), help="processes (default: one per core)")
    args = parser.parse_args()
    if args.child:
        return child(args.batch, args.seq, args.steps)
    shape = ("--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps))
    one, devices, processes = [], [], []
    for _ in range(args.rounds):  # alternate the sides so drift in machine load hits all three
        one.append(in_subprocess(__file__, *shape)["rate"])
        devices.append(in_subprocess(__file__, *shape, host_devices=args.processes)["rate"])
        processes.append(launched(args.processes, args)["rate"])
    one, devices, processes = map(np.asarray, (one, devices, processes))
    report(f"SFT tokens/s, 8M-parameter Llama, batch {args.batch} x {args.seq}, {args.rounds} rounds", [
        ("one process, one device", f"{np.median(one):,.0f}"),
        (f"one process, {args.processes} host devices", f"{np.median(devices):,.0f}"),
        (f"{args.processes} processes (dew launch), one core each", f"{np.median(processes):,.0f}"),
        ("devices / one", per_round(devices / one)),
        ("processes / one", per_round(processes / one)),
        ("processes / devices", per_round(processes / devices)),
    ])


if __name__ == "__main__":
    main()
