"""`Pretrained` and `load_pretrained`: Hugging Face checkpoints in and out of the decoder.

`load_pretrained(directory)` reads a local Hugging Face directory (config.json, safetensors,
tokenizer) into a `CausalTransformer`, its variables and its tokenizer, without torch. Weights
stream tensor by tensor from disk onto the devices (or a given `jax.sharding`), so the host holds
one copy of the model plus one scratch tensor. `Pretrained.save` writes the reverse: safetensors
(bfloat16 by default, sharded above a size), config.json, generation_config.json and the tokenizer,
staged beside the target and swapped in. `Pretrained.export` yields the same tensors by name
without touching disk, for pushing weights straight into a serving engine.

Not here: downloading from the Hub (directories must be local), `.bin`/pickle checkpoints,
multi-process gathering before a save (gather to host first; `export` and `save` need every
leaf's data on this process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from dew_lib.models import rotary
from dew_lib.models.decoder import CausalTransformer
from dew_lib.models.pretrained import families, files, layout
from dew_lib.models.pretrained.families import Family, UnsupportedCheckpoint
from dew_lib.models.pretrained.files import CheckpointError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "bf16": "bfloat16", "f16": "float16",
                  "fp16": "float16"}
_SAVE_DTYPES = ("float32", "bfloat16", "float16")

ShardingSpec = Sharding | Mesh | Callable[[tuple[str, ...], tuple[int, ...]], Sharding] | None


def _dtype(value: Any) -> np.dtype:
    """A numpy dtype (bfloat16 via ml_dtypes) from a jnp/np dtype or a name such as "bf16"."""
    if isinstance(value, str):
        value = _DTYPE_ALIASES.get(value.lower(), value.lower())
    return np.dtype(jnp.dtype(value))


def _model_dtype(value: Any) -> Any:
    """The jnp scalar type (as `models.build` uses) for a float dtype given in any spelling."""
    name = _dtype(value).name
    if name not in _SAVE_DTYPES:
        raise ValueError(f"parameters load as one of {_SAVE_DTYPES}, not {name}")
    return getattr(jnp, name)


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


def _load_tokenizer(directory: Path) -> Any:
    """The directory's tokenizer through transformers, or None when it ships none."""
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # imported late: loading weights does not need it

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _params_of(variables: Mapping[str, Any]) -> Mapping[str, Any]:
    """The `params` collection of full Flax variables (a bare params mapping is accepted too)."""
    if "params" in variables:
        return variables["params"]
    if "embed_tokens" in variables:
        return variables
    raise ValueError(
        f"expected Flax variables with a 'params' collection, got keys {sorted(variables)[:8]}"
    )


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def _sharding_for(spec: ShardingSpec, path: tuple[str, ...], shape: tuple[int, ...]):
    if spec is None or isinstance(spec, Sharding):
        return spec
    if isinstance(spec, Mesh):
        return NamedSharding(spec, PartitionSpec())
    return spec(path, shape)


