"""What LoRA saves against training every weight, measured in one run.

1. Memory, Qwen3-0.6B GRPO (AdamW, the frozen reference at beta 0.01, bfloat16, one row of 1,024
   ids, one device): the planner (`dew_lib.train.plan.measure`) compiles the update with every
   weight trained and with rank-16 adapters on all seven projections, and prints the optimizer
   state, the reference, the gradient sum and XLA's temporary peak of both, with their ratios
   (issue targets: optimizer state at most 2% of the full one; the reference's bytes are saved
   whole, since the adapters' reference is the base with them off).
2. Speed, the LM step of a 4-layer, 512-wide decoder (16 rows of 256 ids): tokens/s with every
   weight trained and with rank-16 all-linear adapters, in alternating rounds; LoRA / full per
   round (target: 1.0x or more, i.e. no slower).
3. Push bytes, the same decoder: the PEFT adapter a LoRA push writes against the bfloat16
   checkpoint a full push writes (target: at most 2%), and the same ratio for Qwen3-0.6B from
   the tensors' shapes.

Run: `python bench/lora.py [--rounds N] [--skip-memory]` (about 4 minutes on two cores, the
0.6B compiles most of it).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from common import per_round, report  # noqa: E402

RANK = 16
MEDIUM = dict(vocab_size=8192, emb_features=512, num_layers=4, num_heads=8, mlp_features=1536, max_seq_len=256)
GB = 1e9


def adapters():
    from dew_lib.models import lora

    return lora.LoRA(rank=RANK, alpha=2 * RANK, targets="all-linear")


def memory() -> list[tuple[str, str]]:
    """Planned bytes of Qwen3-0.6B's GRPO update, full and with adapters."""
    import jax
    import jax.numpy as jnp
    import optax

    from dew_lib import models
    from dew_lib.models.pretrained.families import decoder_options
    from dew_lib.objectives import GRPOObjective
    from dew_lib.plan_tables import MODELS
    from dew_lib.train.mesh import MeshSpec
    from dew_lib.train.plan import measure
    from dew_lib.train.trainer import Trainer

    _, options = decoder_options(dict(MODELS["qwen3-0.6b"]))
    base = models.build("causal_transformer", **{**options, "max_seq_len": 1024}, dtype=jnp.bfloat16,
                        param_dtype=jnp.bfloat16, attention_kernel="blockwise")
    plans = {}
    for name, model in (("full", base), ("lora", base.clone(lora=adapters()))):
        trainer = Trainer(GRPOObjective(model, seq_len=1023, beta=0.01), optax.adamw(1e-6),
                          key=jax.random.key(0), mesh=MeshSpec(data=1))
        plans[name] = measure(trainer, "grpo", rows=1, width=1024, dtype="bfloat16")
    full, low = plans["full"], plans["lora"]
    rows = [("model", "Qwen3-0.6B GRPO, 1 x 1024 ids, bfloat16, AdamW, reference at beta 0.01")]
    for label, attribute in (("parameters", "parameters"), ("optimizer state", "optimizer"),
                             ("reference", "reference"), ("gradient sum", "gradients"),
                             ("temporary peak (XLA)", "temporary"), ("total", "total")):
        a, b = getattr(full, attribute), getattr(low, attribute)
        ratio = f"{b / a:.4f}x" if a else "-"
        rows.append((label, f"full {a / GB:7.3f} GB   lora {b / GB:7.3f} GB   lora/full {ratio}"))
    rows.append(("reference saved", f"{(full.reference - low.reference) / GB:.3f} GB"))
    return rows


