"""Qwen3-0.6B-shaped SFT and GRPO throughput on one GPU, SFT as a two-process job and under FSDP.

The model has Qwen3-0.6B's shape (vocabulary 151,936, hidden 1,024, 28 layers, 16 query and 8
key heads of 128, MLP 3,072, tied embeddings, qk-norm; built from its Hugging Face config by
`decoder_options`) and random weights: nothing is downloaded. It computes in bfloat16 and keeps
float32 parameters and optimizer state (`dtype=bfloat16, param_dtype=float32`); attention is
the decoder's `attention_kernel="auto"` (on a GPU, cuDNN's through `jax.nn.dot_product_attention`
when cuDNN takes the shapes; the report names the kernel that ran). SFT and GRPO run on one GPU
(the first visible one). Printed:

  SFT     tokens/s of the LM step (AdamW) and its model FLOP utilization (MFU): model FLOPs per
          token (6 x matmul parameters + 12 x layers x heads x head dim x sequence, the count
          PaLM and torchtitan use) times tokens/s over the device's dense bfloat16 peak
  GRPO    tokens/s of a whole step (sampling with `dew_lib.sampling.generate` inside
          `SampledRollout`, reward, packing, then the GRPO update), prompt + completion tokens
          per second, against prime-rl's 13.3k tokens/s for Qwen3-0.6B RL on one H100 (the
          issue's anchor; that the two count tokens the same way is assumed, not checked)
  2 proc  the same SFT as a job of two processes (`dew_lib.train.launch.launch`), one GPU
          each, on the same global batch, against twice the one-process rate; skipped, saying
          why, with fewer than two GPUs (on the CPU of a dry run: one host device each)
  FSDP    the same SFT in one process under `Trainer(mesh=MeshSpec(fsdp=n))` over all n GPUs
          (a dry run: 2 host devices), the model as the memory planner builds it (bfloat16
          parameters and compute, blockwise attention, AdamW; a dry run: float32, which XLA:CPU
          compiles in half the time): tokens/s, and the planner's bytes
          per device (`dew_lib.train.plan.plan`, compiled on n CPU host devices as `dew plan` does)
          against device 0's measured peak (`memory_stats()["peak_bytes_in_use"]`, where the
          device reports it; a CPU does not); skipped, saying why, on one GPU (FSDP 1 is the SFT
          above)

The peak comes from a table of datasheet figures by `device_kind` (dense, no sparsity) and
is measured with a large bfloat16 matmul on a device the table lacks. Every measurement runs in
a fresh process (this one never initializes a GPU, so it holds none of its memory).
`--dry-run` runs every part on the CPU with a tiny model and two steps: what a test checks.

Run: `make bench-gpu` or `python bench/gpu.py [--batch 8 --seq 2048 --steps 10]`;
`python bench/gpu.py --dry-run` anywhere.

Not here: GRPO across processes or under FSDP, tensor parallelism, several hosts, real weights,
the CPU benches (train_lm.py; its `--mesh` compares FSDP 2 with DP 2 on host devices).
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
from common import in_subprocess, jax_matmul_peak, report  # noqa: E402

# Qwen3-0.6B's config.json, the fields the decoder reads (Qwen/Qwen3-0.6B on the Hugging Face hub)
QWEN3_06B_CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151_936,
                        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        tie_word_embeddings=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                        max_position_embeddings=40_960)
# --dry-run: the same architecture, small enough to compile and step in seconds on a CPU
TINY_CONFIG = dict(QWEN3_06B_CONFIG, vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
PRIME_RL_TOKENS_PER_SECOND = 13_300  # Qwen3-0.6B RL on one H100, the anchor

# Dense bfloat16 peak FLOP/s from NVIDIA's datasheets (half the "with sparsity" figure), by a
# substring of `jax.devices()[0].device_kind`, most specific first.
PEAK_BF16 = (
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h200 nvl", 835e12),
    ("gh200", 989e12),
    ("h200", 989e12),
    ("h100", 989e12),  # SXM
    ("h800", 989e12),
    ("a100", 312e12),
    ("a800", 312e12),
    ("l40s", 362e12),
    ("l4", 121e12),  # after l40s: "nvidia l4"
    ("b200", 2250e12),
)


def table_peak(device_kind: str) -> float | None:
    kind = device_kind.lower()
    for name, flops in PEAK_BF16:
        if name == "l4" and not kind.rstrip().endswith(" l4"):
            continue
        if name in kind:
            return flops
    return None


def model_shape(dry_run: bool) -> dict:
    """The decoder's options for the model's config, as a checkpoint's would be read."""
    from dew_lib.models.pretrained.families import decoder_options

    return decoder_options(TINY_CONFIG if dry_run else QWEN3_06B_CONFIG)[1]


