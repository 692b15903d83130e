"""PEFT's LoRA adapter files in and out: `adapter_config.json` and `adapter_model.safetensors`.

`save_adapter` writes what PEFT's `save_pretrained` writes for a LoRA on a Llama, Qwen2 or Qwen3
causal LM: the config with every key PEFT 0.21 writes, and per layer and projection
`lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]`, the transposes of one layer of Dew's
stacked `lora_a` `[L, in, r]` and `lora_b` `[L, r, out]`. `PeftModel.from_pretrained` (and the
serving engines that read PEFT adapters) take the directory as it is. `load_adapter` reads such a
directory onto a base model from `load_pretrained`, and refuses, naming the field, every PEFT
setting that changes the math in a way Dew's plain LoRA does not reproduce (DoRA, trained biases,
per-module ranks, adapters on some layers only, other trained modules, ...), so an adapter never
loads as a plausible but different model.

Not here: the adapters themselves (`dew_lib.models.lora`), merged checkpoints (`Pretrained.save`
folds the adapters in), PEFT's README.md model card, other PEFT methods, torch (never imported).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from safetensors import safe_open

from dew_lib.models import lora
from dew_lib.models.pretrained import files, loading
from dew_lib.models.pretrained.families import UnsupportedCheckpoint
from dew_lib.models.pretrained.files import CheckpointError
from dew_lib.models.pretrained.formats import numpy_dtype

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PEFT_VERSION = "0.21.2"  # the PEFT release whose adapter_config.json keys `save_adapter` writes
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # where each projection lives
_UNADAPTABLE = ("model.embed_tokens", "lm_head")  # modules PEFT may adapt and Dew never does
_MERGE_HINT = ("merge it into the base with PEFT (merge_and_unload, then save_pretrained) and load the "
               "merged checkpoint with load_pretrained instead")

# The keys PEFT 0.21.2's save_pretrained writes for a LoraConfig, at their defaults; `_config`
# sets the adapter's own. Loading refuses a file whose value of a key below changes the math.
_DEFAULTS: dict[str, Any] = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None,
    "base_model_name_or_path": None, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
    "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
    "init_lora_weights": True, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 8, "lora_bias": False,
    "lora_dropout": 0.0, "lora_ga_config": None, "megatron_config": None, "megatron_core": "megatron.core",
    "modules_to_save": None, "monteclora_config": None, "peft_type": "LORA", "peft_version": PEFT_VERSION,
    "qalora_group_size": 16, "r": 8, "rank_pattern": {}, "revision": None, "target_modules": None,
    "target_parameters": None, "task_type": "CAUSAL_LM", "trainable_token_indices": None,
    "use_bdlora": None, "use_dora": False, "use_qalora": False, "use_rslora": False,
    "velora_config": None,
}
# field: (the values plain LoRA has, what any other value means)
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_dora": ((False, None), "DoRA (a trained magnitude per output)"),
    "bias": (("none", None), "trained biases of the base model"),
    "lora_bias": ((False, None), "a bias on lora_B"),
    "modules_to_save": ((None, []), "fully trained copies of other modules"),
    "rank_pattern": ((None, {}), "a rank per module"),
    "alpha_pattern": ((None, {}), "an alpha per module"),
    "layers_to_transform": ((None, []), "adapters on some layers only"),
    "layer_replication": ((None, []), "replicated layers"),
    "exclude_modules": ((None, []), "modules left out by name"),
    "fan_in_fan_out": ((False, None), "GPT-2's transposed Conv1D weights"),
    "target_parameters": ((None, []), "adapters on raw parameters"),
    "trainable_token_indices": ((None, [], {}), "trained token embeddings"),
    "alora_invocation_tokens": ((None, []), "activated LoRA (adapters on from an invocation on)"),
    "use_qalora": ((False, None), "QA-LoRA's pooled inputs"),
    "use_bdlora": ((None, False), "block-diagonal LoRA"),
    "kasa_config": ((None,), "KaSA's singular-value diagonal"),
    "arrow_config": ((None,), "Arrow routing among adapters"),
    "monteclora_config": ((None,), "Monte Carlo LoRA sampling"),
}
# Initialisations that also change the base weights: the adapter only fits the changed base.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def tensor_name(layer: int, target: str, factor: str) -> str:
    """PEFT's name of one layer's `lora_A` or `lora_B` (`factor` "A" or "B") on projection `target`."""
    return f"base_model.model.model.layers.{layer}.{MODULES[target]}.{target}.lora_{factor}.weight"


# -- out -----------------------------------------------------------------------------------------


def save_adapter(directory: str | Path, model: Any, params_or_variables: Mapping[str, Any], *,
                 base_model_name_or_path: str | None = None) -> Path:
    """Write `model`'s adapters as PEFT does: `adapter_config.json` and `adapter_model.safetensors`.

    `model` is the adapted decoder (`lora.attach` or `load_adapter` made it); its `lora` gives r,
    alpha, the targets, rsLoRA and the dropout. The tensors keep the adapters' dtype. Other files
    in `directory` stay; each of the two is written beside its name and renamed over it.
    `base_model_name_or_path` is recorded for PEFT, which loads that base when asked to.
    Adapters split across processes are gathered on every process (all must call this) and
    process 0 writes. Returns `directory`.
    """
    config = getattr(model, "lora", None)
    if not isinstance(config, lora.LoRA):
        raise ValueError("save_adapter needs the adapted model (what lora.attach or load_adapter returned); "
                         "this model has no LoRA")
    params = params_or_variables.get("params", params_or_variables)
    tensors: dict[str, np.ndarray] = {}
    for target in config.targets:
        leaves = params.get("layers", {}).get(target, {})
        if "lora_a" not in leaves or "lora_b" not in leaves:
            raise ValueError(f"the params have no lora_a/lora_b under layers/{target}, which the model's LoRA "
                             "targets; pass the variables that belong to this adapted model")
        a, b = _on_host(leaves["lora_a"]), _on_host(leaves["lora_b"])
        for layer in range(a.shape[0]):
            tensors[tensor_name(layer, target, "A")] = np.ascontiguousarray(a[layer].T)
            tensors[tensor_name(layer, target, "B")] = np.ascontiguousarray(b[layer].T)
    if jax.process_index() != 0:
        return Path(directory)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    planned = [files.Planned(name, array.shape, array.dtype) for name, array in tensors.items()]
    _replace(directory / WEIGHTS, lambda path: files.save_file(
        files.Shard(planned, iter(tensors.items())), path, metadata={"format": "pt"}))
    text = json.dumps(_config(config, base_model_name_or_path), indent=2, sort_keys=True)
    _replace(directory / CONFIG, lambda path: path.write_text(text))
    return directory


def _config(config: lora.LoRA, base_model_name_or_path: str | None) -> dict[str, Any]:
    """adapter_config.json for `config`, as PEFT writes it (alpha an int where it is whole)."""
    alpha = int(config.alpha) if float(config.alpha).is_integer() else config.alpha
    return {**_DEFAULTS, "r": config.rank, "lora_alpha": alpha, "use_rslora": bool(config.rslora),
            "lora_dropout": float(getattr(config, "dropout", 0.0)), "target_modules": sorted(config.targets),
            "base_model_name_or_path": base_model_name_or_path}


def _on_host(leaf: Any) -> np.ndarray:
    """A leaf as one NumPy array; a leaf split across processes is gathered first."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def _replace(path: Path, write: Any) -> None:
    """Write a file beside `path` with `write(temporary_path)` and rename it over `path`."""
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    try:
        write(Path(temporary))
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# -- in ------------------------------------------------------------------------------------------


