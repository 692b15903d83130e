"""Decode throughput of the native rollout server against `dew_lib.sampling.generate`.

The 8M-parameter Llama of bench/common.py, temperature-1 sampling without EOS, so every request
draws exactly `--new` ids after a `--prompt`-id prompt. For 1, 8 and 32 concurrent requests:

- server: `NativeRolloutServer` with as many slots as requests; the clock runs from the first
  `submit` to the last draw (prefills included);
- generate: one `generate` call over the same prompts as one batch (its batched prefill included).

Each side runs in its own process, rounds alternate, and the table shows medians and the ratio
server / generate per round. A second server row keeps 32 slots for every load, the way a server
sized for its peak serves a lighter one: every call decodes all its slots, busy or not.
Compilations are cached on disk across the child processes (outside the timed runs either way).
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
from common import LLAMA_8M, in_subprocess, median_seconds, report  # noqa: E402

CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".pytest_cache", "jax")


def setup(config, requests, prompt_len):
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_compilation_cache_dir", os.path.abspath(CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from dew_lib import models

    model = models.build("causal_transformer", **config)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    prompts = np.random.default_rng(0).integers(1, config["vocab_size"], (requests, prompt_len))
    return model, variables, prompts.astype(np.int32)


def server_rate(config, requests, slots, prompt_len, new_tokens, repeats):
    from dew_lib.inference import NativeRolloutServer, Server, ServeTask
    from dew_lib.sampling import Sampling

    model, variables, prompts = setup(config, requests, prompt_len)
    task = ServeTask(model=model, variables=variables, sampling=Sampling(temperature=1.0))
    with NativeRolloutServer(Server.from_task(task, slots=slots, capacity=prompt_len + new_tokens)) as server:
        def run():
            futures = [server.submit(p, new_tokens, seed=i) for i, p in enumerate(prompts)]
            assert all(len(f.result()) == new_tokens for f in futures)

        run()  # compiles the decode and the prefill
        start = time.perf_counter()
        rate = requests * new_tokens / median_seconds(run, repeats)
        compilations = dict(server.server.compilations)
    return {"rate": rate, "compilations": compilations, "seconds": time.perf_counter() - start}


def generate_rate(config, requests, prompt_len, new_tokens, repeats):
    import jax

    from dew_lib.sampling import Sampling, generate

    model, variables, prompts = setup(config, requests, prompt_len)
    lengths = np.full(requests, prompt_len, np.int32)

    def run():
        out = generate(model, variables, prompts, lengths, key=jax.random.key(0),
                       max_new_tokens=new_tokens, sampling=Sampling(temperature=1.0))
        out.tokens.block_until_ready()

    run()
    return {"rate": requests * new_tokens / median_seconds(run, repeats)}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds")
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "REQUESTS", "SLOTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = dict(LLAMA_8M)
    if args.child:
        side, requests, slots = args.child[0], int(args.child[1]), int(args.child[2])
        if side == "server":
            out = server_rate(config, requests, slots, args.prompt, args.new, args.repeats)
        else:
            out = generate_rate(config, requests, args.prompt, args.new, args.repeats)
        print(json.dumps(out))
        return
    common = ("--prompt", str(args.prompt), "--new", str(args.new), "--repeats", str(args.repeats))
    peak = max(args.loads)
    rows = []
    for requests in args.loads:
        sized, full, peer = [], [], []
        for _ in range(args.rounds):  # alternate the sides so drift in machine load hits all
            sized.append(in_subprocess(__file__, "server", str(requests), str(requests), *common)["rate"])
            if requests != peak:
                full.append(in_subprocess(__file__, "server", str(requests), str(peak), *common)["rate"])
            peer.append(in_subprocess(__file__, "generate", str(requests), "0", *common)["rate"])
        rows.append((f"{requests} requests: server, {requests} slots, tokens/s", f"{statistics.median(sized):,.0f}"))
        if full:
            rows.append((f"{requests} requests: server, {peak} slots, tokens/s", f"{statistics.median(full):,.0f}"))
        rows.append((f"{requests} requests: generate, batch {requests}, tokens/s", f"{statistics.median(peer):,.0f}"))
        ratios = [s / g for s, g in zip(sized, peer)]
        rows.append((f"{requests} requests: server / generate (median; rounds)",
                     f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"))
        if full:
            ratios = [s / g for s, g in zip(full, peer)]
            rows.append((f"{requests} requests: {peak}-slot server / generate (median; rounds)",
                         f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"))
    report(f"native rollout server: prompt {args.prompt}, {args.new} new ids, temperature 1, "
           f"{os.cpu_count()} CPU cores", rows)


if __name__ == "__main__":
    main()