def tokens_per_second(adapted: bool, steps: int) -> float:
    """Median tokens/s of the LM step on MEDIUM, every weight or adapters only."""
    import jax
    import jax.numpy as jnp
    import optax

    from dew_lib import Dataset, LMObjective, Trainer, models
    from dew_lib.models import lora
    from dew_lib.train.sinks import MemorySink

    model = models.build("causal_transformer", **MEDIUM)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    if adapted:
        model, variables = lora.attach(model, variables, adapters(), jax.random.key(1))
    rows = np.random.default_rng(0).integers(0, MEDIUM["vocab_size"], size=(16, 257)).astype(np.int32)
    data = Dataset(train=lambda partition: itertools.repeat({"text": rows}), batch=16)
    trainer = Trainer(LMObjective(model, seq_len=256, pretrained=variables, ema_decay=None), optax.adamw(1e-4),
                      key=jax.random.key(0))
    sink = MemorySink()
    trainer.fit(data, steps=steps + 2, log_every=1, sinks=[sink])
    return float(np.median([metrics["tokens_per_second"] for _, metrics in sink.history[2:]]))


def speed(rounds: int, steps: int) -> list[tuple[str, str]]:
    rates: dict[str, list[float]] = {"full": [], "lora": []}
    for _ in range(rounds):
        for name in ("full", "lora"):
            rates[name].append(tokens_per_second(name == "lora", steps))
    ratios = [b / a for a, b in zip(rates["full"], rates["lora"], strict=True)]
    return [("model", "LM step, 4 layers x 512, vocabulary 8,192, 16 x 256 ids, float32"),
            ("full tokens/s", f"{np.median(rates['full']):,.0f}"),
            ("lora tokens/s", f"{np.median(rates['lora']):,.0f}"),
            ("lora / full", per_round(ratios))]


def push_bytes() -> list[tuple[str, str]]:
    """Bytes a push writes: the PEFT adapter against the bfloat16 checkpoint."""
    import jax
    import jax.numpy as jnp

    from dew_lib import models
    from dew_lib.models import Pretrained, lora, save_adapter
    from dew_lib.models.pretrained.families import decoder_options
    from dew_lib.plan_tables import MODELS

    model = models.build("causal_transformer", **MEDIUM)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    adapted, with_adapters = lora.attach(model, variables, adapters(), jax.random.key(1))
    with tempfile.TemporaryDirectory() as directory:
        full = Pretrained.from_model(model).save(variables, os.path.join(directory, "full"), dtype=jnp.bfloat16)
        adapter = save_adapter(os.path.join(directory, "adapter"), adapted, with_adapters)
        full_bytes = sum(os.path.getsize(os.path.join(full, f)) for f in os.listdir(full) if f.endswith(".safetensors"))
        adapter_bytes = os.path.getsize(os.path.join(adapter, "adapter_model.safetensors"))
    _, options = decoder_options(dict(MODELS["qwen3-0.6b"]))
    shapes = jax.eval_shape(lambda: lora.attach(*_abstract(options), adapters(), jax.random.key(1))[1])
    counts = {"lora": 0, "base": 0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        counts["lora" if lora.is_adapter(path) else "base"] += math.prod(leaf.shape)
    return [("this decoder", f"adapter {adapter_bytes / 1e6:.2f} MB, checkpoint {full_bytes / 1e6:.2f} MB, "
                             f"adapter/full {adapter_bytes / full_bytes:.4f}x"),
            ("Qwen3-0.6B (shapes)", f"adapter {counts['lora'] * 2 / 1e6:.1f} MB, checkpoint "
                                    f"{counts['base'] * 2 / 1e6:.1f} MB, "
                                    f"adapter/full {counts['lora'] / counts['base']:.4f}x")]


def _abstract(options):
    """Qwen3-0.6B's model and its variables as shapes, for `jax.eval_shape`."""
    import jax
    import jax.numpy as jnp

    from dew_lib import models

    model = models.build("causal_transformer", **options, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return model, model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the speed part")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--skip-memory", action="store_true", help="leave out the Qwen3-0.6B compiles")
    args = parser.parse_args()
    if not args.skip_memory:
        report("memory (planner): full fine-tune against rank-16 LoRA", memory())
    report("step speed: full fine-tune against rank-16 LoRA", speed(args.rounds, args.steps))
    report("push bytes: full checkpoint against the adapter", push_bytes())


if __name__ == "__main__":
    main()