def load_adapter(directory: str | Path, model: Any, variables: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`(adapted_model, variables)`: the PEFT LoRA adapter in `directory` on the base `model`.

    `model` and `variables` are a base without adapters, as `load_pretrained` gives them. The
    model gains `lora.LoRA(rank=r, alpha=lora_alpha, targets=..., rslora=use_rslora)` from the
    config; the variables gain each adapter beside its kernel, in the kernel's dtype and, where
    the kernel lies on a mesh, split as the Trainer splits adapters on it. The base is not
    copied. Raises `UnsupportedCheckpoint` for a config Dew cannot reproduce (naming the field)
    and `CheckpointError` for tensors that do not fit (naming the tensor and both shapes).
    """
    directory = Path(directory)
    if getattr(model, "lora", None) is not None or lora.has_adapters(variables):
        raise ValueError("the model already has adapters; load the PEFT adapter onto the base model "
                         "(load_pretrained(...).model and .variables)")
    config = _read_config(directory / CONFIG)
    layers = variables["params"]["layers"]
    count = int(np.shape(layers["q_proj"]["kernel"])[0])
    adapter = _lora_of(config, _targets(config.get("target_modules"), count), directory / CONFIG)
    stored = _stored(directory / WEIGHTS)
    _check_tensors(stored, adapter, layers, count, directory / WEIGHTS)
    out = dict(layers)
    with files.Reader(directory / WEIGHTS) as reader:
        for target in adapter.targets:
            kernel = layers[target]["kernel"]
            dtype = numpy_dtype(kernel.dtype)
            read = {factor: np.stack([reader.read(tensor_name(layer, target, factor)).T.astype(dtype)
                                      for layer in range(count)]) for factor in "AB"}
            out[target] = {**layers[target],
                           "lora_a": _placed(read["A"], kernel, ("layers", target, "lora_a")),
                           "lora_b": _placed(read["B"], kernel, ("layers", target, "lora_b"))}
    return model.clone(lora=adapter), {**variables, "params": {**variables["params"], "layers": out}}


def _read_config(path: Path) -> dict[str, Any]:
    """adapter_config.json, checked for every setting plain LoRA does not have."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; a PEFT adapter directory holds {CONFIG} and {WEIGHTS} "
                                "(what PEFT's save_pretrained and save_adapter write)")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise UnsupportedCheckpoint(f"{path} has peft_type {config.get('peft_type')!r}; load_adapter reads "
                                    "LoRA adapters (peft_type 'LORA') only")
    if config.get("task_type") not in ("CAUSAL_LM", None):
        raise UnsupportedCheckpoint(f"{path} has task_type {config['task_type']!r}; Dew's decoder is a causal "
                                    "LM, so it reads adapters with task_type 'CAUSAL_LM'")
    for field, (plain, meaning) in _REFUSED.items():
        value = config.get(field)
        if not any(value is accepted or (type(value) is type(accepted) and value == accepted)
                   for accepted in plain):
            raise UnsupportedCheckpoint(f"{path} sets {field}={value!r} ({meaning}), which Dew's LoRA does "
                                        f"not reproduce; {_MERGE_HINT}")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise UnsupportedCheckpoint(f"{path} sets init_lora_weights={init!r}, which also changed the base "
                                    f"weights the adapter was trained on; {_MERGE_HINT}")
    return config


