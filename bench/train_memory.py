"""A training step's memory beyond its parameters and optimizer state, as the vocabulary grows.

The 8M-parameter Llama body of `bench/train_lm.py` at batch 8 x 1,024, with a vocabulary of
8,192 and of 151,936 (Qwen's). For Dew the figure is exact: XLA:CPU runs a step inside one
temporary allocation whose size its buffer assignment fixes at compile time
(`compiled.memory_analysis().temp_size_in_bytes`); with the state donated, that is everything a
step needs beyond the state. For PyTorch + transformers it is the peak resident memory during a
step above the resident memory before it (parameters, AdamW state, gradients freed), sampled
every millisecond. The PyTorch step at 151,936 needs about five copies of the `[8192, 151936]`
float32 logits (25 GB); it is skipped, with the estimate printed, when the machine has less
memory available than that.

Target: Dew's figure grows at most 1.5x from 8,192 to 151,936.
Run: `python bench/train_memory.py [--baseline DIR]` (DIR: another Dew checkout, compiled beside).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import LLAMA_8M, in_subprocess, report, torch_train_step  # noqa: E402

VOCABS = (8192, 151_936)


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def dew_bytes(config, batch, seq):
    import jax
    import optax

    from dew_lib import LMObjective, Trainer, models

    model = models.build("causal_transformer", **config)
    trainer = Trainer(LMObjective(model, seq_len=seq, ema_decay=None), optax.adamw(1e-4),
                      key=jax.random.key(0))
    state = trainer.abstract_state()
    batch_shape = {"text": jax.ShapeDtypeStruct((batch, seq + 1), np.int32)}
    start = time.perf_counter()
    compiled = trainer._steps[True].lower(state, batch_shape).compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    return {"transient": int(memory.temp_size_in_bytes), "state": state_bytes, "compile": seconds}


def torch_bytes(config, batch, seq):
    model, step = torch_train_step(config, batch, seq)
    step()  # creates the optimizer state
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    before, peak, running = rss(), [0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    step()
    running[0] = False
    sampler.join()
    state = sum(p.numel() * 4 * 3 for p in model.parameters())
    return {"transient": peak[0] - before, "state": state}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--baseline", help="another Dew checkout to compile beside this one")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "VOCAB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, vocab = args.child[0], int(args.child[1])
        config = dict(LLAMA_8M, vocab_size=vocab, max_seq_len=max(LLAMA_8M["max_seq_len"], args.seq))
        measure = dew_bytes if side == "dew" else torch_bytes
        print(json.dumps(measure(config, args.batch, args.seq)))
        return
    shape = ("--batch", str(args.batch), "--seq", str(args.seq))
    gb = 2**30
    rows, results = [], {}
    sides = [("dew", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    for name, path in sides:
        for vocab in VOCABS:
            got = in_subprocess(__file__, "dew", str(vocab), *shape, pythonpath=path)
            results[name, vocab] = got["transient"]
            rows.append((f"{name}: vocab {vocab:,} step memory beyond the state",
                         f"{got['transient'] / gb:.2f} GB (state {got['state'] / gb:.2f} GB, "
                         f"compiled in {got['compile']:.0f} s)"))
        rows.append((f"{name}: growth 8,192 -> 151,936",
                     f"{results[name, VOCABS[1]] / results[name, VOCABS[0]]:.2f}x"))
    if not args.no_torch:
        for vocab in VOCABS:
            need = 5 * args.batch * args.seq * vocab * 4
            if need > 0.8 * available():
                rows.append((f"torch: vocab {vocab:,}", f"skipped: needs about {need / gb:.0f} GB, "
                             f"{available() / gb:.0f} GB available"))
                continue
            got = in_subprocess(__file__, "torch", str(vocab), *shape)
            results["torch", vocab] = got["transient"]
            rows.append((f"torch: vocab {vocab:,} step peak beyond the state", f"{got['transient'] / gb:.2f} GB"))
        if ("torch", VOCABS[1]) in results:
            rows.append(("torch: growth 8,192 -> 151,936",
                         f"{results['torch', VOCABS[1]] / results['torch', VOCABS[0]]:.2f}x"))
    report(f"train_memory: Llama 8M body, batch {args.batch} x {args.seq}, float32", rows)


if __name__ == "__main__":
    main()
