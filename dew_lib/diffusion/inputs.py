"""The diffusion input contract: which batch field is generated, which ones condition it.

`InputSpec(Field("image", (H, W, C)), Field("prompt", (L,), encoder=..., tokenizer=...))`:
the first field is what the model generates (images as uint8 in [0, 255] or floats in
[-1, 1]); every further field is a condition and needs an `encoder` that maps its values
`[B, *shape]` to a feature vector `[B, F]` inside jit (the features of all conditions are
concatenated and handed to the model). A batch's size comes from the image field, or from the
conditions when a batch carries prompts only (`inputs.tokenize(prompts)`).

An `AutoEncoder` maps images in [-1, 1] to the latents the process runs on and back;
`Identity` (the default) runs on pixels.

Not here: trainable encoders (an encoder is a frozen function; put trainable conditioning in
the model), text encoders from pretrained checkpoints, learned autoencoders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.data.dataset import describe


class AutoEncoder(Protocol):
    """Images in [-1, 1] to latents and back, both jit-friendly."""

    def latent_shape(self, image_shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def encode(self, images: jax.Array) -> jax.Array: ...

    def decode(self, latents: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class Identity:
    """The process runs on pixels: latents are the images."""

    def latent_shape(self, image_shape):
        return tuple(image_shape)

    def encode(self, images):
        return images

    def decode(self, latents):
        return latents


@dataclasses.dataclass(frozen=True)
class BagOfTokens:
    """Encoder: integer ids `[B]` or `[B, L]` to their normalized counts `[B, vocab_size]`.

    A label field (shape `()`) becomes a one-hot vector; a token field averages its one-hots,
    skipping `pad_id`. An all-padding row encodes to zeros, the unconditional input.
    """

    vocab_size: int
    pad_id: int | None = 0

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ValueError(f"BagOfTokens.vocab_size must be >= 1, got {self.vocab_size}")

    def __call__(self, ids: jax.Array) -> jax.Array:
        ids = ids.reshape(ids.shape[0], -1)
        hot = jax.nn.one_hot(ids, self.vocab_size, dtype=jnp.float32)  # [B, L, V]
        if self.pad_id is not None:
            hot = hot * (ids != self.pad_id)[..., None]
        return hot.sum(axis=1) / jnp.maximum(hot.sum(axis=(1, 2))[:, None], 1.0)


@dataclasses.dataclass(frozen=True)
class WordTokenizer:
    """Whitespace words to ids `[B, length]`: 0 pads, `words[i]` is id `i + 1`; `decode` inverts."""

    words: tuple[str, ...]
    length: int

    def __post_init__(self):
        object.__setattr__(self, "words", tuple(self.words))
        if len(set(self.words)) != len(self.words) or not self.words:
            raise ValueError("WordTokenizer.words must be a non-empty list of distinct words")
        if self.length < 1:
            raise ValueError(f"WordTokenizer.length must be >= 1, got {self.length}")

    @property
    def vocab_size(self) -> int:
        return len(self.words) + 1

    def __call__(self, prompts: Sequence[str]) -> np.ndarray:
        index = {w: i + 1 for i, w in enumerate(self.words)}
        out = np.zeros((len(prompts), self.length), np.int32)
        for row, prompt in enumerate(prompts):
            words = prompt.split()
            unknown = [w for w in words if w not in index]
            if unknown:
                raise ValueError(f"prompt {prompt!r} has words outside the vocabulary: {unknown}")
            if len(words) > self.length:
                raise ValueError(f"prompt {prompt!r} has {len(words)} words; the field holds {self.length}")
            out[row, : len(words)] = [index[w] for w in words]
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.words[int(i) - 1] for i in np.asarray(ids).reshape(-1) if i > 0)


@dataclasses.dataclass(frozen=True)
class Field:
    """One batch field: its name and per-row shape.

    dtype: the dtype batches must carry (None: any numeric for the image, int32 for the zeros a
    condition is initialized with). encoder: for a condition, `values [B, *shape] -> [B, F]`.
    tokenizer: for a condition, `prompts -> ids [B, *shape]`, optionally with `decode(row)` for
    preview captions.
    """

    name: str
    shape: tuple[int, ...]
    _: dataclasses.KW_ONLY
    dtype: str | None = None
    encoder: Callable[[jax.Array], jax.Array] | None = None
    tokenizer: Any = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Field.name must be a non-empty string, got {self.name!r}")
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(self.shape)
        if any(not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
            raise ValueError(f"Field {self.name!r}: shape must be positive integers, got {self.shape}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if self.dtype is not None:
            object.__setattr__(self, "dtype", np.dtype(self.dtype).name)


class InputSpec:
    """The generated field first, then its conditions: `InputSpec(image, *conditions)`."""

    def __init__(self, image: Field, *conditions: Field):
        for f in (image, *conditions):
            if not isinstance(f, Field):
                raise TypeError(f"InputSpec takes Field values, got {f!r}")
        names = [f.name for f in (image, *conditions)]
        if len(set(names)) != len(names):
            raise ValueError(f"InputSpec field names must be distinct, got {names}")
        if len(image.shape) != 3:
            raise ValueError(
                f"InputSpec's first field {image.name!r} is the generated image and needs shape "
                f"(height, width, channels), got {image.shape}"
            )
        for c in conditions:
            if c.encoder is None:
                raise ValueError(
                    f"condition field {c.name!r} needs an encoder (e.g. Field({c.name!r}, "
                    f"{c.shape}, encoder=BagOfTokens(vocab_size))) that maps it to features"
                )
        self.image = image
        self.conditions = tuple(conditions)

    def __repr__(self):
        return f"InputSpec{(self.image, *self.conditions)!r}"

    @property
    def conditioned(self) -> bool:
        return bool(self.conditions)

    # ----- host side -----------------------------------------------------------------------
    def batch_size(self, batch: Mapping[str, Any]) -> int:
        """Rows in a batch: from the image field, else from the conditions (prompt-only)."""
        for f in (self.image, *self.conditions):
            if f.name in batch:
                return int(np.shape(batch[f.name])[0])
        raise KeyError(
            f"the batch has none of this InputSpec's fields "
            f"{[f.name for f in (self.image, *self.conditions)]}; it has {describe(batch)}"
        )

    def check(self, batch: Mapping[str, Any], *, image_required: bool = False) -> int:
        """Refuse a source batch that does not match the spec; return its size."""
        rows = self.batch_size(batch)
        if image_required and self.image.name not in batch:
            raise KeyError(f"the batch needs the image field {self.image.name!r}; it has {describe(batch)}")
        if not self.conditioned and self.image.name not in batch:
            raise KeyError(
                f"an unconditioned InputSpec takes its batch size from the image field "
                f"{self.image.name!r}, which the batch lacks; it has {describe(batch)}"
            )
        for f in (self.image, *self.conditions):
            if f.name not in batch:
                if f is not self.image:
                    raise KeyError(
                        f"the batch lacks the condition field {f.name!r} [B, *{f.shape}]; it has "
                        f"{describe(batch)} (build prompt-only batches with inputs.tokenize)"
                    )
                continue
            value = batch[f.name]
            shape = tuple(np.shape(value))
            if shape != (rows, *f.shape):
                raise ValueError(
                    f"batch field {f.name!r} has shape {shape}, but the InputSpec expects "
                    f"{(rows, *f.shape)} ([B, *{f.shape}] with B = {rows})"
                )
            dtype = np.asarray(value).dtype
            if f.dtype is not None and dtype.name != f.dtype:
                raise TypeError(f"batch field {f.name!r} holds {dtype}, but its Field declares {f.dtype}")
            if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
                raise TypeError(f"batch field {f.name!r} holds {dtype}; it must be numeric")
        return rows

    def tokenize(self, prompts: Sequence[str]) -> dict[str, np.ndarray]:
        """A prompt-only batch: every condition field with a tokenizer, from the prompt texts."""
        if isinstance(prompts, str):
            raise TypeError("tokenize takes a list of prompts, not one string")
        fields = [c for c in self.conditions if c.tokenizer is not None]
        if not fields:
            raise ValueError("no condition field of this InputSpec has a tokenizer; give one with "
                             "Field(name, shape, encoder=..., tokenizer=...)")
        return {c.name: np.asarray(c.tokenizer(list(prompts))) for c in fields}

    def captions(self, batch: Mapping[str, Any]) -> list[str]:
        """One text per row from decodable conditions (empty strings when there are none)."""
        rows = self.batch_size(batch)
        parts: list[list[str]] = [[] for _ in range(rows)]
        for c in self.conditions:
            decode = getattr(c.tokenizer, "decode", None)
            if decode is None or c.name not in batch:
                continue
            for row, ids in enumerate(np.asarray(batch[c.name])):
                parts[row].append(decode(ids))
        return [" | ".join(p) for p in parts]

    def zeros(self, rows: int) -> dict[str, np.ndarray]:
        """A zero batch of every field (for shapes at initialization)."""
        out = {self.image.name: np.zeros((rows, *self.image.shape), self.image.dtype or np.float32)}
        for c in self.conditions:
            out[c.name] = np.zeros((rows, *c.shape), c.dtype or np.int32)
        return out

    # ----- inside jit ----------------------------------------------------------------------
    def images(self, batch: Mapping[str, jax.Array]) -> jax.Array:
        """The image field as float32 in [-1, 1] (uint8 values are scaled from [0, 255])."""
        value = batch[self.image.name]
        if jnp.issubdtype(value.dtype, jnp.integer):
            return value.astype(jnp.float32) / 127.5 - 1.0
        return value.astype(jnp.float32)

    def encode(self, batch: Mapping[str, jax.Array]) -> jax.Array | None:
        """Condition features `[B, F]` (all conditions concatenated), or None when unconditioned."""
        if not self.conditions:
            return None
        parts = [jnp.asarray(c.encoder(jnp.asarray(batch[c.name])), jnp.float32) for c in self.conditions]
        return jnp.concatenate([p.reshape(p.shape[0], -1) for p in parts], axis=1)

    def condition_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Only the condition fields of a batch."""
        return {c.name: batch[c.name] for c in self.conditions}
