"""Training throughput of Dew's LM step against PyTorch + transformers on the same Llama.

Prints tokens/s for both (Dew on one XLA device, and on one host device per core), Dew's model
FLOP/s and its share of the float32 matmul peak that JAX measures on this machine in the same
run, and the Dew / PyTorch ratio.
Run: `make bench` (installs the bench extra) or `python bench/train_lm.py [--steps N]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from common import LLAMA_8M, in_subprocess, jax_matmul_peak, median_seconds, report, threads, torch_llama  # noqa: E402


def model_flops_per_token(config: dict, seq: int) -> float:
    """6 x matmul parameters (forward + backward) plus the attention score and value products."""
    e, layers, mlp, vocab = (config[k] for k in ("emb_features", "num_layers", "mlp_features", "vocab_size"))
    matmul_params = layers * (4 * e * e + 3 * e * mlp) + e * vocab
    return 6 * matmul_params + 12 * layers * seq * e


def dew_tokens_per_second(config, batch, seq, steps):
    import jax
    import optax

    from dew_lib import Dataset, LMObjective, Trainer, models
    from dew_lib.sinks import MemorySink

    model = models.build("causal_transformer", **config)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, config["vocab_size"], size=(batch, seq + 1)).astype(np.int32)
    data = Dataset(train=lambda p: itertools.repeat({"text": rows}), batch=batch)
    trainer = Trainer(LMObjective(model, seq_len=seq, ema_decay=None), optax.adamw(1e-4),
                      key=jax.random.key(0))
    sink = MemorySink()
    trainer.fit(data, steps=steps + 2, log_every=1, sinks=[sink])
    rates = [m["tokens_per_second"] for _, m in sink.history[2:]]  # first windows include compiling
    return float(np.median(rates)), trainer.compilations["train_step"]


def torch_tokens_per_second(config, batch, seq, steps):
    import torch

    model = torch_llama(config, threads()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, config["vocab_size"], size=(batch, seq + 1)))

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()

    step()
    return batch * seq / median_seconds(step, steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--child", choices=("peak", "dew", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = dict(LLAMA_8M)
    if args.child:
        if args.child == "peak":
            print(json.dumps({"flops": jax_matmul_peak()}))
        elif args.child == "dew":
            start = time.perf_counter()
            rate, compilations = dew_tokens_per_second(config, args.batch, args.seq, args.steps)
            print(json.dumps({"rate": rate, "compilations": compilations,
                              "seconds": time.perf_counter() - start}))
        else:
            print(json.dumps({"rate": torch_tokens_per_second(config, args.batch, args.seq, args.steps)}))
        return
    shape = ("--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps))
    peak = in_subprocess(__file__, "peak")["flops"]
    ratios, rounds = [], []
    for _ in range(args.rounds):  # alternate the sides so drift in machine load hits both
        one = in_subprocess(__file__, "dew", *shape)
        per_core = in_subprocess(__file__, "dew", *shape, host_devices=threads())
        dew = max(one, per_core, key=lambda result: result["rate"])
        torch_rate = None
        if not args.no_torch:
            try:
                torch_rate = in_subprocess(__file__, "torch", *shape)["rate"]
            except RuntimeError as error:
                print(f"torch failed: {str(error).splitlines()[-1]}; `pip install -e '.[bench]'`")
                args.no_torch = True
        rounds.append((one["rate"], per_core["rate"], torch_rate))
        if torch_rate:
            ratios.append(dew["rate"] / torch_rate)
    best = float(np.median([max(a, b) for a, b, _ in rounds]))
    flops = best * model_flops_per_token(config, args.seq)
    rows = [
        ("machine f32 matmul peak (JAX)", f"{peak / 1e9:.1f} GFLOP/s"),
        ("dew tokens/s, 1 device (median)", f"{np.median([r[0] for r in rounds]):,.0f}"),
        (f"dew tokens/s, {threads()} host devices (median)", f"{np.median([r[1] for r in rounds]):,.0f}"),
        ("dew model FLOP/s (faster setting)", f"{flops / 1e9:.1f} GFLOP/s"),
        ("dew MFU vs measured peak", f"{flops / peak:.2f}"),
        ("dew train-step compilations", str(dew["compilations"])),
    ]
    if ratios:
        rows += [("torch tokens/s (median)", f"{np.median([r[2] for r in rounds]):,.0f}"),
                 ("dew / torch per round", " ".join(f"{r:.2f}" for r in ratios)),
                 ("dew / torch (median)", f"{np.median(ratios):.2f}x")]
    report(f"train_lm: Llama 8M, batch {args.batch} x {args.seq}, float32, {threads()} threads, "
           "each side in its own process", rows)


if __name__ == "__main__":
    main()
