"""Hugging Face `config.json` <-> decoder options for the causal-LM families Dew can load.

Each supported architecture (Qwen3, Qwen2/Qwen2.5, Llama 2/3.x, and the mixture-of-experts
Qwen3-MoE, Qwen2-MoE and Mixtral) is one `Family` row. Reading a config maps its fields onto
`CausalTransformer` options and refuses every setting that would change the math in a way the
decoder does not reproduce (sliding windows, unknown rope types, expert fields on a dense family,
output-projection biases, quantized weights, ...), so an
unsupported checkpoint fails at load time instead of producing a plausible but wrong model.

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
    default_rope_theta: float = DEFAULT_ROPE_THETA
    default_norm_eps: float = 1e-6
    # Mixture of experts: the config field that counts the routed experts
    # (None: a dense family), the expert-width field, and what the family fixes.
    experts_field: str | None = None
    expert_width_field: str = "moe_intermediate_size"
    shared_expert: bool = False  # one always-on expert with a sigmoid gate (Qwen2-MoE)
    moe_module: str = "mlp"  # the block's module name: "block_sparse_moe" in Mixtral checkpoints
    # The per-expert projections' names in the checkpoint, as (gate, up, down).
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fixed_norm_topk: bool | None = None  # norm_topk_prob when the family fixes it (Mixtral: True)
    default_norm_topk: bool = False  # transformers' default when the config omits norm_topk_prob

    @property
    def moe(self) -> bool:
        return self.experts_field is not None


FAMILIES: dict[str, Family] = {
    family.architecture: family
    for family in (
        Family(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True, qkv_bias=False,
               default_head_dim=128, default_max_positions=32768, bias_option=True),
        Family(architecture="Qwen2ForCausalLM", model_type="qwen2", qk_norm=False, qkv_bias=True,
               default_head_dim=None, default_max_positions=32768, bias_option=False),
        Family(architecture="LlamaForCausalLM", model_type="llama", qk_norm=False, qkv_bias=False,
               default_head_dim=None, default_max_positions=2048, bias_option=True),
        Family(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm=True,
               qkv_bias=False, default_head_dim=None, default_max_positions=32768,
               bias_option=True, experts_field="num_experts"),
        Family(architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe", qk_norm=False,
               qkv_bias=True, default_head_dim=None, default_max_positions=32768,
               bias_option=False, experts_field="num_experts", shared_expert=True),
        Family(architecture="MixtralForCausalLM", model_type="mixtral", qk_norm=False,
               qkv_bias=False, default_head_dim=None, default_max_positions=4096 * 32,
               bias_option=False, default_rope_theta=1_000_000.0, default_norm_eps=1e-5,
               experts_field="num_local_experts", expert_width_field="intermediate_size",
               moe_module="block_sparse_moe", expert_names=("w1", "w3", "w2"),
               fixed_norm_topk=True),
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
    # Expert fields: refused on a dense family; an MoE family reads the ones in _MOE_FIELDS.
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "n_routed_experts": (None, 0),
    "num_experts_per_tok": (None, 0),
    "moe_intermediate_size": (None, 0),
    "shared_expert_intermediate_size": (None, 0),
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
_MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size")
DEFAULT_ROUTER_AUX_LOSS_COEF = 0.001  # transformers' value for all three MoE families


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


def rope_settings(config: Mapping[str, Any], default_theta: float = DEFAULT_ROPE_THETA
                  ) -> tuple[float, dict[str, Any] | None]:
    """`(theta, scaling)` from either config layout; `scaling` is None for plain rotary.

    transformers 5 writes `rope_parameters` ({"rope_type", "rope_theta", ...}); older checkpoints
    write `rope_theta` and `rope_scaling` at the top level. Like transformers, a top-level
    `rope_scaling` wins over `rope_parameters`, and a theta inside the dict wins over the top level.
    `default_theta` is the family's value when neither names one.
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
    theta = float(params.pop("rope_theta", config.get("rope_theta") or default_theta))
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
        if family.moe and key in _MOE_FIELDS:
            continue
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
    if family.moe and config.get("use_sliding_window"):
        # Qwen3-MoE windows every layer and Qwen2-MoE alternate ones, unlike Qwen2's
        # max_window_layers; neither is something the decoder does.
        raise UnsupportedCheckpoint(
            f"use_sliding_window=true in a {family.architecture} config: sliding-window "
            "attention is not supported; Dew's decoder attends to the full context only"
        )
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
    theta, scaling = rope_settings(config, family.default_rope_theta)
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
        norm_eps=float(config.get("rms_norm_eps", family.default_norm_eps)),
    )
    if family.moe:
        options.update(_moe_options(config, family, layers))
    return family, options