def _place(array: np.ndarray, sharding: Sharding | None, *, owned: bool) -> jax.Array:
    """Put a host array (possibly a strided view) onto devices.

    `owned`: nothing else will touch the array's memory, so a CPU device may adopt it as its
    buffer instead of copying; otherwise (a reused scratch buffer) a copy is forced.
    """
    if sharding is None:
        return jax.device_put(array, may_alias=owned)
    if sharding.is_fully_addressable:
        return jax.device_put(array, sharding, may_alias=owned)
    # Multi-process: every process reads the same file and fills only its own shards.
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


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
        actual = {key: getattr(self.model, key) for key in options}
        actual["num_kv_heads"] = self.model.kv_heads
        actual["head_dim"] = self.model.head_features
        differing = {
            key: (value, actual[key])
            for key, value in options.items()
            if key not in ("rope_theta", "rope_scaling") and actual[key] != value
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
        Qwen3; q/k/v biases: Qwen2; neither: Llama). `config` adds fields to the generated
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
        built = families.config_for_model(model, family, _dtype(model.param_dtype).name)
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
        param_dtype = _model_dtype(dtype)
        model = CausalTransformer(
            **options,
            dtype=param_dtype if compute_dtype is None else _model_dtype(compute_dtype),
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
        return layout.tensors(self.model)

    # -- in --------------------------------------------------------------------------------

    def load(self, directory: str | Path, *, sharding: ShardingSpec = None) -> dict[str, Any]:
        """Read the safetensors under `directory` into Flax variables `{"params": ...}`.

        Every tensor is checked against the model before any is read: a missing or unexpected
        tensor (by name), a wrong shape (name and both shapes) or a non-float dtype raise
        `CheckpointError`. Tensors are then read one at a time, cast to the model's
        `param_dtype` and transposed where Flax's layout differs; the layers' tensors go into
        their index of the stacked `layers` leaves (`model.layers.{i}.…` -> `[i]`). Each leaf is
        placed with `sharding`: None (the default device), a `Sharding` for every leaf, a `Mesh`
        (replicated on it), or a callable `(params_path, flax_shape) -> Sharding` for per-leaf
        layouts (a layer leaf's shape has the leading layer axis).
        """
        directory = Path(directory)
        expected = self.tensors
        located = files.locate(directory)
        stored = files.headers(located)
        self._check_stored(stored, expected)
        embedding = expected[0].name
        if self.model.tie_embeddings and layout.TIED_COPY in located and not files.same_tensor(
                located, layout.TIED_COPY, embedding):
            raise CheckpointError(
                f"tie_word_embeddings is true but the checkpoint's {layout.TIED_COPY} differs "
                f"from {embedding}; transformers would use them untied, so set "
                "tie_word_embeddings to false in config.json (or drop the copy)"
            )
        target = _dtype(self.model.param_dtype)

        def direct(tensor):  # stored exactly as Flax wants it: read into the final buffer
            return not tensor.transpose and files.FLOAT_DTYPES[stored[tensor.name][0]] == target

        # Each params leaf with the tensors that fill it: one, or one per layer for a stacked
        # layer leaf (read into its slice of the leaf's buffer).
        by_leaf: dict[tuple[str, ...], list[layout.Tensor]] = {}
        for tensor in expected:
            by_leaf.setdefault(tensor.path, []).append(tensor)
        shapes = layout.leaf_shapes(expected)
        # Tensors not read straight into place pass through one scratch buffer, sized for the
        # largest of them.
        scratch_bytes = max(
            [math.prod(t.shape) * files.FLOAT_DTYPES[stored[t.name][0]].itemsize
             for t in expected if not direct(t)] or [0]
        )
        scratch = files.aligned_empty(scratch_bytes) if scratch_bytes else None
        params: dict[str, Any] = {}
        with contextlib.ExitStack() as stack:
            readers = {path: stack.enter_context(files.Reader(path))
                       for path in dict.fromkeys(located[t.name] for t in expected)}
            for path, group in by_leaf.items():
                placement = _sharding_for(sharding, path, shapes[path])
                if group[0].layer is None:
                    leaf = self._read_one(readers[located[group[0].name]], group[0], direct,
                                          scratch, target, placement)
                else:
                    leaf = self._read_stack(readers, located, group, shapes[path], direct,
                                            scratch, target, placement)
                node = params
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = leaf
        return {"params": params}

    @staticmethod
    def _read_one(reader, tensor, direct, scratch, target, placement) -> jax.Array:
        """One tensor as one params leaf."""
        if direct(tensor):
            return _place(reader.read(tensor.name), placement, owned=True)
        array = reader.read(tensor.name, scratch[: reader.nbytes(tensor.name)])
        owned = array.dtype != target
        if owned:
            array = array.astype(target)
        leaf = _place(array.T if tensor.transpose else array, placement, owned=owned)
        leaf.block_until_ready()  # the scratch buffer is reused next
        return leaf

    @staticmethod
    def _read_stack(readers, located, group, shape, direct, scratch, target, placement
                    ) -> jax.Array:
        """The tensors of every layer into one stacked leaf `[L, ...]`, each at its index."""
        buffer = files.aligned_empty(math.prod(shape) * target.itemsize)
        stacked = buffer.view(target).reshape(shape)
        per_layer = len(buffer) // shape[0]
        for tensor in group:
            reader = readers[located[tensor.name]]
            if direct(tensor):
                start = tensor.layer * per_layer
                reader.read(tensor.name, buffer[start:start + per_layer])
            else:
                array = reader.read(tensor.name, scratch[: reader.nbytes(tensor.name)])
                stacked[tensor.layer] = array.T if tensor.transpose else array
        return _place(stacked, placement, owned=True)

    def _check_stored(self, stored: Mapping[str, tuple[str, tuple[int, ...]]],
                      expected: list[layout.Tensor]) -> None:
        names = {t.name for t in expected}
        missing = [t.name for t in expected if t.name not in stored]
        if missing:
            raise CheckpointError(
                f"checkpoint is missing {len(missing)} tensor(s) the {self.family.architecture} "
                f"config requires: {missing[:10]}"
            )
        extra = [n for n in stored if n not in names and not layout.ignorable(n, self.model)]
        if extra:
            raise CheckpointError(
                f"checkpoint has {len(extra)} tensor(s) the {self.family.architecture} config does "
                f"not account for: {extra[:10]}"
            )
        for t in expected:
            dtype, shape = stored[t.name]
            if shape != t.shape:
                raise CheckpointError(
                    f"tensor {t.name} has shape {shape} in the checkpoint but the config implies "
                    f"{t.shape}"
                )
            if dtype not in files.FLOAT_DTYPES:
                raise CheckpointError(
                    f"tensor {t.name} is stored as {dtype}; Dew loads float tensors only "
                    f"({sorted(files.FLOAT_DTYPES)})"
                )

    # -- out -------------------------------------------------------------------------------

    def export(self, variables: Mapping[str, Any], *, dtype: Any = jnp.bfloat16
               ) -> Iterator[tuple[str, Any]]:
        """Yield `(hf_name, array)` for every tensor `save` would write, in the same order.

        Arrays have the Hugging Face layout and `dtype` (None keeps each leaf's dtype). A
        `jax.Array` leaf is cast and transposed where it lives and yielded as a `jax.Array`, so
        a weight push can send it from the device; a NumPy leaf yields a NumPy array. Nothing
        touches disk and only the tensor being yielded is newly allocated.
        """
        target = None if dtype is None else _dtype(dtype)
        if target is not None and target.name not in _SAVE_DTYPES:
            raise ValueError(f"cannot export as {target.name}; use one of {_SAVE_DTYPES}")
        flat = self._leaves(variables)
        for tensor in self.tensors:
            leaf = flat[tensor.path]
            if tensor.layer is not None:
                leaf = leaf[tensor.layer]
            if isinstance(leaf, jax.Array):
                out = leaf if target is None else leaf.astype(target)
                yield tensor.name, (out.T if tensor.transpose else out)
            else:
                out = np.asarray(leaf)
                out = out if target is None else out.astype(target, copy=False)
                yield tensor.name, np.ascontiguousarray(out.T if tensor.transpose else out)

    def _leaves(self, variables: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
        """The params leaves by path, checked to be exactly the model's, with its shapes."""
        flat = _flatten(_params_of(variables))
        expected = layout.leaf_shapes(self.tensors)
        missing = [".".join(p) for p in expected if p not in flat]
        extra = [".".join(p) for p in flat if p not in expected]
        if missing or extra:
            hint = ("; these variables keep one layers_i subtree per layer: convert them with "
                    "dew_lib.models.decoder.stack_layers" if any(p[0] == "layers_0" for p in flat)
                    else "")
            raise ValueError(
                f"variables do not match the model: missing params {missing[:10]}, "
                f"unexpected params {extra[:10]}{hint}"
            )
        for path, want in expected.items():
            shape = tuple(np.shape(flat[path]))
            if shape != want:
                raise ValueError(
                    f"param {'.'.join(path)} has shape {shape}, the model expects {want}"
                )
        return flat

    def save(
        self,
        variables: Mapping[str, Any],
        directory: str | Path,
        *,
        dtype: Any = jnp.bfloat16,
        max_shard_size: int | str = "5GB",
        overwrite: bool = True,
    ) -> Path:
        """Write a Hugging Face checkpoint directory that transformers, vLLM and SGLang load.

        Tensors go out through `export` in `dtype` (bfloat16 by default; None keeps the leaves'
        dtypes), in one `model.safetensors` or, above `max_shard_size` bytes ("5GB", "512MiB"
        or an int), in shards with `model.safetensors.index.json`. config.json records the
        dtype; the tokenizer and generation_config.json go along when present. Everything is
        written to a hidden sibling directory and renamed over `directory` at the end, so a
        reader never sees half a checkpoint. At most one shard's tensors are on the host at once.
        """
        limit = files.parse_size(max_shard_size)
        flat = self._leaves(variables)
        for path, leaf in flat.items():
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                raise ValueError(
                    f"param {'.'.join(path)} spans processes; gather the variables to host "
                    "memory (e.g. multihost_utils.process_allgather) before saving"
                )
        target = None if dtype is None else _dtype(dtype)
        dtypes = {_dtype(flat[t.path].dtype) if target is None else target for t in self.tensors}
        if len(dtypes) != 1 or next(iter(dtypes)).name not in _SAVE_DTYPES:
            raise ValueError(
                f"save writes one float dtype among {_SAVE_DTYPES}; the leaves would give "
                f"{sorted(d.name for d in dtypes)} (pass dtype=...)"
            )
        saved = next(iter(dtypes))
        sizes = [(t.name, math.prod(t.shape) * saved.itemsize) for t in self.tensors]
        config = {**self.config, "dtype": saved.name}
        if "torch_dtype" in config:
            config["torch_dtype"] = saved.name
        stream = ((name, np.asarray(array)) for name, array in self.export(variables, dtype=saved))
        with files.staged_directory(Path(directory), overwrite) as stage:
            files.write(stage, stream, sizes, limit)
            (stage / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            if self.generation_config is not None:
                (stage / GENERATION_CONFIG).write_text(
                    json.dumps(dict(self.generation_config), indent=2) + "\n"
                )
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(str(stage))
        return Path(directory)


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

    Supports Qwen3ForCausalLM, Qwen2ForCausalLM and LlamaForCausalLM (see
    `families.SUPPORTED`); anything whose config changes the math in a way Dew's decoder does
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
