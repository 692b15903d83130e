"""Shared pieces of the benchmarks: the model configuration, timing and the machine's peak."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# An 8M-parameter Llama-architecture decoder (untied head), as the targets assume.
LLAMA_8M = dict(vocab_size=8192, emb_features=256, num_layers=5, num_heads=4, num_kv_heads=4,
                mlp_features=704, max_seq_len=512)


def threads() -> int:
    return int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))


def wall_times(run, repeats: int) -> list[float]:
    """Wall time of each of `repeats` calls of `run` (which must block until done)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(run, repeats: int) -> float:
    """Median wall time of `repeats` calls of `run` (which must block until done)."""
    return statistics.median(wall_times(run, repeats))


def jax_matmul_peak(size: int = 1024, repeats: int = 7, dtype: str = "float32",
                    fastest: bool = False) -> float:
    """Matmul FLOP/s that JAX reaches on this device right now: over the median run, or with
    `fastest` over the fastest one (the best the device reaches; a median counts a busy moment)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype))
    b = jax.random.normal(jax.random.key(1), (size, size), jnp.dtype(dtype))
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    times = wall_times(lambda: mm(a, b).block_until_ready(), repeats)
    return 2 * size**3 / (min(times) if fastest else statistics.median(times))


def torch_llama(config: dict, torch_threads: int):
    """The same decoder as transformers' LlamaForCausalLM, float32, its default (SDPA) attention."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(torch_threads)
    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=config["vocab_size"], hidden_size=config["emb_features"],
        intermediate_size=config["mlp_features"], num_hidden_layers=config["num_layers"],
        num_attention_heads=config["num_heads"], num_key_value_heads=config["num_kv_heads"],
        max_position_embeddings=config["max_seq_len"], rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, attention_bias=False,
    )
    return LlamaForCausalLM(hf).float().eval()


def torch_train_step(config: dict, batch: int, seq: int):
    """(model, step): one AdamW step of `torch_llama` on fixed random ids, the peer of Dew's step."""
    import torch

    model = torch_llama(config, threads()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, config["vocab_size"], (batch, seq + 1)))

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # the gradients are not state between steps

    return model, step


VECTOR_FAMILIES = (("AVX2", ("avx2",)), ("AVX-512", ("avx512f",)), ("AVX-512 BF16", ("avx512_bf16",)),
                   ("AVX-512 VNNI", ("avx512_vnni",)), ("AMX", ("amx_tile",)), ("AMX BF16", ("amx_bf16",)))


def cpu_line() -> str:
    """The CPU's model, its cores here and its vector extensions (AVX2, AVX-512, AMX), so every
    ratio a bench prints says which machine family it belongs to."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                name, _, value = line.partition(":")
                if name.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif name.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        import platform

        model = platform.processor() or platform.machine()
    have = [family for family, needs in VECTOR_FAMILIES if all(f in flags for f in needs)]
    return f"cpu: {model}, {os.cpu_count()} cores, {', '.join(have) or 'no AVX2/AVX-512/AMX'}"


_SHOWN_CPU = False


def show_cpu() -> None:
    """Print `cpu_line()` once per process: a bench's header."""
    global _SHOWN_CPU
    if not _SHOWN_CPU:
        print(cpu_line())
        _SHOWN_CPU = True


def report(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    show_cpu()
    print(f"\n== {title}")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def per_round(ratios) -> str:
    """The median ratio, then each round's."""
    return f"{np.median(ratios):.2f}x ({' '.join(f'{r:.2f}' for r in ratios)})"


def check_one_core(parser, args) -> None:
    """Stop with a usage error when `--one-core` is asked for where processes cannot be pinned."""
    if args.one_core and not hasattr(os, "sched_setaffinity"):
        parser.error("--one-core pins processes with os.sched_setaffinity, which only Linux has")


def in_subprocess(script: str, *args: str, host_devices: int = 1, pythonpath: str | None = None,
                  one_core: bool = False) -> dict:
    """Run `script --child ARGS` in a fresh interpreter and return the JSON it prints last.

    Each side of a comparison gets its own process, so one framework's thread pool never
    competes with the other's measurement. `host_devices` > 1 splits the CPU into that many
    XLA devices, which the Trainer then uses data parallel. `pythonpath` puts another checkout's
    dew_lib first. `one_core` pins the process to one core before it starts, so XLA and
    PyTorch size their thread pools to it (Linux only).
    """
    env = dict(os.environ)
    pin = None
    if one_core:
        core = min(os.sched_getaffinity(0))
        env["BENCH_THREADS"] = "1"
        pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    if host_devices > 1:  # one XLA CPU device per core: data parallel inside one process
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={host_devices}"
    out = subprocess.run([sys.executable, script, "--child", *args], capture_output=True,
                         text=True, check=False, env=env, preexec_fn=pin)
    if out.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
