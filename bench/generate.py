"""Decode throughput of Dew's on-device generation against transformers' `generate`.

Same Llama configuration and weights layout, greedy decoding of a fixed number of new tokens
(no EOS) after a fixed prompt, at batch 1 and batch 16. Prints tokens/s and the Dew / HF ratio.
`--baseline DIR` also runs another Dew checkout's `generate` in the same alternating rounds and
prints Dew / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import LLAMA_8M, in_subprocess, median_seconds, report, threads, torch_llama  # noqa: E402


def dew_rate(config, batch, prompt_len, new_tokens, repeats):
    import jax
    import jax.numpy as jnp

    from dew_lib import models
    from dew_lib.sampling import Sampling, generate

    model = models.build("causal_transformer", **config)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    prompt = np.random.default_rng(0).integers(0, config["vocab_size"], (batch, prompt_len)).astype(np.int32)
    lengths = np.full(batch, prompt_len, np.int32)

    def run():
        out = generate(model, variables, prompt, lengths, key=jax.random.key(0),
                       max_new_tokens=new_tokens, sampling=Sampling(temperature=0.0))
        out.tokens.block_until_ready()

    run()
    return batch * new_tokens / median_seconds(run, repeats)


def hf_rate(config, batch, prompt_len, new_tokens, repeats):
    import torch

    model = torch_llama(config, threads())
    prompt = torch.from_numpy(np.random.default_rng(0).integers(0, config["vocab_size"], (batch, prompt_len)))

    def run():
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    run()
    return batch * new_tokens / median_seconds(run, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds")
    parser.add_argument("--baseline", help="another Dew checkout, run in the same rounds")
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = dict(LLAMA_8M)
    if args.child:
        side, batch = args.child[0], int(args.child[1])
        rate = (dew_rate if side == "dew" else hf_rate)(config, batch, args.prompt, args.new, args.repeats)
        print(json.dumps({"rate": rate}))
        return
    rows = []
    common = ("--prompt", str(args.prompt), "--new", str(args.new), "--repeats", str(args.repeats))
    for batch in (1, 16):
        dew, hf, base = [], [], []
        for _ in range(args.rounds):  # alternate the sides so drift in machine load hits both
            dew.append(in_subprocess(__file__, "dew", str(batch), *common)["rate"])
            hf.append(in_subprocess(__file__, "hf", str(batch), *common)["rate"])
            if args.baseline:
                base.append(in_subprocess(__file__, "dew", str(batch), *common,
                                          pythonpath=args.baseline)["rate"])
        ratios = [d / h for d, h in zip(dew, hf)]
        rows += [(f"batch {batch}: dew tokens/s (median)", f"{statistics.median(dew):,.0f}"),
                 (f"batch {batch}: transformers tokens/s (median)", f"{statistics.median(hf):,.0f}"),
                 (f"batch {batch}: dew / transformers per round", " ".join(f"{r:.2f}" for r in ratios)),
                 (f"batch {batch}: dew / transformers (median)", f"{statistics.median(ratios):.2f}x")]
        if base:
            ratios = [d / b for d, b in zip(dew, base)]
            rows += [(f"batch {batch}: baseline dew tokens/s (median)", f"{statistics.median(base):,.0f}"),
                     (f"batch {batch}: dew / baseline per round", " ".join(f"{r:.2f}" for r in ratios)),
                     (f"batch {batch}: dew / baseline (median)", f"{statistics.median(ratios):.2f}x")]
    report(f"generate: Llama 8M, prompt {args.prompt}, {args.new} new tokens, greedy, "
           f"{threads()} threads, each side in its own process", rows)


if __name__ == "__main__":
    main()
