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

# Hugging Face configs of the Qwen3 dense models and of mixtures of experts (the fields the
# decoder and the planner's count read), as their checkpoints on the Hub write them.
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
_QWEN_MOE = dict(vocab_size=151_936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
                 decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None,
                 router_aux_loss_coef=0.001)
MOE_MODELS: Mapping[str, Mapping[str, Any]] = {
    "qwen3-30b-a3b": {**_QWEN_MOE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "max_position_embeddings": 40_960, "attention_bias": False},
    "qwen3-235b-a22b": {**_QWEN_MOE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                        "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
                        "norm_topk_prob": True, "max_position_embeddings": 40_960, "attention_bias": False},
    "qwen1.5-moe-a2.7b": {**_QWEN_MOE, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                          "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
                          "norm_topk_prob": False, "max_position_embeddings": 8192},
    "qwen2-57b-a14b": {**_QWEN_MOE, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                       "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                       "num_key_value_heads": 4, "intermediate_size": 18944, "moe_intermediate_size": 2560,
                       "shared_expert_intermediate_size": 20480, "num_experts": 64, "num_experts_per_tok": 8,
                       "norm_topk_prob": False, "max_position_embeddings": 32_768},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32_000,
                     "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                     "num_experts_per_tok": 2, "max_position_embeddings": 32_768, "rope_theta": 1_000_000.0,
                     "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False,
                     "router_aux_loss_coef": 0.02},
}
MODELS = {**MODELS, **MOE_MODELS}
STAGES = ("sft", "dpo", "grpo", "ppo", "distill")
