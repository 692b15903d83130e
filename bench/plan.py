"""What fits: the memory planner's table for Qwen3 sizes under GRPO at 4,096 ids, on H200s and H100s.

For Qwen3-0.6B, 8B, 14B and 32B (`dew_lib/plan_tables.py`'s configs) the GRPO update (AdamW, the
frozen reference, the pipeline's objective) is compiled by `dew_lib.train.plan.plan`, as `dew plan`
does, on abstract shapes over CPU host devices shaped like the target: 8 devices under FSDP 8, and
for 32B also 16 devices under FSDP 16 and FSDP 8 x TP 2. Each case runs in a fresh process with
`--xla_force_host_platform_device_count` set before JAX starts, with and without remat. One row
of 4,096 ids per data x fsdp slice (`--rows-per-device`), so a step trains 8 (16) rows. Printed
per case: device 0's parameters, optimizer state, reference, XLA's temporary peak and total in GB
(10^9 bytes), and for an H200 (143,771 MiB) and an H100 (81,559 MiB) the share of the device and
the verdict; then one ratio line per model, and the largest model of the table that fits per stage
(sft, dpo, grpo, ppo) on 8 of each device under FSDP 8 with remat (DPO: one pair per device;
PPO: with its value head).

The state's bytes are exact; the temporary peak is XLA:CPU's estimate, not XLA:GPU's (see
`dew_lib/train/plan.py`). Nothing is allocated beyond what compiling takes: on a 2-core AMD EPYC
(idle) each case compiled in 14-18 s, the whole run (17 compiles) in 5.3 minutes, `--quick`
(0.6B and 8B only, 7 compiles) in 2.

Run: `python bench/plan.py [--quick] [--seq-len 4096] [--rows-per-device 1]`.

Not here: multi-host meshes, data replicas (they do not change a device's bytes), accumulation,
float32 parameters, a GPU's own compile (bench/gpu.py compares the plan with a GPU's peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common import in_subprocess, report  # noqa: E402

from dew_lib.plan_tables import DEVICE_BYTES, MODELS, STAGES  # noqa: E402  (no JAX import)

GB = 10**9
DEVICES = ("h200", "h100")
TABLE_MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
QUICK_MODELS = ("qwen3-0.6b", "qwen3-8b")
EIGHT = "fsdp=8"
MESHES = {"qwen3-32b": (EIGHT, "fsdp=16", "fsdp=8,tensor=2")}  # the others: FSDP 8 only


def child(model: str, stage: str, mesh: str, seq_len: int, rows: int, remat: bool) -> dict:
    """Plan one case on this process's host devices; its numbers and the compile's seconds."""
    from dew_lib.train.mesh import MeshSpec
    from dew_lib.train.plan import model_config, plan

    spec = MeshSpec.parse(mesh)
    shards = (spec.data or 1) * spec.fsdp
    start = time.perf_counter()
    found = plan(model_config(model), stage=stage, mesh=spec, seq_len=seq_len, batch=rows * shards,
                 remat=remat)
    return {**dataclasses.asdict(found), "total": found.total, "seconds": time.perf_counter() - start}


def devices_of(mesh: str) -> int:
    sizes = [int(part.partition("=")[2]) for part in mesh.split(",")]
    count = 1
    for size in sizes:
        count *= size
    return count


class Planner:
    """Runs each case once, in its own process, and remembers it."""

    def __init__(self, seq_len: int, rows: int):
        self.seq_len, self.rows, self.done = seq_len, rows, {}

    def __call__(self, model: str, stage: str, mesh: str, remat: bool) -> dict:
        key = (model, stage, mesh, remat)
        if key not in self.done:
            flags = ["--seq-len", str(self.seq_len), "--rows-per-device", str(self.rows)]
            self.done[key] = in_subprocess(__file__, model, stage, mesh, "1" if remat else "0", *flags,
                                           host_devices=devices_of(mesh))
        return self.done[key]


def share(found: dict, device: str) -> float:
    return found["total"] / DEVICE_BYTES[device]


def verdict(found: dict, device: str) -> str:
    return f"{share(found, device):.0%} {'fits' if share(found, device) <= 1 else 'NO'}"


def table_row(model: str, mesh: str, remat: bool, found: dict) -> str:
    parts = [found[name] / GB for name in ("parameters", "optimizer", "reference", "temporary", "total")]
    cells = [model, mesh, str(devices_of(mesh)), "yes" if remat else "no",
             *(f"{value:.2f}" for value in parts), *(verdict(found, device) for device in DEVICES),
             f"{found['seconds']:.0f}"]
    return "| " + " | ".join(cells) + " |"


def largest_fitting(planner: Planner, stage: str, models: list[str]) -> dict[str, str]:
    """Per device, the largest of `models` whose `stage` fits 8 devices under FSDP 8 with remat:
    from the largest down, stopping once the smallest device fits (every smaller model then does)."""
    best: dict[str, str] = {}
    for model in sorted(models, key=lambda name: -_parameters(name)):
        found = planner(model, stage, EIGHT, True)
        for device in DEVICES:
            if device not in best and share(found, device) <= 1:
                best[device] = f"{model} ({share(found, device):.0%})"
        if len(best) == len(DEVICES):
            break
    return {device: best.get(device, "none of the table") for device in DEVICES}


def _parameters(name: str) -> int:
    """A model's parameter count from its config, for ordering by size."""
    c = MODELS[name]
    e, layers, mlp, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    per_layer = e * heads * d * 2 + 2 * e * kv * d + 3 * e * mlp
    return layers * per_layer + vocab * e * (1 if c["tie_word_embeddings"] else 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Qwen3-0.6B and 8B only (about 2 minutes)")
    parser.add_argument("--seq-len", type=int, default=4096, help="ids per row (default 4096)")
    parser.add_argument("--rows-per-device", type=int, default=1,
                        help="rows (DPO: pairs) per data x fsdp slice a step (default 1)")
    parser.add_argument("--no-fits", action="store_true", help="skip the largest-model-per-stage search")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "STAGE", "MESH", "REMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, stage, mesh, remat = args.child
        print(json.dumps(child(model, stage, mesh, args.seq_len, args.rows_per_device, remat == "1")))
        return 0
    os.environ["JAX_PLATFORMS"] = "cpu"  # the children plan on host devices, as `dew plan` does
    started = time.perf_counter()
    models = [name for name in (QUICK_MODELS if args.quick else TABLE_MODELS) if name in MODELS]
    planner = Planner(args.seq_len, args.rows_per_device)
    print(f"GRPO, {args.seq_len} ids a row, {args.rows_per_device} row(s) per device, bfloat16, AdamW, "
          "frozen reference; GB per device (device 0); share of an H200 / H100; compile seconds")
    print("| model | mesh | devices | remat | params | optimizer | reference | temporary | total "
          "| H200 | H100 | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    for model in models:
        for mesh in MESHES.get(model, (EIGHT,)):
            shares = []
            for remat in (False, True):
                found = planner(model, "grpo", mesh, remat)
                print(table_row(model, mesh, remat, found), flush=True)
                shares.append(" / ".join(f"{share(found, d):.2f}" for d in DEVICES))
            rows.append((f"{model} GRPO {mesh}: total / H200, H100 memory (no remat; remat)",
                         f"{shares[0]}; {shares[1]}"))
    if not args.no_fits:
        candidates = [name for name in MODELS if not args.quick or name in QUICK_MODELS]
        for stage in STAGES:
            best = largest_fitting(planner, stage, candidates)
            rows.append((f"largest fitting 8 devices, FSDP 8, remat: {stage}",
                         ", ".join(f"{device.upper()} {best[device]}" for device in DEVICES)))
    rows.append(("compiles, wall time", f"{len(planner.done)}, {time.perf_counter() - started:.0f} s"))
    report(f"plan: XLA:CPU's plan of one step per device, {args.seq_len} ids a row, "
           f"{args.rows_per_device} row(s) per device", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
