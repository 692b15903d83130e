"""Training throughput of Dew's LM step against PyTorch + transformers on the same Llama.

Prints tokens/s for both (Dew on one XLA device, and on one host device per core), Dew's model
FLOP/s and its share of the float32 matmul peak that JAX measures on this machine in the same
run, and the Dew / PyTorch ratios, at sequence 256, 1,024 and 2,048 with 4,096 tokens per batch,
and again with a 151,936-token (Qwen) vocabulary. `--baseline DIR` adds another Dew checkout
(say, the commit before a change) to the same alternating rounds, on one device and on one host
device per core. `--one-core` adds Dew and PyTorch pinned to a single core: their ratio there
is the per-core efficiency, and Dew's host devices against that many single-core runs is how
well its data parallelism scales, together the bound on what one host device per core can
reach against PyTorch.

`--mesh` measures only the sharded Trainer instead: on two host devices (one per core), the same
step with `mesh=MeshSpec(fsdp=2)` (each device keeps half of every weight and Adam moment and
gathers a layer's weights as it computes) against `MeshSpec(data=2)` (both keep everything), in
alternating rounds, at 16 x 256 and at 2 x 1,024 with the 151,936-token vocabulary (`--shapes`
and `--large-vocab` choose others); it prints both rates and FSDP / DP per round (issue target:
0.9x or more). About 7.5 minutes at the defaults on two cores, the large vocabulary most of it.
Run: `make bench` (installs the bench extra) or `python bench/train_lm.py [--steps N] [--mesh]`.
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
from common import (  # noqa: E402
    LLAMA_8M,
    check_one_core,
    in_subprocess,
    jax_matmul_peak,
    median_seconds,
    per_round,
    report,
    threads,
    torch_train_step,
)


def model_flops_per_token(config: dict, seq: int) -> float:
    """6 x matmul parameters (forward + backward) plus the attention score and value products."""
    e, layers, mlp, vocab = (config[k] for k in ("emb_features", "num_layers", "mlp_features", "vocab_size"))
    matmul_params = layers * (4 * e * e + 3 * e * mlp) + e * vocab
    return 6 * matmul_params + 12 * layers * seq * e


def dew_tokens_per_second(config, batch, seq, steps, mesh=None):
    """Median tokens/s of the LM step; `mesh`: a MeshSpec text ("fsdp=2"), default all `data`."""
    import jax
    import optax

    from dew_lib import Dataset, LMObjective, Trainer, models
    from dew_lib.train.mesh import MeshSpec
    from dew_lib.train.sinks import MemorySink

    model = models.build("causal_transformer", **config)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, config["vocab_size"], size=(batch, seq + 1)).astype(np.int32)
    data = Dataset(train=lambda p: itertools.repeat({"text": rows}), batch=batch)
    trainer = Trainer(LMObjective(model, seq_len=seq, ema_decay=None), optax.adamw(1e-4),
                      key=jax.random.key(0), mesh=MeshSpec.parse(mesh) if mesh else None)
    sink = MemorySink()
    trainer.fit(data, steps=steps + 2, log_every=1, sinks=[sink])
    rates = [m["tokens_per_second"] for _, m in sink.history[2:]]  # first windows include compiling
    return float(np.median(rates)), trainer.compilations["train_step"]


def torch_tokens_per_second(config, batch, seq, steps):
    _, step = torch_train_step(config, batch, seq)
    step()
    return batch * seq / median_seconds(step, steps)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in shape.split("x")) for shape in text.split(",") if shape]


def measure(shape_args, rounds, use_torch, baseline, vocab, one_core):
    """Alternating rounds of every side for one shape; returns per-round rates."""
    common = (*shape_args, "--vocab", str(vocab))
    out = {"one": [], "per_core": [], "torch": [], "baseline": [], "baseline_per_core": [],
           "dew_core": [], "torch_core": []}
    for _ in range(rounds):  # alternate the sides so drift in machine load hits both
        out["one"].append(in_subprocess(__file__, "dew", *common)["rate"])
        out["per_core"].append(in_subprocess(__file__, "dew", *common, host_devices=threads())["rate"])
        if baseline:
            out["baseline"].append(in_subprocess(__file__, "dew", *common, pythonpath=baseline)["rate"])
            out["baseline_per_core"].append(in_subprocess(__file__, "dew", *common, pythonpath=baseline,
                                                          host_devices=threads())["rate"])
        if use_torch:
            out["torch"].append(in_subprocess(__file__, "torch", *common)["rate"])
        if one_core:
            out["dew_core"].append(in_subprocess(__file__, "dew", *common, one_core=True)["rate"])
            if use_torch:
                out["torch_core"].append(in_subprocess(__file__, "torch", *common, one_core=True)["rate"])
    return out


MESHES = ("fsdp=2", "data=2")  # FSDP first: the side the ratio is of


def compare_meshes(cases, steps: int, rounds: int) -> None:
    """FSDP 2 against DP 2 on two host devices, alternating which goes first each round."""
    rows = []
    for batch, seq, vocab in cases:
        done = len(rows)
        common = ("--batch", str(batch), "--seq", str(seq), "--steps", str(steps), "--vocab", str(vocab))
        rates: dict[str, list[float]] = {mesh: [] for mesh in MESHES}
        for i in range(rounds):
            for mesh in MESHES if i % 2 == 0 else MESHES[::-1]:
                got = in_subprocess(__file__, "dew", *common, "--mesh-spec", mesh, host_devices=2)
                rates[mesh].append(got["rate"])
        name = f"{batch}x{seq} vocab {vocab}"
        rows += [(f"{name}: dew tokens/s, FSDP 2 / DP 2 (2 host devices)",
                  f"{np.median(rates['fsdp=2']):,.0f} / {np.median(rates['data=2']):,.0f}"),
                 (f"{name}: FSDP 2 / DP 2 (per round; target 0.9x)",
                  per_round([f / d for f, d in zip(rates["fsdp=2"], rates["data=2"])]))]
        for key, value in rows[done:]:
            print(f"{key}: {value}", flush=True)
    report(f"train_lm --mesh: Llama 8M body, float32, Trainer(mesh=MeshSpec(fsdp=2)) against "
           f"MeshSpec(data=2) on 2 host devices, each in its own process, median of {rounds} "
           "alternating rounds", rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default=None,
                        help="batch x sequence pairs (default: 16x256,4x1024,2x2048, 4,096 tokens per "
                             "batch each; with --mesh 16x256; '' for none)")
    parser.add_argument("--large-vocab", default="2x1024",
                        help="shapes run again with a 151,936-token vocabulary ('' to skip)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--baseline", help="another Dew checkout to measure beside this one")
    parser.add_argument("--one-core", action="store_true",
                        help="also run Dew and PyTorch pinned to one core (Linux)")
    parser.add_argument("--mesh", action="store_true",
                        help="only FSDP 2 against DP 2 on two host devices (the sharded Trainer)")
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=LLAMA_8M["vocab_size"], help=argparse.SUPPRESS)
    parser.add_argument("--mesh-spec", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=("peak", "dew", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_one_core(parser, args)
    if args.shapes is None:
        args.shapes = "16x256" if args.mesh else "16x256,4x1024,2x2048"
    if args.child:
        config = dict(LLAMA_8M, vocab_size=args.vocab, max_seq_len=max(LLAMA_8M["max_seq_len"], args.seq or 0))
        if args.child == "peak":
            print(json.dumps({"flops": jax_matmul_peak()}))
        elif args.child == "dew":
            start = time.perf_counter()
            rate, compilations = dew_tokens_per_second(config, args.batch, args.seq, args.steps,
                                                       args.mesh_spec)
            print(json.dumps({"rate": rate, "compilations": compilations,
                              "seconds": time.perf_counter() - start}))
        else:
            print(json.dumps({"rate": torch_tokens_per_second(config, args.batch, args.seq, args.steps)}))
        return
    cases = [(b, s, LLAMA_8M["vocab_size"]) for b, s in parse_shapes(args.shapes)]
    if args.large_vocab:
        cases += [(b, s, 151_936) for b, s in parse_shapes(args.large_vocab)]
    if args.mesh:
        compare_meshes(cases, args.steps, args.rounds)
        return
    use_torch = not args.no_torch
    if use_torch:
        try:
            in_subprocess(__file__, "torch", "--batch", "1", "--seq", "8", "--steps", "1")
        except RuntimeError as error:
            print(f"torch failed: {str(error).splitlines()[-1]}; `pip install -e '.[bench]'`")
            use_torch = False
    peak = in_subprocess(__file__, "peak")["flops"]
    rows = [("machine f32 matmul peak (JAX)", f"{peak / 1e9:.1f} GFLOP/s")]
    for batch, seq, vocab in cases:
        done = len(rows)
        shape = ("--batch", str(batch), "--seq", str(seq), "--steps", str(args.steps))
        got = measure(shape, args.rounds, use_torch, args.baseline, vocab, args.one_core)
        med = {k: float(np.median(v)) for k, v in got.items() if v}
        best = float(np.median([max(a, b) for a, b in zip(got["one"], got["per_core"])]))
        config = dict(LLAMA_8M, vocab_size=vocab)
        flops = best * model_flops_per_token(config, seq)
        name = f"{batch}x{seq} vocab {vocab}"
        rows += [
            (f"{name}: dew tokens/s, 1 device / {threads()} host devices",
             f"{med['one']:,.0f} / {med['per_core']:,.0f}"),
            (f"{name}: dew model FLOP/s, share of peak", f"{flops / 1e9:.1f} GFLOP/s, {flops / peak:.2f}"),
        ]
        if "baseline" in med:
            ratios = [a / b for a, b in zip(got["one"], got["baseline"])]
            per_core = [a / b for a, b in zip(got["per_core"], got["baseline_per_core"])]
            rows += [(f"{name}: baseline tree tokens/s (1 device); this / baseline",
                      f"{med['baseline']:,.0f}; {per_round(ratios)}"),
                     (f"{name}: baseline tree tokens/s ({threads()} host devices); this / baseline",
                      f"{med['baseline_per_core']:,.0f}; {per_round(per_core)}")]
        if "torch" in med:
            rows += [(f"{name}: torch tokens/s", f"{med['torch']:,.0f}"),
                     (f"{name}: dew / torch, 1 device (per round)",
                      per_round([a / t for a, t in zip(got["one"], got["torch"])])),
                     (f"{name}: dew / torch, {threads()} host devices (per round)",
                      per_round([a / t for a, t in zip(got["per_core"], got["torch"])]))]
        if "dew_core" in med:
            scaling = [a / (threads() * c) for a, c in zip(got["per_core"], got["dew_core"])]
            rows.append((f"{name}: {threads()} host devices / {threads()} x dew on one core (per round)",
                         per_round(scaling)))
        if "torch_core" in med:
            rows += [(f"{name}: one core: dew / torch tokens/s", f"{med['dew_core']:,.0f} / {med['torch_core']:,.0f}"),
                     (f"{name}: one core: dew / torch (per round)",
                      per_round([a / t for a, t in zip(got["dew_core"], got["torch_core"])]))]
        for key, value in rows[done:]:  # as each case ends: a long run keeps what it measured
            print(f"{key}: {value}", flush=True)
    report(f"train_lm: Llama 8M body, {threads()} threads, float32, each side in its own process, "
           f"median of {args.rounds} alternating rounds", rows)


if __name__ == "__main__":
    main()