def model_options(dry_run: bool, kernel: str, remat: bool) -> dict:
    """`model_shape` computing in bfloat16 with float32 parameters."""
    import jax.numpy as jnp

    return dict(model_shape(dry_run), dtype=jnp.bfloat16, param_dtype=jnp.float32,
                attention_kernel=kernel, remat=remat)


def flops_per_token(options: dict, seq: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters (the tied head counted once, as a matmul)
    plus 12 x layers x heads x head dim x sequence for the attention products."""
    e, layers, mlp = options["emb_features"], options["num_layers"], options["mlp_features"]
    h, kv, d = options["num_heads"], options["num_kv_heads"], options["head_dim"]
    per_layer = e * h * d + 2 * e * kv * d + h * d * e + 3 * e * mlp
    matmul_params = layers * per_layer + e * options["vocab_size"]
    return 6 * matmul_params + 12 * layers * h * d * seq


def picked_kernel(options: dict, batch: int, seq: int) -> str:
    """What `attention_kernel` runs for these shapes on this backend (decoder_attention)."""
    import jax

    from dew_lib.models.decoder_attention import pick_kernel

    d, dtype = options["head_dim"], options["dtype"]
    q = jax.ShapeDtypeStruct((batch, seq, options["num_heads"], d), dtype)
    k = jax.ShapeDtypeStruct((batch, seq, options["num_kv_heads"], d), dtype)
    return pick_kernel(options["attention_kernel"], q, k)


# ----- children: each runs in its own process ------------------------------------------------
def child_info(args) -> dict:
    import jax

    device = jax.devices()[0]
    peak, source = table_peak(device.device_kind), "datasheet, dense bfloat16"
    if peak is None:
        # bfloat16 matmuls are emulated slowly on most CPUs; a smaller square than 1024 would
        # measure dispatch overhead, and the model's own step could then beat its "peak"
        cpu = jax.default_backend() == "cpu"
        dtype, size = ("float32", 1024) if cpu else ("bfloat16", 8192)
        peak, source = jax_matmul_peak(size, 7, dtype, fastest=True), f"measured, {dtype} {size}x{size} matmul"
    return {"backend": jax.default_backend(), "kind": device.device_kind,
            "devices": jax.device_count(), "peak": peak, "peak_source": source,
            "jax": jax.__version__}


def one_gpu() -> None:
    """Show this process one GPU before JAX starts: the first alone, process i's i-th in a job
    (every process of a one-host job would otherwise take every GPU). No effect on a CPU."""
    from dew_lib.train import topology

    index = int(os.environ.get(topology.PROCESS_ID) or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)


def child_sft(args) -> dict:
    from dew_lib.train import distributed

    one_gpu()
    distributed.initialize()  # a no-op alone; joins the job under launch()
    import jax
    import optax

    from dew_lib import Dataset, LMObjective, Trainer, models
    from dew_lib.train.sinks import MemorySink

    options = model_options(args.dry_run, args.attention, args.remat)
    model = models.build("causal_transformer", **options)
    rows = np.random.default_rng(0).integers(
        0, options["vocab_size"], size=(args.batch, args.seq + 1)).astype(np.int32)

    def share(partition):  # this process's rows of the same global batch
        per = args.batch // partition.count
        return itertools.repeat({"text": rows[partition.index * per:(partition.index + 1) * per]})

    trainer = Trainer(LMObjective(model, seq_len=args.seq, ema_decay=None), optax.adamw(1e-5),
                      key=jax.random.key(0))
    sink = MemorySink()
    started = time.perf_counter()
    state = trainer.fit(Dataset(train=share, batch=args.batch), steps=args.steps + 1, log_every=1,
                        sinks=[sink])
    seconds = time.perf_counter() - started
    if not distributed.is_primary():
        return {}
    windows = [m for _, m in sink.history]
    rates = [m["tokens_per_second"] for m in windows[1:]]  # the first window compiles
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(state.params)})
    return {"rate": float(np.median(rates)), "loss": float(windows[-1]["loss"]),
            "kernel": picked_kernel(options, args.batch, args.seq),
            "param_dtypes": dtypes, "devices": jax.device_count(),
            "processes": jax.process_count(), "seconds": seconds,
            "compilations": trainer.compilations["train_step"]}


def child_grpo(args) -> dict:
    one_gpu()
    import jax
    import optax

    from dew_lib import Trainer, models
    from dew_lib.objectives import GRPOObjective
    from dew_lib.rollouts import SampledRollout
    from dew_lib.sampling import Sampling

    width = args.prompt_len + args.new
    options = model_options(args.dry_run, args.attention, args.remat)
    model = models.build("causal_transformer", **options)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, options["vocab_size"], (args.prompts, args.prompt_len)).astype(np.int32)
    prompts = {"prompt": ids, "prompt_length": np.full(args.prompts, args.prompt_len, np.int32)}

    def reward(data_source, completion, ground_truth, extra_info):
        return float(completion.count("7")) / 10  # cheap, and varies within a group

    objective = GRPOObjective(model, width - 1)
    # no EOS: every completion runs to the budget, so each step trains rows x width tokens
    rollout = SampledRollout(objective, reward=reward, groups=args.groups, max_new_tokens=args.new,
                             sampling=Sampling(temperature=1.0))
    trainer = Trainer(objective, optax.adamw(1e-6), key=jax.random.key(0), rollout=rollout)
    state = trainer._init(trainer.init_key)  # as fit starts: replicated, so step 1 recompiles nothing
    update = trainer._steps[True]  # the compiled update fit runs (as bench/grpo_step.py)
    times = {"rollout": [], "update": []}
    metrics = None
    for i in range(args.steps + 1):  # step 0 compiles sampling and the update
        started = time.perf_counter()
        batch = rollout(state, prompts, jax.random.key(i))  # waits for the sampled ids
        sampled = time.perf_counter()
        state, metrics = update(state, trainer._shard(batch))
        jax.block_until_ready(metrics)
        times["rollout"].append(sampled - started)
        times["update"].append(time.perf_counter() - sampled)
    rollout_s, update_s = (float(np.median(times[k][1:])) for k in ("rollout", "update"))
    rows = args.prompts * args.groups
    finite = float(jax.device_get(metrics["finite"][0]))
    return {"rate": rows * width / (rollout_s + update_s), "rollout_seconds": rollout_s,
            "update_seconds": update_s, "generated_per_second": rows * args.new / rollout_s,
            "update_tokens_per_second": rows * width / update_s, "rows": rows, "width": width,
            "finite": finite, "kernel": picked_kernel(options, rows, width - 1)}


def planned_dtype(dry_run: bool) -> str:
    """The FSDP part's one dtype (parameters and compute): the planner's default, bfloat16, but
    float32 on a dry run, which XLA:CPU compiles in half the time."""
    return "float32" if dry_run else "bfloat16"


def planned_options(dry_run: bool, remat: bool) -> dict:
    """`model_shape` as `dew_lib.train.plan.plan` builds it: one dtype, blockwise attention."""
    import jax.numpy as jnp

    width = jnp.dtype(planned_dtype(dry_run))
    return dict(model_shape(dry_run), dtype=width, param_dtype=width, attention_kernel="blockwise",
                remat=remat)


def child_sharded(args) -> dict:
    """SFT under FSDP over every device this process sees, the step the planner plans."""
    import jax
    import optax

    from dew_lib import Dataset, LMObjective, Trainer, models
    from dew_lib.train.mesh import MeshSpec
    from dew_lib.train.sinks import MemorySink

    devices = jax.device_count()
    model = models.build("causal_transformer", **planned_options(args.dry_run, args.remat))
    ids = np.random.default_rng(0).integers(
        0, model_shape(args.dry_run)["vocab_size"], size=(args.batch, args.seq + 1)).astype(np.int32)
    batch = {"text": ids, "text_segment_ids": np.ones_like(ids)}  # the planner's SFT batch
    trainer = Trainer(LMObjective(model, seq_len=args.seq, ema_decay=None), optax.adamw(1e-6),
                      key=jax.random.key(0), mesh=MeshSpec(fsdp=devices))
    sink = MemorySink()
    trainer.fit(Dataset(train=lambda partition: itertools.repeat(batch), batch=args.batch),
                steps=args.steps + 1, log_every=1, sinks=[sink])
    rates = [m["tokens_per_second"] for _, m in sink.history[1:]]  # the first window compiles
    stats = jax.devices()[0].memory_stats() or {}
    out = {"rate": float(np.median(rates)), "devices": devices, "kind": jax.devices()[0].device_kind,
           "peak": stats.get("peak_bytes_in_use"), "compilations": trainer.compilations["train_step"]}
    if jax.default_backend() == "cpu":  # these host devices are the planner's: plan here
        out["plan"] = child_plan(args)
    return out


def child_plan(args) -> dict:
    """The memory planner's bytes per device for `child_sharded`'s step, on CPU host devices."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts in a child of its own
    import jax

    from dew_lib.train.mesh import MeshSpec
    from dew_lib.train.plan import plan

    found = plan(TINY_CONFIG if args.dry_run else QWEN3_06B_CONFIG, stage="sft",
                 mesh=MeshSpec(fsdp=jax.device_count()), seq_len=args.seq + 1, batch=args.batch,
                 dtype=planned_dtype(args.dry_run), remat=args.remat)
    return {"state": found.state, "batch": found.batch, "temporary": found.temporary, "total": found.total}


CHILDREN = {"info": child_info, "sft": child_sft, "grpo": child_grpo, "sharded": child_sharded,
            "plan": child_plan}


# ----- the parent ----------------------------------------------------------------------------
def child_args(args, attention: str | None = None) -> list[str]:
    """The flags a child needs to measure what this run measures."""
    out = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--prompts", str(args.prompts), "--groups", str(args.groups),
           "--prompt-len", str(args.prompt_len), "--new", str(args.new),
           "--attention", attention or args.attention]
    return out + (["--dry-run"] if args.dry_run else []) + (["--remat"] if args.remat else [])


