"""Throughput of `dew serve` over HTTP against the in-process NativeRolloutServer it wraps.

The 8M-parameter Llama of bench/common.py with the MiniMind tokenizer's 6,400-id vocabulary (so
responses carry decoded text), written with Pretrained.save in float32. Temperature 1, no
filters, the checkpoint's EOS id. For 1, 8 and 32 concurrent requests, each side with as many
slots as requests and the same prompts (`--prompt` ids) and seeds, `--new` ids each:

- http: `dew serve` launched as its own process; the bench process sends the requests at once
  (token-id prompts, logprobs=0), each on its own kept-alive connection, and the clock runs from
  the first send to the last response. The client is a few lines of asyncio streams rather than
  httpx or the openai SDK, which spend 4 to 5 ms of CPU per request here: on two cores that CPU
  would be taken from the server being measured, not from a client on another machine;
- native: a `NativeRolloutServer` in the bench process, `submit` for every prompt, from the first
  submit to the last draw.

Both sides draw the same ids (same seeds, same sampling), so tokens/s is total sampled ids over
wall time. The machine is shared, so the two sides run back to back, alternating which goes
first, and each round's ratio http / native compares runs seconds apart; neither side computes
while the other is timed. Each load runs in a fresh process; two unmeasured runs per side come
first, and compilations are cached on disk across processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import LLAMA_8M, in_subprocess, report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".pytest_cache", "jax")
TOKENIZER = os.path.join(os.environ.get("DEW_SHARED_DATA") or os.path.join(ROOT, "..", "shared", "data"),
                         "tokenizers", "minimind")
CONFIG = dict(LLAMA_8M, vocab_size=6400)


def cached_compiles():
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.abspath(CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def write_checkpoint(directory: str) -> None:
    import jax
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from dew_lib import models
    from dew_lib.models.pretrained import Pretrained

    model = models.build("causal_transformer", **CONFIG)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    pretrained = Pretrained.from_model(model, tokenizer=AutoTokenizer.from_pretrained(TOKENIZER))
    pretrained.save(variables, directory, dtype=None)


def prompts(requests: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(3, CONFIG["vocab_size"], (requests, length)).tolist()


def native_server(directory, requests, prompt_len, new_tokens):
    """A NativeRolloutServer over the checkpoint with the sampling `dew serve` gives it."""
    import dataclasses

    from dew_lib.inference import NativeRolloutServer, Server, ServeTask
    from dew_lib.models.pretrained import load_pretrained
    from dew_lib.sampling import Sampling
    from dew_lib.serve import checkpoint_eos

    pretrained, variables = load_pretrained(directory)
    _, eos = checkpoint_eos(pretrained.tokenizer, pretrained.config, pretrained.generation_config)
    sampling = dataclasses.replace(Sampling(temperature=1.0), eos_id=eos or None)
    task = ServeTask(model=pretrained.model, variables=variables, sampling=sampling)
    return NativeRolloutServer(Server.from_task(task, slots=requests, capacity=prompt_len + new_tokens))


def launch(directory, requests, capacity):
    """`dew serve` on a free port; returns (process, url)."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR=os.path.abspath(CACHE),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    server = subprocess.Popen(
        [sys.executable, "-m", "dew_lib.cli", "serve", directory, "--port", "0", "--slots", str(requests),
         "--capacity", str(capacity), "--temperature", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = ""
    while "dew serve:" not in line:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"dew serve exited with status {server.wait()} before listening")
    return server, line.split(" on ")[1].split()[0]


class Connection:
    """One kept-alive HTTP/1.1 connection that POSTs JSON and reads JSON back."""

    def __init__(self, url: str):
        self.host, port = url.removeprefix("http://").split(":")
        self.port, self.streams = int(port), None

    async def post(self, path: str, body: dict) -> dict:
        if self.streams is None:
            self.streams = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.streams
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        length = next(int(h.split(":")[1]) for h in head if h.lower().startswith("content-length:"))
        answer = json.loads(await reader.readexactly(length))
        if not head[0].split()[1].startswith("2"):
            raise RuntimeError(f"{path} answered {head[0]}: {answer}")
        return answer

    def close(self):
        if self.streams is not None:
            self.streams[1].close()


def pair(directory, requests, prompt_len, new_tokens, rounds):
    """Tokens/s of both sides, one run each per round, back to back."""
    cached_compiles()
    rows = prompts(requests, prompt_len)
    native = native_server(directory, requests, prompt_len, new_tokens)
    server, url = launch(directory, requests, prompt_len + new_tokens)
    connections = [Connection(url) for _ in rows]

    async def over_http():
        async def ask(i, prompt):
            answer = await connections[i].post("/v1/completions", {
                "prompt": prompt, "max_tokens": new_tokens, "seed": i, "logprobs": 0})
            return answer["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(ask(i, p) for i, p in enumerate(rows))))

    def in_process():
        futures = [native.submit(p, new_tokens, seed=i) for i, p in enumerate(rows)]
        return sum(len(f.result()) for f in futures)

    async def measure():
        out = {"http": [], "native": [], "tokens": set()}
        try:
            for _ in range(2):
                await over_http()
                in_process()
            for r in range(rounds):
                for side in (("http", "native") if r % 2 == 0 else ("native", "http")):
                    start = time.perf_counter()
                    tokens = await over_http() if side == "http" else in_process()
                    out[side].append(tokens / (time.perf_counter() - start))
                    out["tokens"].add(tokens)
        finally:
            for connection in connections:
                connection.close()
        return out

    try:
        out = asyncio.run(measure())
    finally:
        native.close()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    if len(out["tokens"]) != 1:
        raise RuntimeError(f"the sides drew different numbers of ids: {out['tokens']}")
    return {"http": out["http"], "native": out["native"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10, help="back-to-back measurement rounds per load")
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "DIRECTORY", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, directory, requests = args.child[0], args.child[1], int(args.child[2])
        if side == "write":
            write_checkpoint(directory)
            print(json.dumps({}))
        else:
            print(json.dumps(pair(directory, requests, args.prompt, args.new, args.rounds)))
        return
    common = ("--prompt", str(args.prompt), "--new", str(args.new), "--rounds", str(args.rounds))
    with tempfile.TemporaryDirectory() as scratch:
        directory = os.path.join(scratch, "llama-8m")
        in_subprocess(__file__, "write", directory, "0", *common)
        rows = []
        for requests in args.loads:
            out = in_subprocess(__file__, "pair", directory, str(requests), *common)
            ratios = [h / n for h, n in zip(out["http"], out["native"])]
            rows += [
                (f"{requests} requests: dew serve over HTTP, tokens/s", f"{statistics.median(out['http']):,.0f}"),
                (f"{requests} requests: NativeRolloutServer, tokens/s", f"{statistics.median(out['native']):,.0f}"),
                (f"{requests} requests: http / native (median; rounds)",
                 f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"),
            ]
    report(f"dew serve over HTTP vs in-process: prompt {args.prompt}, {args.new} new ids, temperature 1, "
           f"slots = requests, {os.cpu_count()} CPU cores", rows)


if __name__ == "__main__":
    main()
