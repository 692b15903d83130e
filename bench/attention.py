"""Causal attention alone: Dew's fused and blockwise kernels against PyTorch's
`scaled_dot_product_attention`.

One layer's attention of the bench model (4 heads of 64) at sequence 256, 1,024 and 2,048 with
4,096 tokens per batch: the forward and backward pass together, and the forward alone, as the
training step runs them. Prints milliseconds per call of Dew's fused XLA:CPU kernel (what
`attention_kernel="auto"` runs on CPU), its blockwise XLA form, and PyTorch, with the PyTorch /
fused time ratio (above 1 means Dew is faster) per alternated round. `--one-core` pins every
side to a single core, where the rounds are steadier.
Run: `python bench/attention.py [--one-core] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import check_one_core, in_subprocess, median_seconds, per_round, report, threads  # noqa: E402

HEADS, HEAD_DIM, BLOCK = 4, 64, 256
SIDES = ("fused", "blockwise", "torch")


def inputs(batch, seq):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((batch, seq, HEADS, HEAD_DIM)).astype(np.float32) for _ in range(4)]


def dew_times(batch, seq, repeats, kernel):
    import jax
    import jax.numpy as jnp

    from dew_lib.models.decoder_attention import attend_causal

    q, k, v, d_out = (jnp.asarray(x) for x in inputs(batch, seq))
    segments = jnp.ones((batch, seq), jnp.int32)
    d_out = d_out.reshape(batch, seq, HEADS * HEAD_DIM)
    forward = jax.jit(lambda q, k, v: attend_causal(q, k, v, segments, BLOCK, kernel))
    both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v) * d_out), argnums=(0, 1, 2)))
    for f in (forward, both):
        jax.block_until_ready(f(q, k, v))
    return (median_seconds(lambda: jax.block_until_ready(both(q, k, v)), repeats),
            median_seconds(lambda: jax.block_until_ready(forward(q, k, v)), repeats))


def torch_times(batch, seq, repeats, kernel=None):
    import torch

    torch.set_num_threads(threads())
    q, k, v, d_out = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in inputs(batch, seq))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    attend = torch.nn.functional.scaled_dot_product_attention

    def both():
        q.grad = k.grad = v.grad = None
        attend(q, k, v, is_causal=True).backward(d_out)

    def forward():
        with torch.no_grad():
            attend(q, k, v, is_causal=True)

    both()
    forward()
    return median_seconds(both, repeats), median_seconds(forward, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="16x256,4x1024,2x2048", help="batch x sequence pairs")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per side and round")
    parser.add_argument("--one-core", action="store_true", help="pin both sides to one core (Linux)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        both, forward = (torch_times if args.child == "torch" else dew_times)(
            args.batch, args.seq, args.repeats, args.child)
        print(json.dumps({"both": both, "forward": forward}))
        return
    check_one_core(parser, args)
    rows = []
    for shape in args.shapes.split(","):
        batch, seq = shape.split("x")
        child = ("--batch", batch, "--seq", seq, "--repeats", str(args.repeats))
        got = {side: [] for side in SIDES}
        for _ in range(args.rounds):  # alternate the sides so drift in machine load hits all
            for side in got:
                got[side].append(in_subprocess(__file__, side, *child, one_core=args.one_core))
        for key, what in (("both", "forward + backward"), ("forward", "forward")):
            fused, blockwise, peer = ([r[key] for r in got[side]] for side in SIDES)
            rows.append((f"{batch}x{seq} {what}: fused / blockwise / torch ms, "
                         "torch time / fused time (per round)",
                         f"{np.median(fused) * 1e3:,.1f} / {np.median(blockwise) * 1e3:,.1f} / "
                         f"{np.median(peer) * 1e3:,.1f}; "
                         f"{per_round([t / d for d, t in zip(fused, peer)])}"))
            print(f"{rows[-1][0]}: {rows[-1][1]}", flush=True)
    cores = "one core" if args.one_core else f"{threads()} threads"
    report(f"attention: causal, {HEADS} heads of {HEAD_DIM}, one layer, float32, {cores}, "
           f"median of {args.rounds} alternating rounds", rows)


if __name__ == "__main__":
    main()
