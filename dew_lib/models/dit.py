"""SimpleDiT: a small diffusion transformer over image patches (Peebles and Xie's DiT, reduced).

`SimpleDiT(...)(x [B, H, W, C], t [B], condition [B, F] | None) -> [B, H, W, output_channels]`.
The image is cut into `patch_size` squares, each embedded and given a fixed 2-D sine-cosine
position code. The time `t` in [0, 1] (and the condition's features, when given) form one
embedding that modulates every block through adaptive layer norm (shift, scale and a gate).
The gates and the output projection start at zero, so a fresh model predicts 0 everywhere and
each block starts as the identity.

With `lora=DiTLoRA(...)` the blocks' attention and MLP projections carry low-rank adapters beside
their kernels, initialised and scaled as the decoder's (models/lora.py: `A` Kaiming-uniform, `B`
zero, so a fresh adapter changes no velocity); the Trainer then trains the adapters alone.
`attach` adds fresh adapters to a trained DiT's variables, `merged` folds them into the kernels
(`W + s A B`) for a plain SimpleDiT's checkpoint. Adapter dropout (`DiTLoRA.dropout`) drops units
of an adapted projection's input on the adapter's path only, as the decoder's adapters do, and only
in a call given a `dropout` rng (Flow-GRPO's training forward): block i draws from that key folded
with i, each adapter from the block's key folded with its place in `TARGETS`.

Not here: cross-attention to token sequences (conditions arrive as one feature vector),
learned position embeddings, dropout outside the adapters, mixed precision.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew_lib.models import lora, partitioning

_ZERO = nn.initializers.zeros
TARGETS = ("qkv", "attention_out", "mlp_in", "mlp_out")  # each block's projections LoRA may adapt

# Logical axes (partitioning.py): under FSDP each weight is split along its model-width side.
_WIDE_IN, _WIDE_OUT, _BIAS = ("embed", None), (None, "embed"), (None,)
partitioning.declare({
    **{(name, "kernel"): _WIDE_IN for name in ("qkv", "modulation", "mlp_in", "final_modulation",
                                                   "output", "time_out")},
    **{(name, "kernel"): _WIDE_OUT for name in ("attention_out", "mlp_out", "time_in", "condition")},
    **{(name, "bias"): _BIAS for name in ("qkv", "modulation", "mlp_in", "final_modulation", "output",
                                          "time_out", "attention_out", "mlp_out", "time_in", "condition",
                                          "patches")},
    ("patches", "kernel"): (None, None, None, "embed"),
    # adapters: A splits like its kernel's input, B like its output
    **{(name, "lora_a"): (kernel[0], None) for name, kernel in
       (("qkv", _WIDE_IN), ("mlp_in", _WIDE_IN), ("attention_out", _WIDE_OUT), ("mlp_out", _WIDE_OUT))},
    **{(name, "lora_b"): (None, kernel[1]) for name, kernel in
       (("qkv", _WIDE_IN), ("mlp_in", _WIDE_IN), ("attention_out", _WIDE_OUT), ("mlp_out", _WIDE_OUT))},
})


@dataclasses.dataclass(frozen=True)
class DiTLoRA(lora.LoRA):
    """Which of a SimpleDiT's block projections get adapters, and how large (rank, alpha, rslora
    and the scale as in `lora.LoRA`).

    targets: among qkv, attention_out, mlp_in, mlp_out, or "all-linear" for the four; the
    adaptive norms' modulation, the time and condition embeddings, the patch embedding and the
    output projection are never adapted. dropout: as `lora.LoRA`'s, on the adapters' path in
    training only (module docstring).
    """

    targets: tuple[str, ...] | str = ("qkv", "attention_out")

    def __post_init__(self):
        # LoRA's own checks of every other field
        lora.LoRA(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "targets"})
        object.__setattr__(self, "dropout", float(self.dropout))
        targets = TARGETS if self.targets == "all-linear" else self.targets
        if isinstance(targets, str):
            targets = (targets,)
        if not targets or any(name not in TARGETS for name in targets):
            raise ValueError(f"DiTLoRA.targets must name projections among {', '.join(TARGETS)} or be "
                             f"'all-linear'; got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(name for name in TARGETS if name in targets))
        object.__setattr__(self, "alpha", float(self.alpha))


class _Adapted(nn.Dense):
    """`nn.Dense` (the same `kernel` and `bias`) plus `lora_scale * (dropout(x) A) B`, with
    `lora_a` `[in, r]` and `lora_b` `[r, out]` beside the kernel; `x` drops (at `lora_dropout`)
    only when a `dropout` key is given, and on the adapter's path only."""

    lora_rank: int = 1
    lora_scale: float = 1.0
    lora_dropout: float = 0.0

    @nn.compact
    def __call__(self, x, dropout=None):
        out = super().__call__(x)
        a = self.param("lora_a", lora.A_INIT, (jnp.shape(x)[-1], self.lora_rank), self.param_dtype)
        b = self.param("lora_b", _ZERO, (self.lora_rank, self.features), self.param_dtype)
        seen = x if dropout is None else lora.dropped(x, dropout, self.lora_dropout)
        low = jnp.dot(jnp.dot(seen.astype(out.dtype), a.astype(out.dtype)), b.astype(out.dtype))
        return out + self.lora_scale * low


