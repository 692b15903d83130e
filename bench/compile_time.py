"""Compile time of a training step for a Qwen3-0.6B-shaped decoder, layers unrolled or scanned.

28 layers, 1,024 features, 16 query and 8 key/value heads of 128, qk-norm, a 3,072-wide MLP,
tied 151,936-token embeddings: the LM step (forward, backward, AdamW) is lowered and compiled
from abstract shapes (nothing is allocated or run) in a fresh process per setting, alternating.
`--baseline DIR` compiles another Dew checkout (its default layout) in the same rounds.
Run: `python bench/compile_time.py [--batch 1 --seq 1024 --rounds 2]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import in_subprocess, report  # noqa: E402

QWEN3_06B = dict(vocab_size=151_936, emb_features=1024, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128, mlp_features=3072, max_seq_len=4096, qk_norm=True,
                 tie_embeddings=True)


def compile_seconds(options: dict, batch: int, seq: int) -> float:
    import jax
    import numpy as np
    import optax

    from dew_lib import LMObjective, Trainer, models

    model = models.build("causal_transformer", **QWEN3_06B, **options)
    trainer = Trainer(LMObjective(model, seq_len=seq, ema_decay=None), optax.adamw(1e-4),
                      key=jax.random.key(0))
    state = trainer.abstract_state()
    shape = {"text": jax.ShapeDtypeStruct((batch, seq + 1), np.int32)}
    start = time.perf_counter()
    trainer._steps[True].lower(state, shape).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", help="another Dew checkout, compiled with its defaults")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = ("--batch", str(args.batch), "--seq", str(args.seq))
    if args.child is not None:
        print(json.dumps({"seconds": compile_seconds(json.loads(args.child), args.batch, args.seq)}))
        return
    sides = {"unrolled": ({"scan_layers": False}, None), "scanned": ({"scan_layers": True}, None)}
    if args.baseline:
        sides["baseline"] = ({}, args.baseline)
    seconds = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, (options, path) in sides.items():
            got = in_subprocess(__file__, json.dumps(options), *shape, pythonpath=path)
            seconds[name].append(got["seconds"])
    rows = [(f"{name}: compile seconds (median; rounds)",
             f"{statistics.median(v):.1f} ({' '.join(f'{x:.1f}' for x in v)})") for name, v in seconds.items()]
    report(f"compile_time: Qwen3-0.6B-shaped LM step, batch {args.batch} x {args.seq}", rows)


if __name__ == "__main__":
    main()
