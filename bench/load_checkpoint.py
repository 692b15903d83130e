"""How fast and how lean `load_pretrained` is, against reading the same files with safetensors.

    .venv/bin/python bench/load_checkpoint.py [--dtype bfloat16|float32] [--repeats 3]

Writes a random checkpoint with the shapes of Qwen3-0.6B (596M parameters: 1.19 GB in bfloat16,
2.4 GB in float32; tied embeddings; two shards with an index) to a temporary directory. Then, each
in a fresh subprocess with the files already in the page cache:

- peer: `safetensors.numpy.load_file` on every shard, keeping every tensor (a host state dict);
- dew:  `load_pretrained(directory, dtype=<the stored dtype>)`, waiting until every parameter is
  on the device (here the CPU device, so device memory is host memory and counts in RSS).

It prints load seconds (best and median wall time, and best CPU time, which shared machines
disturb less) and peak resident memory above the process's resident memory before the load, as
a multiple of the checkpoint's size, and the ratios dew / peer. Targets: peak at most 1.5x the
checkpoint, load time at most 1.5x the peer's.

Dew does more than the peer by necessity: Flax kernels are the transpose of the stored
`[out, in]` weights, so about three quarters of the bytes are transposed on their way to the
device. Tensors that need no transpose or cast are read straight into the buffer the device
adopts, so they cost what the peer pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import show_cpu  # noqa: E402

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)

MEASURE = r"""
import json, os, resource, sys, time
from pathlib import Path

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

kind, directory = sys.argv[1], Path(sys.argv[2])
if kind == "peer":
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, as jax does for Dew)
    from safetensors.numpy import load_file
    before = rss()
    start, cpu_start = time.perf_counter(), cpu()
    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard))
    seconds = time.perf_counter() - start
    assert sum(a.nbytes for a in state.values()) > 0
else:
    import jax
    import jax.numpy as jnp
    from dew_lib.models import load_pretrained
    jax.device_put(jnp.zeros(8)).block_until_ready()  # start the backend outside the timing
    before = rss()
    start, cpu_start = time.perf_counter(), cpu()
    pretrained, variables = load_pretrained(directory, dtype=sys.argv[3], tokenizer=False)
    jax.block_until_ready(variables)
    seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu() - cpu_start,
                  "peak_above_start": peak - before, "peak": peak}))
"""


def write_checkpoint(directory: Path, dtype: str) -> int:
    """A random Qwen3-0.6B-shaped checkpoint, written with safetensors alone; returns its bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    numpy_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    c = QWEN3_06B
    e, h, kv, d, m = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                      c["head_dim"], c["intermediate_size"])
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], e)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": (h * d, e), f"{p}.self_attn.k_proj.weight": (kv * d, e),
            f"{p}.self_attn.v_proj.weight": (kv * d, e), f"{p}.self_attn.o_proj.weight": (e, h * d),
            f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,),
            f"{p}.mlp.gate_proj.weight": (m, e), f"{p}.mlp.up_proj.weight": (m, e),
            f"{p}.mlp.down_proj.weight": (e, m),
            f"{p}.input_layernorm.weight": (e,), f"{p}.post_attention_layernorm.weight": (e,),
        })
    shapes["model.norm.weight"] = (e,)
    # Values do not matter for loading; slices of one random pool keep generation fast.
    pool = (np.random.default_rng(0).standard_normal(e * c["vocab_size"], np.float32) * 0.02
            ).astype(numpy_dtype)
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map, total = {}, 0
    for i, group in enumerate(halves):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        tensors = {n: pool[: int(np.prod(shapes[n]))].reshape(shapes[n]).copy() for n in group}
        save_file(tensors, directory / file, metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **c,
              "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "dtype": dtype,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    (directory / "config.json").write_text(json.dumps(config))
    return total


def measure(kind: str, directory: Path, dtype: str) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, kind, str(directory), dtype],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{kind} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    show_cpu()
    with tempfile.TemporaryDirectory(prefix="dew-bench-load-") as tmp:
        directory = Path(tmp)
        size = write_checkpoint(directory, args.dtype)
        for shard in directory.glob("*.safetensors"):  # warm the page cache for both sides
            with open(shard, "rb") as f:
                while f.read(1 << 24):
                    pass
        runs = {"peer": [], "dew": []}
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits both
            for kind in runs:
                runs[kind].append(measure(kind, directory, args.dtype))
    print(f"checkpoint: Qwen3-0.6B shapes, {args.dtype}, {size / 1e9:.2f} GB in 2 shards; "
          f"{args.repeats} fresh processes per side, interleaved")
    summary = {}
    for kind, results in runs.items():
        wall = sorted(r["seconds"] for r in results)
        busy = sorted(r["cpu_seconds"] for r in results)
        peak = statistics.median(r["peak_above_start"] for r in results) / size
        total = statistics.median(r["peak"] for r in results) / 1e9
        summary[kind] = (wall[0], statistics.median(wall), busy[0], peak)
        print(f"{kind:5} load: best {wall[0]:5.2f} s, median {statistics.median(wall):5.2f} s, "
              f"best CPU {busy[0]:5.2f} s; peak RSS above start {peak:4.2f}x checkpoint "
              f"(process peak {total:.2f} GB)")
    dew, peer = summary["dew"], summary["peer"]
    print(f"dew / safetensors.numpy load time: best {dew[0] / peer[0]:.2f}x, median "
          f"{dew[1] / peer[1]:.2f}x, CPU {dew[2] / peer[2]:.2f}x (target <= 1.5x)")
    print(f"dew peak memory: {dew[3]:.2f}x checkpoint (target <= 1.5x); "
          f"safetensors.numpy: {peer[3]:.2f}x")

if __name__ == "__main__":
    main()