def measure(kind: str, args, notes: list[str]) -> dict | None:
    """A child's result; when "auto" attention fails (a cuDNN refusal that shows only when the
    program compiles), the note says why and the blockwise form is measured instead."""
    try:
        return in_subprocess(__file__, kind, *child_args(args))
    except RuntimeError as error:
        last = str(error).strip().splitlines()[-1]
        if args.attention == "blockwise":
            notes.append(f"{kind} failed: {last}")
            return None
        notes.append(f"{kind} with attention_kernel={args.attention!r} failed ({last}); "
                     "measured with 'blockwise'")
    try:
        return in_subprocess(__file__, kind, *child_args(args, "blockwise"))
    except RuntimeError as error:
        notes.append(f"{kind} failed with 'blockwise' too: {str(error).strip().splitlines()[-1]}")
        return None


def two_processes(args, info: dict) -> tuple[dict | None, str | None]:
    """SFT as a two-process job: `(result, None)`, or `(None, why it did not run)`."""
    from dew_lib.train.launch import launch

    if args.batch % 2:
        return None, f"batch {args.batch} does not split over two processes"
    cpu = info["backend"] == "cpu"
    if not cpu and info["devices"] < 2:
        return None, (f"{info['devices']} {info['kind']} device here; the job needs two, one per "
                      "process")
    command = [sys.executable, __file__, "--child", "sft", *child_args(args)]
    out = io.StringIO()
    # on the CPU each process gets one host device (gloo between them); on GPUs one GPU each
    code = launch(command, 2, local_devices=1 if cpu else None, out=out)
    if code != 0:
        return None, f"the two-process job failed ({code}): {out.getvalue().strip()[-500:]}"
    line = next((x for x in reversed(out.getvalue().splitlines()) if x.startswith("[0] {")), None)
    if line is None:
        return None, f"process 0 printed no result: {out.getvalue().strip()[-500:]}"
    return json.loads(line[len("[0] "):]), None


