"""Tables the memory planner (dew_lib/train/plan.py) and `dew plan` read: known devices'
memory and known models' configs. Kept apart so that the command line reads them without
starting JAX."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MiB = 2**20

# What the devices report as their memory (nvidia-smi's totals; TPU v5e per chip).
DEVICE_BYTES: Mapping[str, int] = {
    "h100": 81_559 * MiB, "h200": 143_771 * MiB, "a100-40": 40_960 * MiB, "a100-80": 81_920 * MiB,
    "l40s": 46_068 * MiB, "v5e": 16 * 1024 * MiB,
}

# Hugging Face configs of the Qwen3 dense models (the fields the decoder reads).
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151_936, head_dim=128,
              max_position_embeddings=40_960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
MODELS: Mapping[str, Mapping[str, Any]] = {
    name: {**_QWEN3, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": 8, "intermediate_size": mlp, "tie_word_embeddings": tied}
    for name, (hidden, layers, heads, mlp, tied) in {
        "qwen3-0.6b": (1024, 28, 16, 3072, True), "qwen3-1.7b": (2048, 28, 16, 6144, True),
        "qwen3-4b": (2560, 36, 32, 9728, True), "qwen3-8b": (4096, 36, 32, 12288, False),
        "qwen3-14b": (5120, 40, 40, 17408, False), "qwen3-32b": (5120, 64, 64, 25600, False),
    }.items()
}
STAGES = ("sft", "dpo", "grpo", "ppo")