def _lora_of(config: Mapping[str, Any], targets: tuple[str, ...], path: Path) -> lora.LoRA:
    """The `lora.LoRA` the config describes (with its dropout where `LoRA` has one)."""
    options: dict[str, Any] = {"rank": config.get("r"), "alpha": config.get("lora_alpha"), "targets": targets,
                               "rslora": bool(config.get("use_rslora", False))}
    if any(field.name == "dropout" for field in dataclasses.fields(lora.LoRA)):
        options["dropout"] = float(config.get("lora_dropout") or 0.0)
    try:
        return lora.LoRA(**options)
    except (TypeError, ValueError) as error:
        raise UnsupportedCheckpoint(f"{path}: r={config.get('r')!r}, lora_alpha={config.get('lora_alpha')!r} "
                                    f"do not make a LoRA: {error}") from None


def _targets(wanted: Any, count: int) -> tuple[str, ...]:
    """The projections `target_modules` selects, matched as PEFT matches it on the Hugging Face
    model: a list names module-name suffixes, a string is a regex over whole names."""
    if wanted == "all-linear":
        return lora.TARGETS
    modules = {f"model.layers.{layer}.{MODULES[target]}.{target}": (layer, target)
               for layer in range(count) for target in lora.TARGETS}
    names = [*modules, *_UNADAPTABLE]
    if isinstance(wanted, str):
        matched = [name for name in names if re.fullmatch(wanted, name)]
    elif isinstance(wanted, list) and all(isinstance(item, str) for item in wanted):
        matched = [name for name in names if any(name == item or name.endswith(f".{item}") for item in wanted)]
    else:
        raise UnsupportedCheckpoint(f"target_modules must be a list of module names or a regex, got {wanted!r}")
    others = [name for name in matched if name in _UNADAPTABLE]
    if others:
        raise UnsupportedCheckpoint(f"target_modules {wanted!r} adapts {others}; Dew adapts the decoder's "
                                    f"projections {', '.join(lora.TARGETS)} only (never the embedding or the "
                                    f"output head); {_MERGE_HINT}")
    per_layer = [tuple(t for t in lora.TARGETS if (layer, t) in {modules[n] for n in matched})
                 for layer in range(count)]
    if not per_layer[0]:
        raise UnsupportedCheckpoint(f"target_modules {wanted!r} selects none of the projections "
                                    f"{', '.join(lora.TARGETS)}")
    if len(set(per_layer)) > 1:
        raise UnsupportedCheckpoint(f"target_modules {wanted!r} adapts different projections in different "
                                    f"layers ({dict(enumerate(per_layer))}); Dew adapts the same ones in every "
                                    f"layer; {_MERGE_HINT}")
    return per_layer[0]