def fsdp(args, info: dict, notes: list[str]) -> tuple[dict | None, str | None]:
    """SFT under FSDP over every device, with the planner's bytes: `(result, None)`, or `(None,
    why it did not run)`; a failure goes to `notes`."""
    cpu = info["backend"] == "cpu"
    devices = 2 if cpu else info["devices"]
    if devices < 2:
        return None, (f"{info['devices']} {info['kind']} device here: FSDP 1 is the one-device SFT "
                      "above")
    if args.batch % devices:
        return None, f"batch {args.batch} does not split over {devices} devices"
    try:
        got = in_subprocess(__file__, "sharded", *child_args(args), host_devices=devices if cpu else 1)
        if "plan" not in got:  # measured on GPUs: plan on as many CPU host devices
            got["plan"] = in_subprocess(__file__, "plan", *child_args(args), host_devices=devices)
    except RuntimeError as error:
        notes.append(f"FSDP failed: {str(error).strip().splitlines()[-1]}")
        return None, "failed (see the note)"
    return got, None


def size(value: float) -> str:
    return f"{value / 1e9:.2f} GB" if value >= 1e8 else f"{value / 1e6:.2f} MB"


def fsdp_rows(got: dict, args) -> list[tuple[str, str]]:
    n, plan = got["devices"], got["plan"]
    rows = [(f"SFT {args.batch}x{args.seq}, FSDP {n}, {planned_dtype(args.dry_run)} parameters: tokens/s",
             f"{got['rate']:,.0f} ({got['rate'] / n:,.0f} per device)"),
            (f"SFT, FSDP {n}: planned bytes per device (dew plan, XLA:CPU)",
             f"{size(plan['total'])} (state {size(plan['state'])}, temporary {size(plan['temporary'])})")]
    if got["peak"] is None:
        return rows + [(f"SFT, FSDP {n}: measured peak on device 0",
                        f"not reported ({got['kind']} gives no memory_stats)")]
    return rows + [(f"SFT, FSDP {n}: measured peak on device 0 (memory_stats)",
                    f"{size(got['peak'])}, {got['peak'] / plan['total']:.2f}x the plan")]


