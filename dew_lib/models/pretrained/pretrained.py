"""`Pretrained` and `load_pretrained`: Hugging Face checkpoints in and out of the decoder.

`load_pretrained(directory)` reads a local Hugging Face directory (config.json, safetensors,
tokenizer) into a `CausalTransformer`, its variables and its tokenizer, without torch. Weights
stream tensor by tensor from disk onto the devices (or a given `jax.sharding`, or split over a
mesh as the Trainer splits them), so the host holds one copy of the model plus one scratch
tensor. `Pretrained.save` writes the reverse: safetensors (bfloat16 by default, sharded above a
size), config.json, generation_config.json and the tokenizer, staged beside the target and
swapped in; sharded variables are gathered one tensor at a time as it writes.
`Pretrained.export` yields the same tensors by name without touching disk, for pushing weights
straight into a serving engine.

Not here: reading the tensors (`loading`) and writing them (`saving`), downloading from the Hub
(directories must be local), `.bin`/pickle checkpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from dew_lib.models import rotary
from dew_lib.models.decoder import CausalTransformer
from dew_lib.models.pretrained import families, layout, loading, saving
from dew_lib.models.pretrained.families import Family, UnsupportedCheckpoint
from dew_lib.models.pretrained.formats import CONFIG, GENERATION_CONFIG, model_dtype, numpy_dtype
from dew_lib.models.pretrained.loading import ShardingSpec

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if not path.parent.is_dir():
            raise FileNotFoundError(
                f"{path.parent}: no such directory; load_pretrained reads a local Hugging Face "
                "checkpoint directory (config.json, model.safetensors, tokenizer files); download "
                "the checkpoint there first (Dew does not download)") from None
        raise FileNotFoundError(f"{path} not found; a Hugging Face checkpoint needs one") from None


# Files beside a tokenizer that it is never built from: weights and their index, the generation
# config, and Dew's own records (dew_*.json, e.g. a pipeline stage's policy fingerprint).
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf", ".index.json",
                  GENERATION_CONFIG)
_TOKENIZERS: dict[str, Any] = {}  # digest of a directory's tokenizer-side files -> tokenizer
_TOKENIZERS_LOCK = threading.Lock()


def _tokenizer_digest(directory: Path) -> str:
    """A digest of every file in `directory` the tokenizer could be built from (all but _NOT_TOKENIZER):
    another file can only make two directories differ, never two tokenizers look the same."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(directory.iterdir()):
        if path.is_file() and not path.name.endswith(_NOT_TOKENIZER) and not path.name.startswith("dew_"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _load_tokenizer(directory: Path) -> Any:
    """The directory's tokenizer through transformers, or None when it ships none.

    Built once per process for the same files: a pipeline's stages each load the policy the
    stage before saved, tokenizer and all, and building Qwen3's from its files took 0.57 s where
    reading and hashing them takes a few milliseconds. Callers share the object and never change it.
    """
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    key = _tokenizer_digest(directory)
    with _TOKENIZERS_LOCK:
        if key in _TOKENIZERS:
            return _TOKENIZERS[key]
    from transformers import AutoTokenizer  # imported late: loading weights does not need it

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    with _TOKENIZERS_LOCK:
        return _TOKENIZERS.setdefault(key, tokenizer)


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A `CausalTransformer` bound to a Hugging Face architecture and config, with its tokenizer.

    It holds no weights: `load` reads them from a checkpoint directory, `save` and `export`
    write variables out in the architecture's tensor names and layouts. Make one with
    `load_pretrained` / `Pretrained.from_directory` (config and tokenizer of a checkpoint) or
    `Pretrained.from_model` (a decoder built in Dew). The model's options must agree with the
    config; construction checks this, so a saved config always describes the saved tensors.

    Fields: `model`, the decoder; `config`, the Hugging Face config as a dict; `tokenizer`, a
    transformers tokenizer or None; `generation_config`, the generation_config.json contents or
    None (written back on save, so serving engines keep the checkpoint's sampling defaults).
    """

    model: CausalTransformer
    config: Mapping[str, Any]
    tokenizer: Any = None
    generation_config: Mapping[str, Any] | None = None

    def __post_init__(self):
        object.__setattr__(self, "config", dict(self.config))  # a private copy
        _, options = families.decoder_options(self.config)
        # Not compared: rotary settings (compared by their frequencies below), the aux-loss
        # coefficient (a training option: the forward pass and the tensors do not depend on it)
        # and, when every layer is sparse, the unused dense MLP width.
        skipped = {"rope_theta", "rope_scaling", "router_aux_loss_coef"}
        if options.get("experts") and not options.get("dense_layers"):
            skipped.add("mlp_features")
        actual = {key: getattr(self.model, key, None) for key in options if key not in skipped}
        actual["num_kv_heads"] = self.model.kv_heads
        actual["head_dim"] = self.model.head_features
        if "expert_features" in options:
            actual["expert_features"] = families.expert_width(self.model)
        if "experts" not in options:  # a dense config: the model must be dense too
            options = {**options, "experts": 0}
            actual["experts"] = families.experts_of(self.model)
        differing = {
            key: (value, actual[key])
            for key, value in options.items()
            if key not in skipped and actual[key] != value
        }
        wanted = rotary.inverse_frequencies(
            options["head_dim"], options["rope_theta"], dict(options["rope_scaling"] or ())
        )
        have = rotary.inverse_frequencies(
            self.model.head_features, self.model.rope_theta, dict(self.model.rope_scaling or ())
        )
        if not np.array_equal(wanted, have):
            differing["rope"] = (
                (options["rope_theta"], options["rope_scaling"]),
                (self.model.rope_theta, self.model.rope_scaling),
            )
        if differing:
            raise ValueError(
                "the model does not match its Hugging Face config; (config, model) per field: "
                f"{differing}"
            )

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: CausalTransformer,
        *,
        architecture: str | None = None,
        tokenizer: Any = None,
        config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
    ) -> Pretrained:
        """Describe a Dew-built decoder as a Hugging Face architecture.

        `architecture` defaults to the one family whose fixed features the model has (qk-norm:
        Qwen3; q/k/v biases: Qwen2; neither: Llama; with `experts`: Qwen3-MoE, Qwen2-MoE with
        its shared expert, Mixtral). `config` adds fields to the generated
        config.json (token ids such as `bos_token_id`, `eos_token_id`); they may not change the
        math, which the constructor checks.
        """
        if architecture is None:
            family = families.family_for_model(model)
        elif architecture in families.FAMILIES:
            family = families.FAMILIES[architecture]
        else:
            raise UnsupportedCheckpoint(
                f"architecture {architecture!r} is not supported; supported architectures: "
                f"{families.SUPPORTED}"
            )
        built = families.config_for_model(model, family, numpy_dtype(model.param_dtype).name)
        if tokenizer is not None:
            for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
                value = getattr(tokenizer, field, None)
                if value is not None:
                    built[field] = value
        return cls(model, {**built, **dict(config or {})}, tokenizer, generation_config)

    @classmethod
    def from_directory(
        cls,
        directory: str | Path,
        *,
        dtype: Any = jnp.float32,
        compute_dtype: Any = None,
        tokenizer: bool = True,
    ) -> Pretrained:
        """Read config.json (and the tokenizer, generation_config.json) of a local checkpoint.

        `dtype` is the parameter dtype the model will be loaded in; `compute_dtype` the dtype
        of activations (default: the same).
        """
        directory = Path(directory)
        config = _read_json(directory / CONFIG)
        _, options = families.decoder_options(config)
        param_dtype = model_dtype(dtype)
        model = CausalTransformer(
            **options,
            dtype=param_dtype if compute_dtype is None else model_dtype(compute_dtype),
            param_dtype=param_dtype,
        )
        generation = directory / GENERATION_CONFIG
        return cls(
            model,
            config,
            _load_tokenizer(directory) if tokenizer else None,
            _read_json(generation) if generation.is_file() else None,
        )

    # -- what the checkpoint holds ---------------------------------------------------------

    @property
    def family(self) -> Family:
        return families.family_of(self.config)

    @property
    def tensors(self) -> list[layout.Tensor]:
        """The checkpoint's tensors in save order (names, shapes, where each lives in params)."""
        return layout.tensors(self.model, self.family)

    # -- in --------------------------------------------------------------------------------

    def load(self, directory: str | Path, *, sharding: ShardingSpec = None) -> dict[str, Any]:
        """Read the safetensors under `directory` into Flax variables `{"params": ...}`.

        Every tensor is checked against the model before any is read: a missing or unexpected
        tensor (by name), a wrong shape (name and both shapes) or a non-float dtype raise
        `CheckpointError`. Tensors are then read one at a time, cast to the model's
        `param_dtype` and transposed where Flax's layout differs; the layers' tensors go into
        their index of the stacked `layers` leaves (`model.layers.{i}.…` -> `[i]`). Each leaf is
        placed with `sharding`: None (the default device), a `Sharding` for every leaf, a `Mesh`
        (or a `dew_lib.train.mesh.MeshSpec`, built over every device): each leaf split as its
        declared logical axes ask on that mesh, the sharding a `Trainer` on it gives the
        parameter (`partitioning.tree_shardings`; undeclared leaves and a mesh without `fsdp`
        or `tensor` axes larger than one: replicated), or a callable
        `(params_path, flax_shape) -> Sharding` for per-leaf layouts (a layer leaf's shape has
        the leading layer axis). Every process fills only its own devices' shards.
        """
        return loading.load(self, directory, sharding=sharding)

    # -- out -------------------------------------------------------------------------------

    def export(self, variables: Mapping[str, Any], *, dtype: Any = jnp.bfloat16
               ) -> Iterator[tuple[str, Any]]:
        """Yield `(hf_name, array)` for every tensor `save` would write, in the same order.

        Arrays have the Hugging Face layout and `dtype` (None keeps each leaf's dtype). A
        `jax.Array` leaf is cast and transposed where it lives and yielded as a `jax.Array`
        (split as the leaf is), so a weight push can send it from the device; a NumPy leaf
        yields a NumPy array. A leaf split across processes is gathered one tensor at a time
        into a NumPy array on every process, so every process must run the export alongside.
        Nothing touches disk and only the tensor being yielded is newly allocated.
        """
        return saving.export(self, variables, dtype=dtype)

    def save(
        self,
        variables: Mapping[str, Any],
        directory: str | Path,
        *,
        dtype: Any = jnp.bfloat16,
        max_shard_size: int | str = "5GB",
        overwrite: bool = True,
        write: bool = True,
    ) -> Path:
        """Write a Hugging Face checkpoint directory that transformers, vLLM and SGLang load.

        Tensors go out through `export` in `dtype` (bfloat16 by default; None keeps the leaves'
        dtypes), in one `model.safetensors` or, above `max_shard_size` bytes ("5GB", "512MiB"
        or an int), in shards with `model.safetensors.index.json`. config.json records the
        dtype; the tokenizer and generation_config.json go along when present. Everything is
        written to a hidden sibling directory and renamed over `directory` at the end, so a
        reader never sees half a checkpoint. Each tensor is written as it comes to the host
        (gathered from its shards where the variables are split), so the host holds one tensor
        at a time beside the variables' own host copies.

        In a multi-process job whose variables are split across processes, every process calls
        `save` together (each tensor's gather is a collective); one writes and the others pass
        `write=False`, which takes part in the gathers and writes nothing.
        """
        return saving.save(self, variables, directory, dtype=dtype,
                           max_shard_size=max_shard_size, overwrite=overwrite, write=write)


class Loaded(NamedTuple):
    """What `load_pretrained` returns: unpack as `pretrained, variables = load_pretrained(...)`."""

    pretrained: Pretrained
    variables: dict[str, Any]

    @property
    def model(self) -> CausalTransformer:
        return self.pretrained.model

    @property
    def tokenizer(self) -> Any:
        return self.pretrained.tokenizer


def load_pretrained(
    directory: str | Path,
    *,
    dtype: Any = jnp.float32,
    compute_dtype: Any = None,
    sharding: ShardingSpec = None,
    tokenizer: bool = True,
) -> Loaded:
    """Load a local Hugging Face checkpoint: model, variables and tokenizer, without torch.

    Supports Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM and the mixture-of-experts
    Qwen3MoeForCausalLM, Qwen2MoeForCausalLM and MixtralForCausalLM (see `families.SUPPORTED`;
    docs/moe.md); anything whose config changes the math in a way Dew's decoder does
    not reproduce raises `UnsupportedCheckpoint`, and tensors that do not fit raise
    `CheckpointError`. `dtype` is the parameter dtype (float32 or bfloat16; the checkpoint's own
    dtype may differ), `compute_dtype` the activation dtype (default: `dtype`), `sharding` where
    the parameters go (see `Pretrained.load`). `tokenizer=False` skips loading the tokenizer.

    Returns `Loaded(pretrained, variables)`, which also offers `.model` and `.tokenizer`
    (None when the directory has no tokenizer files).
    """
    pretrained = Pretrained.from_directory(
        directory, dtype=dtype, compute_dtype=compute_dtype, tokenizer=tokenizer
    )
    return Loaded(pretrained, pretrained.load(directory, sharding=sharding))