def timestep_embedding(t: jax.Array, features: int, max_period: float = 10_000.0) -> jax.Array:
    """Sine-cosine features `[B, features]` of `t * 1000` (t in [0, 1])."""
    half = features // 2
    frequencies = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / max(half, 1))
    angles = (t.astype(jnp.float32) * 1000.0)[:, None] * frequencies[None]
    out = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    if features % 2:
        out = jnp.pad(out, ((0, 0), (0, 1)))
    return out


def position_code(height: int, width: int, features: int) -> jax.Array:
    """Fixed 2-D sine-cosine position code `[height * width, features]`."""
    quarter = features // 4
    frequencies = 1.0 / 10_000.0 ** (jnp.arange(quarter, dtype=jnp.float32) / max(quarter, 1))
    rows, cols = jnp.meshgrid(jnp.arange(height, dtype=jnp.float32),
                              jnp.arange(width, dtype=jnp.float32), indexing="ij")
    parts = []
    for grid in (rows.reshape(-1), cols.reshape(-1)):
        angles = grid[:, None] * frequencies[None]
        parts += [jnp.sin(angles), jnp.cos(angles)]
    code = jnp.concatenate(parts, axis=-1)
    return jnp.pad(code, ((0, 0), (0, features - code.shape[-1])))


def _modulate(x, shift, scale):
    return x * (1.0 + scale[:, None]) + shift[:, None]


class DiTBlock(nn.Module):
    """Self-attention and an MLP, each behind an adaptive layer norm with a zero-started gate."""

    num_heads: int
    mlp_ratio: float
    param_dtype: Any = jnp.float32
    lora: Any = None  # a DiTLoRA: which projections carry adapters

    def _dense(self, features: int, name: str, dropout=None):
        """A projection, with an adapter when `lora` targets it; `dropout`: the block's key of
        adapter dropout (None: nothing drops)."""
        if self.lora is not None and name in self.lora.targets:
            adapted = _Adapted(features, param_dtype=self.param_dtype, lora_rank=self.lora.rank,
                               lora_scale=self.lora.scale, lora_dropout=self.lora.dropout, name=name)
            key = None if dropout is None else jax.random.fold_in(dropout, TARGETS.index(name))
            return lambda x: adapted(x, key)
        return nn.Dense(features, param_dtype=self.param_dtype, name=name)

    def _attention(self, x, dropout):
        batch, length, features = x.shape
        heads = self.num_heads
        qkv = self._dense(3 * features, "qkv", dropout)(x)
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * heads, features // heads), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(features // heads)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self._dense(features, "attention_out", dropout)(mixed.reshape(batch, length, features))

    @nn.compact
    def __call__(self, h, c, dropout=None):
        features = h.shape[-1]
        modulation = nn.Dense(6 * features, kernel_init=_ZERO, param_dtype=self.param_dtype,
                              name="modulation")(nn.silu(c))
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(modulation, 6, axis=-1)

        def norm(name):
            return nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6, name=name)

        a = _modulate(norm("norm1")(h), shift1, scale1)
        a = self._attention(a, dropout)
        h = h + gate1[:, None] * a
        m = _modulate(norm("norm2")(h), shift2, scale2)
        hidden = max(1, int(round(features * self.mlp_ratio)))
        m = self._dense(hidden, "mlp_in", dropout)(m)
        m = self._dense(features, "mlp_out", dropout)(nn.gelu(m))
        return h + gate2[:, None] * m


