"""Where a training step's time goes: one LM step of the bench model, profiled per XLA op.

Builds the same Trainer step as `bench/train_lm.py`, runs it a few times under
`jax.profiler`, and sums the device time of each HLO instruction. Each instruction is put in a
kind read from the compiled HLO (matmul, transpose/copy, concatenate, reduce, elementwise
fusion, loop, ...), and the kinds and the largest instructions are printed with their share.
Run: `python bench/profile_step.py [--batch 16 --seq 256 --steps 3 --top 25]`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import LLAMA_8M  # noqa: E402

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^=]*?\s([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")


def hlo_kinds(text: str) -> dict[str, str]:
    """`instruction name -> kind` for every instruction of the compiled module text."""
    bodies: dict[str, list[str]] = collections.defaultdict(list)
    opcodes: dict[str, tuple[str, str, str]] = {}  # name -> (opcode, computation, line)
    current = None
    for line in text.splitlines():
        if not line.startswith(" ") and (m := _COMPUTATION.match(line.strip())) and "{" in line:
            current = m.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            opcodes[m.group(1)] = (m.group(2), current, line)
            bodies[current].append(m.group(2))

    def kind(name: str) -> str:
        opcode, _, line = opcodes[name]
        if opcode == "fusion":
            called = _CALLS.search(line)
            ops = set(bodies.get(called.group(1), [])) if called else set()
            if "kind=kCustom" in line or "__ynn" in line or "ynn" in name:
                return "matmul (ynn)" if ops & {"dot", "convolution"} or "ynn" in name else "custom fusion"
            for group, members in (("matmul", {"dot", "convolution"}), ("scatter/gather", {"scatter", "gather"}),
                                   ("reduce", {"reduce", "reduce-window"}), ("concatenate", {"concatenate"}),
                                   ("transpose/copy", {"transpose", "copy"})):
                if ops & members:
                    return f"fusion: {group}"
            return "fusion: elementwise"
        if opcode in ("dot", "convolution", "custom-call"):
            return "matmul" if opcode != "custom-call" else "custom-call"
        if opcode in ("copy", "transpose"):
            return "transpose/copy"
        return opcode

    return {name: kind(name) for name in opcodes}, {name: _brief(v[2]) for name, v in opcodes.items()}


def _brief(line: str) -> str:
    """The result type and the operands' types of one instruction line, shortened."""
    text = line.split("=", 1)[1].strip()
    text = re.sub(r"\{[0-9,]*\}", "", text)  # layouts
    text = text.split(", metadata=")[0].split(", backend_config=")[0]
    return text[:150]


def uncovered_ms(spans: list[tuple[float, float]]) -> float:
    """Milliseconds between the first start and the last end of `spans` (ns) that no span covers."""
    gaps, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is not None and start > reach:
            gaps += start - reach
        reach = end if reach is None else max(reach, end)
    return gaps / 1e6


def build_step(config, batch, seq, **objective_options):
    import jax
    import optax

    from dew_lib import LMObjective, Trainer, models

    model = models.build("causal_transformer", **config)
    trainer = Trainer(LMObjective(model, seq_len=seq, ema_decay=None, **objective_options),
                      optax.adamw(1e-4), key=jax.random.key(0))
    state = trainer.initial_state()
    rows = np.random.default_rng(0).integers(0, config["vocab_size"], (batch, seq + 1)).astype(np.int32)
    sharded = trainer._shard({"text": rows})
    step = trainer._steps[True]
    return step, state, sharded


def main():
    import jax
    from jax.profiler import ProfileData

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before timing and profiling")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--options", default="{}", help="model options as JSON, e.g. '{\"scan_layers\": false}'")
    args = parser.parse_args()
    config = dict(LLAMA_8M, max_seq_len=max(LLAMA_8M["max_seq_len"], args.seq))
    if args.vocab:
        config["vocab_size"] = args.vocab
    config.update(json.loads(args.options))
    step, state, batch = build_step(config, args.batch, args.seq)
    compiled = step.lower(state, batch).compile()
    kinds, briefs = hlo_kinds(compiled.as_text())
    for _ in range(args.warmup):  # the first steps touch fresh pages and run up to 4x slower
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(args.steps):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    wall = (time.perf_counter() - start) / args.steps
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory)
        for _ in range(args.steps):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        path = sorted(glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True))[-1]
        profile = ProfileData.from_file(path)
    per_op: collections.Counter = collections.Counter()
    spans = []
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats and str(stats.get("hlo_module", "")).startswith("jit_step_fn"):
                    per_op[stats["hlo_op"]] += event.duration_ns / 1e6 / args.steps
                    spans.append((event.start_ns, event.start_ns + event.duration_ns))
    total = sum(per_op.values())
    idle = uncovered_ms(spans) / args.steps
    by_kind: collections.Counter = collections.Counter()
    for name, ms in per_op.items():
        by_kind[kinds.get(name, "?")] += ms
    print(f"step: batch {args.batch} x {args.seq}, vocab {config['vocab_size']}: {wall * 1e3:.0f} ms wall, "
          f"{total:.0f} ms op time summed over threads")
    print(f"  {idle:.0f} ms of each step ran with no op recorded on any thread: mostly the matmuls XLA "
          f"emits itself, which finish on Eigen's thread pool after their op's event has closed")
    for name, ms in by_kind.most_common():
        print(f"  {name:<24} {ms:8.1f} ms  {ms / total:5.1%}")
    print("largest instructions:")
    for name, ms in per_op.most_common(args.top):
        print(f"  {name:<28} {kinds.get(name, '?'):<22} {ms:8.1f} ms  {ms / total:5.1%}  {briefs.get(name, '')}")


if __name__ == "__main__":
    main()
