"""Hugging Face `config.json` <-> decoder options for the causal-LM families Dew can load.

Each supported architecture (Qwen3, Qwen2/Qwen2.5, Llama 2/3.x) is one `Family` row. Reading a
config maps its fields onto `CausalTransformer` options and refuses every setting that would change
the math in a way the decoder does not reproduce (sliding windows, unknown rope types, mixture of
experts, output-projection biases, quantized weights, ...), so an unsupported checkpoint fails at
load time instead of producing a plausible but wrong model.

Not here: tensors (see `layout`) and files (see `files`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dew_lib.models import rotary

DEFAULT_ROPE_THETA = 10_000.0  # transformers' value when a config names none


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """What one Hugging Face architecture fixes about the decoder, and its config defaults."""

    architecture: str  # the `architectures[0]` entry, e.g. "Qwen3ForCausalLM"
    model_type: str  # the config's `model_type`
    qk_norm: bool  # RMSNorm on each query and key head (Qwen3)
    qkv_bias: bool  # q/k/v projections always carry a bias (Qwen2)
    default_head_dim: int | None  # used when the config has no head_dim; None: hidden // heads
    default_max_positions: int
    # Whether `attention_bias: true` is a config option of this family (it then also biases o_proj).
    bias_option: bool


FAMILIES: dict[str, Family] = {
    family.architecture: family
    for family in (
        Family(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True, qkv_bias=False,
               default_head_dim=128, default_max_positions=32768, bias_option=True),
        Family(architecture="Qwen2ForCausalLM", model_type="qwen2", qk_norm=False, qkv_bias=True,
               default_head_dim=None, default_max_positions=32768, bias_option=False),
        Family(architecture="LlamaForCausalLM", model_type="llama", qk_norm=False, qkv_bias=False,
               default_head_dim=None, default_max_positions=2048, bias_option=True),
    )
}
SUPPORTED = tuple(FAMILIES)

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
# Fields that, when set to anything but their neutral value, change the forward pass in ways
# the decoder does not implement. Value: the neutral values that are accepted.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "mlp_bias": (False, None),
    "partial_rotary_factor": (1.0, 1, None),
    "quantization_config": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "n_routed_experts": (None, 0),
    "num_experts_per_tok": (None, 0),
    "moe_intermediate_size": (None, 0),
    "final_logit_softcapping": (None,),
    "attn_logit_softcapping": (None,),
    "logits_scaling": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "use_qk_norm": (None, False),
    "no_rope_layers": (None,),
    "rope_interleave": (None, False),
}


class UnsupportedCheckpoint(ValueError):
    """The checkpoint's architecture or config asks for math the decoder does not implement."""


def family_of(config: Mapping[str, Any]) -> Family:
    """The family a config names in `architectures` (or, lacking that, in `model_type`)."""
    names = config.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    if len(names) > 1:
        raise UnsupportedCheckpoint(
            f"config.json lists several architectures {names}; Dew loads exactly one of {SUPPORTED}"
        )
    if names:
        if names[0] not in FAMILIES:
            raise UnsupportedCheckpoint(
                f"architecture {names[0]!r} is not supported; supported architectures: {SUPPORTED}"
            )
        family = FAMILIES[names[0]]
    else:
        by_type = {f.model_type: f for f in FAMILIES.values()}
        model_type = config.get("model_type")
        if model_type not in by_type:
            raise UnsupportedCheckpoint(
                f"config.json names no architecture and model_type {model_type!r} is not one of "
                f"{sorted(by_type)}; supported architectures: {SUPPORTED}"
            )
        family = by_type[model_type]
    model_type = config.get("model_type", family.model_type)
    if model_type != family.model_type:
        raise UnsupportedCheckpoint(
            f"config.json says architecture {family.architecture!r} but model_type {model_type!r};"
            f" expected model_type {family.model_type!r}"
        )
    return family