class SimpleDiT(nn.Module):
    """A diffusion transformer for small images; see the module docstring.

    output_channels: channels of the prediction (the image's channels for velocity prediction).
    patch_size: side of the square patches; height and width must be multiples of it.
    emb_features: width of patch and time embeddings (a multiple of num_heads and of 4).
    mlp_ratio: MLP width as a multiple of emb_features.
    lora: a DiTLoRA for low-rank adapters on the blocks' projections (module docstring), or None.
    """

    output_channels: int
    patch_size: int = 2
    emb_features: int = 64
    num_layers: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    param_dtype: Any = jnp.float32
    lora: Any = None

    def _check(self, x):
        if self.output_channels < 1 or self.patch_size < 1 or self.num_layers < 0 or self.num_heads < 1:
            raise ValueError(
                f"SimpleDiT needs output_channels, patch_size, num_heads >= 1 and num_layers >= 0; got "
                f"output_channels={self.output_channels}, patch_size={self.patch_size}, "
                f"num_layers={self.num_layers}, num_heads={self.num_heads}"
            )
        if self.emb_features % self.num_heads or self.emb_features % 4:
            raise ValueError(
                f"SimpleDiT.emb_features={self.emb_features} must be a multiple of num_heads="
                f"{self.num_heads} and of 4"
            )
        if self.lora is not None and not isinstance(self.lora, DiTLoRA):
            raise TypeError(f"SimpleDiT.lora must be a dew_lib.models.dit.DiTLoRA (targets among "
                            f"{', '.join(TARGETS)}), got {self.lora!r}")
        if x.ndim != 4 or x.shape[1] % self.patch_size or x.shape[2] % self.patch_size:
            raise ValueError(
                f"SimpleDiT takes images [B, H, W, C] with H and W multiples of patch_size="
                f"{self.patch_size}; got shape {x.shape}"
            )

    @nn.compact
    def __call__(self, x: jax.Array, t: jax.Array, condition: jax.Array | None = None) -> jax.Array:
        self._check(x)
        batch, height, width, _ = x.shape
        p, e = self.patch_size, self.emb_features
        rows, cols = height // p, width // p
        h = nn.Conv(e, (p, p), strides=(p, p), padding="VALID", param_dtype=self.param_dtype,
                    name="patches")(x.astype(jnp.float32))
        h = h.reshape(batch, rows * cols, e) + position_code(rows, cols, e)[None]
        c = nn.Dense(e, param_dtype=self.param_dtype, name="time_in")(timestep_embedding(t, e))
        c = nn.Dense(e, param_dtype=self.param_dtype, name="time_out")(nn.silu(c))
        if condition is not None:
            c = c + nn.Dense(e, param_dtype=self.param_dtype, name="condition")(
                condition.astype(jnp.float32))
        # adapter dropout only in a call given a `dropout` rng (a training forward), and only at a rate
        dropout = (self.make_rng("dropout") if self.lora is not None and self.lora.dropout
                   and self.has_rng("dropout") else None)
        for i in range(self.num_layers):  # rows pinned to the batch split (partitioning.constrain_rows)
            key = None if dropout is None else jax.random.fold_in(dropout, i)
            h = partitioning.constrain_rows(
                DiTBlock(self.num_heads, self.mlp_ratio, self.param_dtype, self.lora, name=f"blocks_{i}")(h, c, key))
        shift, scale = jnp.split(
            nn.Dense(2 * e, kernel_init=_ZERO, param_dtype=self.param_dtype, name="final_modulation")(
                nn.silu(c)), 2, axis=-1)
        h = _modulate(nn.LayerNorm(use_scale=False, use_bias=False, epsilon=1e-6, name="final_norm")(h),
                      shift, scale)
        out = nn.Dense(p * p * self.output_channels, kernel_init=_ZERO, param_dtype=self.param_dtype,
                       name="output")(h)  # [B, rows * cols, p * p * C]
        out = out.reshape(batch, rows, cols, p, p, self.output_channels)
        return out.transpose(0, 1, 3, 2, 4, 5).reshape(batch, height, width, self.output_channels)


def attach(model: SimpleDiT, variables: Any, config: DiTLoRA, key: jax.Array) -> tuple[SimpleDiT, dict]:
    """`model` with adapters as `config` says, and `variables` with fresh ones beside its kernels
    (A drawn from `key`, B zero: the same velocities as before). The base is not copied."""
    if not isinstance(config, DiTLoRA):
        raise TypeError(f"dit.attach needs a dew_lib.models.dit.DiTLoRA, got {type(config).__name__}")
    if model.lora is not None or lora.has_adapters(variables):
        raise ValueError("the SimpleDiT already has adapters; attach them to the base model once")
    params = dict(variables["params"])
    for i in range(model.num_layers):
        block = dict(params[f"blocks_{i}"])
        for j, name in enumerate(config.targets):
            kernel = block[name]["kernel"]  # [in, out]
            a = lora.A_INIT(jax.random.fold_in(jax.random.fold_in(key, i), j), (kernel.shape[0], config.rank),
                            kernel.dtype)
            block[name] = {**block[name], "lora_a": a, "lora_b": jnp.zeros((config.rank, kernel.shape[1]),
                                                                           kernel.dtype)}
        params[f"blocks_{i}"] = block
    return model.clone(lora=config), {**variables, "params": params}


def merged(model: SimpleDiT, variables: Any) -> tuple[SimpleDiT, dict]:
    """The model without adapters and `variables` with each adapter folded into its kernel
    (`W + s A B`): what a plain SimpleDiT checkpoint of the adapted model holds."""
    config = model.lora
    if config is None:
        return model, dict(variables)
    params = dict(variables["params"])
    for i in range(model.num_layers):
        block = dict(params[f"blocks_{i}"])
        for name in config.targets:
            part = dict(block[name])
            a, b = part.pop("lora_a"), part.pop("lora_b")
            kernel = part["kernel"]
            product = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
            part["kernel"] = (kernel.astype(jnp.float32) + config.scale * product).astype(kernel.dtype)
            block[name] = part
        params[f"blocks_{i}"] = block
    return model.clone(lora=None), {**variables, "params": params}
