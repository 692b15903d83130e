"""Hugging Face checkpoints in and out of Dew's decoder (Qwen3, Qwen2, Llama, Qwen3-MoE, Qwen2-MoE,
Mixtral; safetensors).

`load_pretrained(directory)` gives the model, its variables and its tokenizer;
`Pretrained.save(variables, directory)` writes a directory transformers, vLLM and SGLang load;
`Pretrained.export(variables)` yields the same tensors by name. See docs/hf_checkpoints.md.
`load_adapter` and `save_adapter` read and write PEFT's LoRA adapter files (docs/lora.md).
"""

from dew_lib.models.pretrained.families import FAMILIES, SUPPORTED, Family, UnsupportedCheckpoint
from dew_lib.models.pretrained.files import CheckpointError
from dew_lib.models.pretrained.peft import load_adapter, save_adapter
from dew_lib.models.pretrained.pretrained import Loaded, Pretrained, load_pretrained

__all__ = [
    "FAMILIES",
    "SUPPORTED",
    "CheckpointError",
    "Family",
    "Loaded",
    "Pretrained",
    "UnsupportedCheckpoint",
    "load_adapter",
    "load_pretrained",
    "save_adapter",
]