def rope_settings(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """`(theta, scaling)` from either config layout; `scaling` is None for plain rotary.

    transformers 5 writes `rope_parameters` ({"rope_type", "rope_theta", ...}); older checkpoints
    write `rope_theta` and `rope_scaling` at the top level. Like transformers, a top-level
    `rope_scaling` wins over `rope_parameters`, and a theta inside the dict wins over the top level.
    """
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise UnsupportedCheckpoint(f"rope parameters must be a JSON object, got {params!r}")
    if any(isinstance(value, Mapping) for value in params.values()):
        raise UnsupportedCheckpoint(
            f"per-layer-type rope parameters {sorted(params)} are not supported; "
            "Dew's decoder uses one rotary setting for every layer"
        )
    params = dict(params)
    theta = float(params.pop("rope_theta", config.get("rope_theta") or DEFAULT_ROPE_THETA))
    kind = params.pop("rope_type", params.pop("type", "default"))
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor not in _NEUTRAL["partial_rotary_factor"]:
        raise UnsupportedCheckpoint(
            f"partial_rotary_factor={factor} (rotary on part of each head) is not supported"
        )
    if kind not in rotary.SUPPORTED_SCALING:
        raise UnsupportedCheckpoint(
            f"rope type {kind!r} is not supported; supported rope types: {rotary.SUPPORTED_SCALING}"
        )
    if kind == "default":
        return theta, None
    keys: dict[str, type[float] | type[int]]  # each parameter and the type it is read as
    if kind == "linear":
        keys = {"factor": float}
    else:  # llama3
        params.setdefault(
            "original_max_position_embeddings", config.get("max_position_embeddings")
        )
        keys = {"factor": float, "low_freq_factor": float, "high_freq_factor": float,
                "original_max_position_embeddings": int}
    missing = [key for key in keys if params.get(key) is None]
    if missing:
        raise UnsupportedCheckpoint(f"rope type {kind!r} needs {missing} in the rope parameters")
    scaling = {"rope_type": kind, **{key: cast(params[key]) for key, cast in keys.items()}}
    return theta, scaling


def _layer_types(config: Mapping[str, Any], layers: int) -> list[str]:
    """Each layer's attention kind, derived the way Qwen2/Qwen3 configs derive it."""
    if config.get("layer_types"):
        return list(config["layer_types"])
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    first_windowed = config.get("max_window_layers", 28)
    return [
        "sliding_attention" if window is not None and i >= first_windowed else "full_attention"
        for i in range(layers)
    ]


def decoder_options(config: Mapping[str, Any]) -> tuple[Family, dict[str, Any]]:
    """The family and `CausalTransformer` options (without dtypes) a config describes.

    Raises `UnsupportedCheckpoint` for an unknown architecture or any field that changes the math
    in a way the decoder does not reproduce, and names the field.
    """
    family = family_of(config)
    missing = [key for key in _REQUIRED if config.get(key) is None]
    if missing:
        raise UnsupportedCheckpoint(f"config.json lacks required fields {missing}")
    for key, neutral in _NEUTRAL.items():
        if key in config and key != "partial_rotary_factor" and config[key] not in neutral:
            raise UnsupportedCheckpoint(
                f"config field {key}={config[key]!r} is not supported by Dew's decoder"
                f" (accepted: {list(neutral)})"
            )
    if family.bias_option and config.get("attention_bias"):
        raise UnsupportedCheckpoint(
            f"attention_bias=true in a {family.architecture} config also biases o_proj, "
            "which Dew's decoder does not have"
        )
    layers = int(config["num_hidden_layers"])
    kinds = _layer_types(config, layers)
    other = [i for i, kind in enumerate(kinds) if kind != "full_attention"]
    if other:
        raise UnsupportedCheckpoint(
            f"layers {other} use {sorted({kinds[i] for i in other})} (sliding-window attention "
            "via use_sliding_window / layer_types); Dew's decoder attends to the full context only"
        )
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or family.default_head_dim or hidden // heads
    theta, scaling = rope_settings(config)
    options = dict(
        vocab_size=int(config["vocab_size"]),
        emb_features=hidden,
        num_layers=layers,
        num_heads=heads,
        mlp_features=int(config["intermediate_size"]),
        max_seq_len=int(config.get("max_position_embeddings") or family.default_max_positions),
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        qk_norm=family.qk_norm,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=family.qkv_bias,
        rope_theta=theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
    )
    return family, options


def family_for_model(model: Any) -> Family:
    """The family whose fixed features (qk-norm, q/k/v biases) a decoder instance has."""
    for family in FAMILIES.values():
        if family.qk_norm == model.qk_norm and family.qkv_bias == model.attention_bias:
            return family
    raise UnsupportedCheckpoint(
        f"no Hugging Face family has qk_norm={model.qk_norm} with attention_bias="
        f"{model.attention_bias}; supported architectures: {SUPPORTED}"
    )


def config_for_model(model: Any, family: Family, dtype_name: str) -> dict[str, Any]:
    """A transformers 5 `config.json` that describes `model` as `family`.

    Also writes the legacy top-level `rope_theta` (and `rope_scaling` when scaled), which older
    readers (transformers 4, some serving engines) expect; transformers 5 reads the same values.
    """
    if family.qk_norm != model.qk_norm or family.qkv_bias != model.attention_bias:
        raise UnsupportedCheckpoint(
            f"{family.architecture} has qk_norm={family.qk_norm} and q/k/v biases="
            f"{family.qkv_bias}, but the model has qk_norm={model.qk_norm} and "
            f"attention_bias={model.attention_bias}"
        )
    scaling = dict(model.rope_scaling) if model.rope_scaling else None
    rope = {"rope_type": "default", "rope_theta": float(model.rope_theta)}
    if scaling:
        rope = {**scaling, "rope_theta": float(model.rope_theta)}
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.emb_features,
        "intermediate_size": model.mlp_features,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_features,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings,
        "rope_parameters": rope,
        "rope_theta": float(model.rope_theta),
        "dtype": dtype_name,
    }
    if scaling:
        config["rope_scaling"] = scaling
    if family.bias_option:
        config["attention_bias"] = False
    if family.model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    return config