def _moe_options(config: Mapping[str, Any], family: Family, layers: int) -> dict[str, Any]:
    """The expert options of an MoE family's config; refuses what the sparse block does not do."""
    experts = _experts(config, family)
    if experts < 1:
        raise UnsupportedCheckpoint(
            f"{family.experts_field}={experts} in a {family.architecture} config: Dew loads it "
            "as a mixture of experts only; a dense model is one of the dense architectures"
        )
    dense = _dense_layers(config, family, layers)
    if config.get("sliding_window") is not None and family.model_type == "mixtral":
        raise UnsupportedCheckpoint(
            f"config field sliding_window={config['sliding_window']!r}: Mixtral's sliding-window "
            "attention is not supported; Dew's decoder attends to the full context only "
            "(sliding_window must be null)"
        )
    jitter = config.get("router_jitter_noise") or 0.0
    if jitter:
        raise UnsupportedCheckpoint(
            f"config field router_jitter_noise={jitter!r}: multiplicative router noise in "
            "training is not supported (set it to 0.0)"
        )
    if family.model_type == "qwen2_moe" and config.get("qkv_bias", True) is not True:
        raise UnsupportedCheckpoint(
            f"config field qkv_bias={config['qkv_bias']!r}: Dew reads Qwen2-MoE with its q/k/v "
            "biases only"
        )
    missing = [key for key in ("num_experts_per_tok", family.expert_width_field)
               + (("shared_expert_intermediate_size",) if family.shared_expert else ())
               if not config.get(key)]
    if missing:
        raise UnsupportedCheckpoint(f"config.json lacks required expert fields {missing}")
    top_k = int(config["num_experts_per_tok"])
    if top_k > experts:
        raise UnsupportedCheckpoint(
            f"num_experts_per_tok={top_k} exceeds the {experts} experts the config declares"
        )
    norm_topk = family.fixed_norm_topk
    if norm_topk is None:
        norm_topk = bool(config.get("norm_topk_prob", family.default_norm_topk))
    coefficient = config.get("router_aux_loss_coef")
    return dict(
        dense_layers=dense,
        experts=experts,
        experts_per_token=top_k,
        expert_features=int(config[family.expert_width_field]),
        norm_topk_prob=norm_topk,
        shared_expert_features=(int(config["shared_expert_intermediate_size"])
                                if family.shared_expert else 0),
        router_aux_loss_coef=float(DEFAULT_ROUTER_AUX_LOSS_COEF if coefficient is None
                                   else coefficient),
    )


def _dense_layers(config: Mapping[str, Any], family: Family, layers: int) -> tuple[int, ...]:
    """The layers that keep the dense MLP, by transformers' rule for Qwen2-MoE and Qwen3-MoE:
    layer i is sparse when it is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step
    == 0`. Mixtral's config has neither field (every layer sparse); one that names them is
    refused rather than guessed at."""
    step = config.get("decoder_sparse_step")
    step = 1 if step is None else step
    listed = config.get("mlp_only_layers") or []
    if family.model_type == "mixtral":
        if step != 1 or listed:
            raise UnsupportedCheckpoint(
                f"config fields decoder_sparse_step={step!r}, mlp_only_layers={list(listed)!r} in a "
                "Mixtral config: Mixtral makes every layer sparse and has no dense layers to place")
        return ()
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise UnsupportedCheckpoint(f"config field decoder_sparse_step={step!r}: must be an integer >= 1")
    if not all(isinstance(i, int) and 0 <= i < layers for i in listed):
        raise UnsupportedCheckpoint(
            f"config field mlp_only_layers={list(listed)!r}: must be layer indices in 0..{layers - 1}")
    dense = tuple(i for i in range(layers) if i in set(listed) or (i + 1) % step)
    if len(dense) == layers:
        raise UnsupportedCheckpoint(
            f"config fields decoder_sparse_step={step!r}, mlp_only_layers={list(listed)!r} leave no "
            "sparse layer; Dew loads such a model as a mixture of experts only (it is a dense model)")
    return dense


def _experts(config: Mapping[str, Any], family: Family) -> int:
    """The routed-expert count. transformers 5 writes a Qwen3-MoE count as `num_local_experts`
    (its config maps `num_experts` onto that name) where the Hub and older versions write
    `num_experts`, and Mixtral reads `num_experts` as its `num_local_experts`: both names are
    read for those two; Qwen2-MoE has `num_experts` only."""
    names = [str(family.experts_field)]
    if family.model_type in ("qwen3_moe", "mixtral"):
        names = ["num_experts", "num_local_experts"]
    given = {name: config[name] for name in names if config.get(name) is not None}
    if not given:
        raise UnsupportedCheckpoint(
            f"config.json lacks the expert count ({' or '.join(names)}) a "
            f"{family.architecture} needs"
        )
    if len(set(given.values())) > 1:
        raise UnsupportedCheckpoint(f"config.json gives different expert counts {given}")
    return int(next(iter(given.values())))