def sft_rows(sft: dict, args, options: dict, peak: float) -> list[tuple[str, str]]:
    mfu = sft["rate"] * flops_per_token(options, args.seq) / peak
    return [(f"SFT {args.batch}x{args.seq}: tokens/s", f"{sft['rate']:,.0f}"),
            ("SFT: MFU (model FLOP/s / device peak)", f"{mfu:.3f}"),
            ("SFT: attention kernel, parameter dtypes",
             f"{sft['kernel']}, {'/'.join(sft['param_dtypes'])}")]


def grpo_rows(grpo: dict, options: dict, peak: float) -> list[tuple[str, str]]:
    update = grpo["update_tokens_per_second"]
    mfu = update * flops_per_token(options, grpo["width"] - 1) / peak
    return [(f"GRPO {grpo['rows']} rows x {grpo['width']}: tokens/s (prompt + completion, "
             "whole step)", f"{grpo['rate']:,.0f}"),
            ("GRPO / prime-rl 13.3k tokens/s (Qwen3-0.6B RL, one H100)",
             f"{grpo['rate'] / PRIME_RL_TOKENS_PER_SECOND:.3f}x"),
            ("GRPO: rollout s / update s per step",
             f"{grpo['rollout_seconds']:.3f} / {grpo['update_seconds']:.3f}"),
            ("GRPO: generated tokens/s in the rollout, update tokens/s",
             f"{grpo['generated_per_second']:,.0f}, {update:,.0f}"),
            ("GRPO: update MFU (model FLOP/s / device peak)", f"{mfu:.3f}"),
            ("GRPO: attention kernel of the update", grpo["kernel"])]