def _stored(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's dtype code and shape, from the file's header."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; Dew reads PEFT adapters saved as safetensors "
                                "(save_pretrained's default), not adapter_model.bin")
    with safe_open(path, framework="numpy") as f:
        names = list(f.keys())
    return files.headers(dict.fromkeys(names, path))


def _check_tensors(stored: Mapping[str, tuple[str, tuple[int, ...]]], adapter: lora.LoRA,
                   layers: Mapping[str, Any], count: int, path: Path) -> None:
    """Every tensor the adapter needs, no other, each in the shape the base's kernel implies."""
    expected: dict[str, tuple[int, ...]] = {}
    for target in adapter.targets:
        _, width_in, width_out = np.shape(layers[target]["kernel"])
        for layer in range(count):
            expected[tensor_name(layer, target, "A")] = (adapter.rank, width_in)
            expected[tensor_name(layer, target, "B")] = (width_out, adapter.rank)
    missing = [name for name in expected if name not in stored]
    if missing:
        raise CheckpointError(f"{path.name} lacks {len(missing)} tensor(s) that r={adapter.rank} on "
                              f"{', '.join(adapter.targets)} needs: {missing[:6]}")
    extra = sorted(name for name in stored if name not in expected)
    if extra:
        raise CheckpointError(f"{path.name} holds {len(extra)} tensor(s) that adapter_config.json does not "
                              f"account for: {extra[:6]}")
    for name, want in expected.items():
        dtype, shape = stored[name]
        if shape != want:
            raise CheckpointError(f"tensor {name} has shape {list(shape)} in {path.name}, but r={adapter.rank} "
                                  f"on this base model needs {list(want)}")
        if dtype not in files.FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} is stored as {dtype}; Dew reads float adapters only "
                                  f"({sorted(files.FLOAT_DTYPES)})")


def _placed(array: np.ndarray, kernel: Any, path: tuple[str, ...]) -> jax.Array:
    """`array` where its kernel lies: on the kernel's mesh, split as declared for adapters (as the
    Trainer splits them), or on the kernel's device."""
    sharding = getattr(kernel, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        sharding = loading.mesh_shardings(sharding.mesh, {path: array.shape}, array.dtype)[path]
    elif not isinstance(sharding, SingleDeviceSharding):
        return jnp.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


__all__ = ["CONFIG", "MODULES", "PEFT_VERSION", "WEIGHTS", "load_adapter", "save_adapter", "tensor_name"]