def experts_of(model: Any) -> int:
    """Routed experts per layer of a decoder (0: dense); decoders without the field are dense."""
    return int(getattr(model, "experts", 0) or 0)


def expert_width(model: Any) -> int:
    """The width of each routed expert (`expert_features`, defaulting to `mlp_features`)."""
    return int(getattr(model, "expert_features", None) or model.mlp_features)


def _fits(family: Family, model: Any) -> str | None:
    """Why `model` cannot be written as `family` (None: it can)."""
    shared = int(getattr(model, "shared_expert_features", 0) or 0)
    if family.qk_norm != model.qk_norm or family.qkv_bias != model.attention_bias:
        return (f"{family.architecture} has qk_norm={family.qk_norm} and q/k/v biases="
                f"{family.qkv_bias}, but the model has qk_norm={model.qk_norm} and "
                f"attention_bias={model.attention_bias}")
    if family.moe != (experts_of(model) > 0):
        return (f"{family.architecture} is {'a mixture of experts' if family.moe else 'dense'}"
                f", but the model has experts={experts_of(model)}")
    if family.moe and family.shared_expert != (shared > 0):
        return (f"{family.architecture} {'has' if family.shared_expert else 'has no'} shared "
                f"expert, but the model has shared_expert_features={shared}")
    dense = tuple(getattr(model, "dense_layers", ()) or ())
    if dense and family.model_type == "mixtral":
        return (f"{family.architecture} makes every layer sparse, but the model has dense_layers="
                f"{dense}")
    if family.fixed_norm_topk is not None and family.fixed_norm_topk != model.norm_topk_prob:
        return (f"{family.architecture} always renormalizes the top-k router weights, but the "
                f"model has norm_topk_prob={model.norm_topk_prob}")
    return None


def family_for_model(model: Any) -> Family:
    """The family whose fixed features (qk-norm, q/k/v biases, experts) a decoder instance has.

    An MoE decoder with neither qk-norm nor biases is Mixtral when it renormalizes its top-k
    weights (Mixtral always does); pass `architecture=` to `Pretrained.from_model` otherwise.
    """
    for family in FAMILIES.values():
        if _fits(family, model) is None:
            return family
    raise UnsupportedCheckpoint(
        f"no Hugging Face family has qk_norm={model.qk_norm} with attention_bias="
        f"{model.attention_bias}, experts={experts_of(model)}, shared_expert_features="
        f"{getattr(model, 'shared_expert_features', 0)}, norm_topk_prob="
        f"{getattr(model, 'norm_topk_prob', None)}; supported architectures: {SUPPORTED}"
    )


def config_for_model(model: Any, family: Family, dtype_name: str) -> dict[str, Any]:
    """A transformers 5 `config.json` that describes `model` as `family`.

    Also writes the legacy top-level `rope_theta` (and `rope_scaling` when scaled), which older
    readers (transformers 4, some serving engines) expect; transformers 5 reads the same values.
    An MoE family's expert count goes under the name the Hub's checkpoints use (`num_experts`,
    Mixtral's `num_local_experts`), which every transformers version and vLLM/SGLang read.
    """
    mismatch = _fits(family, model)
    if mismatch:
        raise UnsupportedCheckpoint(mismatch)
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
    if family.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        config["use_sliding_window"] = False
    if family.moe:
        config.update(_moe_config(model, family))
    return config


def hub_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with the field names the Hub's checkpoints use, for writing out: transformers 5
    writes a Qwen3-MoE expert count as `num_local_experts`, which transformers 4 and the engines
    that read configs with it do not know (they would fall back to 128 experts), so it goes back
    under `num_experts`."""
    out = dict(config)
    if out.get("model_type") == "qwen3_moe" and "num_local_experts" in out:
        count = out.pop("num_local_experts")
        out.setdefault("num_experts", count)
    return out


def _moe_config(model: Any, family: Family) -> dict[str, Any]:
    """The expert fields of an MoE family's config.json."""
    config: dict[str, Any] = {
        str(family.experts_field): experts_of(model),
        "num_experts_per_tok": model.experts_per_token,
        family.expert_width_field: expert_width(model),
        "router_aux_loss_coef": float(model.router_aux_loss_coef),
        "output_router_logits": False,
    }
    if family.model_type == "mixtral":
        config.update(sliding_window=None, router_jitter_noise=0.0)
    else:
        # the dense layers listed one by one; a checkpoint's decoder_sparse_step comes back as 1
        # with the same layers in mlp_only_layers, which transformers reads as the same model
        config.update(decoder_sparse_step=1, mlp_only_layers=list(getattr(model, "dense_layers", ()) or ()),
                      norm_topk_prob=bool(model.norm_topk_prob))
    if family.shared_expert:
        config.update(shared_expert_intermediate_size=int(model.shared_expert_features),
                      qkv_bias=True)
    return config