def process_rows(two: dict, sft: dict | None, args, options: dict, peak: float) -> list[tuple[str, str]]:
    per_process = two["devices"] // two["processes"]
    mfu = two["rate"] * flops_per_token(options, args.seq) / (two["devices"] * peak)
    rows = [(f"SFT, 2 processes x {per_process} device: tokens/s", f"{two['rate']:,.0f}")]
    if sft is not None:
        rows.append(("SFT, 2 processes / (2 x one process)", f"{two['rate'] / (2 * sft['rate']):.2f}"))
    return rows + [("SFT, 2 processes: MFU per device", f"{mfu:.3f}")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="every part on the CPU with a tiny model and 2 steps")
    parser.add_argument("--batch", type=int, help="SFT rows per step (default 8; dry run 4)")
    parser.add_argument("--seq", type=int, help="SFT tokens per row (default 2048; dry run 32)")
    parser.add_argument("--steps", type=int,
                        help="timed steps after the compiling one (default 10; dry run 2)")
    parser.add_argument("--prompts", type=int, help="GRPO prompts per step (default 8; dry run 2)")
    parser.add_argument("--groups", type=int, help="GRPO completions per prompt (default 8; dry run 2)")
    parser.add_argument("--prompt-len", type=int, help="GRPO prompt tokens (default 128; dry run 8)")
    parser.add_argument("--new", type=int, help="GRPO completion tokens (default 512; dry run 8)")
    parser.add_argument("--attention", default="auto", help="attention_kernel (default auto)")
    parser.add_argument("--remat", action="store_true", help="recompute each layer in the backward pass")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="measure the full shape without an accelerator (hours on a CPU)")
    parser.add_argument("--skip", default="",
                        help="comma-separated parts to skip: sft, grpo, processes, fsdp")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = (dict(batch=4, seq=32, steps=2, prompts=2, groups=2, prompt_len=8, new=8) if args.dry_run
                else dict(batch=8, seq=2048, steps=10, prompts=8, groups=8, prompt_len=128, new=512))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the children inherit it
    if args.child:
        result = CHILDREN[args.child](args)
        if result:
            print(json.dumps(result), flush=True)
        return 0
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    info = in_subprocess(__file__, "info", *child_args(args))
    if info["backend"] == "cpu" and not (args.dry_run or args.allow_cpu):
        print(f"bench/gpu.py: JAX finds no accelerator here (backend 'cpu', {info['kind']}); the "
              "Qwen3-0.6B shape would take hours. `python bench/gpu.py --dry-run` checks every part "
              "on the CPU with a tiny model; --allow-cpu measures the full shape anyway.")
        return 2
    peak = info["peak"]
    options = model_shape(args.dry_run)
    notes: list[str] = []
    rows = [("device", f"{info['kind']} x {info['devices']} ({info['backend']}, jax {info['jax']})"),
            ("device peak", f"{peak / 1e12:.1f} TFLOP/s ({info['peak_source']})"),
            ("model", f"{'tiny Qwen3-shaped (dry run)' if args.dry_run else 'Qwen3-0.6B-shaped'}, "
                      f"random weights, bfloat16 compute, float32 parameters")]
    sft = None if "sft" in skip else measure("sft", args, notes)
    if sft is not None:
        rows += sft_rows(sft, args, options, peak)
    grpo = None if "grpo" in skip else measure("grpo", args, notes)
    if grpo is not None:
        rows += grpo_rows(grpo, options, peak)
    if "processes" in skip:
        rows.append(("SFT, 2 processes", "skipped (--skip)"))
    else:
        two, why = two_processes(args, info)
        rows += [("SFT, 2 processes", f"skipped: {why}")] if two is None else \
            process_rows(two, sft, args, options, peak)
    if "fsdp" in skip:
        rows.append(("SFT, FSDP", "skipped (--skip)"))
    else:
        sharded, why = fsdp(args, info, notes)
        rows += [("SFT, FSDP", f"skipped: {why}")] if sharded is None else fsdp_rows(sharded, args)
    rows += [("note", note) for note in notes]
    report(f"bench-gpu: {'DRY RUN on CPU, tiny model' if args.dry_run else 'Qwen3-0.6B shape'}, "
           f"{args.steps} timed steps each", rows)
    return 0 if sft is not None or "sft" in skip else 1


if __name__ == "__main__":
    sys.exit(main())
