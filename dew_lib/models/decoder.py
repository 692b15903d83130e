"""The causal decoder: Llama/Qwen2/Qwen3 math in Flax linen.

RMSNorm before attention and MLP, rotary positions, a SiLU-gated MLP, optional grouped-query
attention, qk-norm (Qwen3), attention biases (Qwen2) and tied embeddings. Parameter names follow
the Hugging Face module names so checkpoint import is a rename and a transpose. The layers'
parameters are one `layers` subtree whose leaves are stacked on a leading `[num_layers]` axis
(`params["layers"]["q_proj"]["kernel"]` is `[L, E, H * D]`; Hugging Face's `model.layers.{i}`
tensors are index i): a training step runs the layers as one `lax.scan` over that axis, so its
compiled program does not grow with depth.

Inputs may be packed: `segment_ids` keep attention inside each document (0 marks padding) and
`positions` restart the rotary clock per document. Generation uses an explicit `KVCache` pytree
rather than a mutable Flax collection, so the decode loop can donate and carry it.

Not here: sliding-window attention, mixture-of-experts layers, dropout.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core.scope import LazyRng

from dew_lib.kernels import KernelBuildError, load_causal_attention
from dew_lib.models import attention, fused_attention, head, rotary

_INIT = nn.initializers.normal(stddev=0.02)

# XLA options for compiled decode loops. XLA:CPU hands matmuls to its YNN library by default;
# for decode's few-row products ([B, E] by a weight, B <= 16) its dispatch costs more than it
# saves, and XLA's own dot emitter runs the same loop 5-15% faster (bench: Llama 8M, batch 1
# and 16). Training's large products keep YNN. Other backends ignore the option.
DECODE_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


class KVCache(NamedTuple):
    """Per-layer keys and values `[B, KV, T, D]` and how many slots of each row are filled `[B]`.

    Head-major, so each decode step's attention reads the cache without transposing it.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    lengths: jax.Array


def split_layers(variables) -> tuple[Any, ...]:
    """Each layer's parameters as a subtree of its own, sliced from the stacked `layers` of
    `variables` (or of a bare params mapping). What `CausalTransformer.decode` takes as `layers`.
    """
    params = variables["params"] if "params" in variables else variables
    stacked = params["layers"]
    count = jax.tree.leaves(stacked)[0].shape[0]
    return tuple(jax.tree.map(lambda p, i=i: p[i], stacked) for i in range(count))


def _is_per_layer(node) -> bool:
    return isinstance(node, Mapping) and "layers_0" in node and "layers" not in node


def _is_stacked(node) -> bool:
    return isinstance(node, Mapping) and isinstance(node.get("layers"), Mapping)


def stack_layers(tree):
    """Convert the per-layer layout (`layers_0`, `layers_1`, ... subtrees, what the decoder
    kept before its parameters were stacked) to one `layers` subtree stacked on a leading axis.

    Works on variables, bare params and anything holding params-shaped dicts (a train state
    with its optimizer moments); other nodes pass through. NumPy leaves stay NumPy.
    """
    def convert(node):
        if not _is_per_layer(node):
            return node
        count = sum(1 for key in node if key.startswith("layers_"))
        names = [f"layers_{i}" for i in range(count)]
        if any(name not in node for name in names):
            raise ValueError(f"per-layer subtrees are not numbered 0..{count - 1}: "
                             f"{sorted(k for k in node if k.startswith('layers_'))}")
        rest = {key: value for key, value in node.items() if not key.startswith("layers_")}

        def stack(*leaves):
            if all(isinstance(leaf, np.ndarray) for leaf in leaves):
                return np.stack(leaves)
            return jnp.stack(leaves)

        return {**rest, "layers": jax.tree.map(stack, *[node[name] for name in names])}

    return jax.tree.map(convert, tree, is_leaf=_is_per_layer)


def unstack_layers(tree):
    """The inverse of `stack_layers`: one `layers_i` subtree per index of the stacked axis.

    Leaves may be arrays or `jax.ShapeDtypeStruct`s (an abstract state to restore into).
    """
    def cut(leaf, i):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=leaf.sharding)
        return leaf[i]

    def convert(node):
        if not _is_stacked(node):
            return node
        stacked = node["layers"]
        count = jax.tree.leaves(stacked)[0].shape[0]
        rest = {key: value for key, value in node.items() if key != "layers"}
        return {**rest, **{f"layers_{i}": jax.tree.map(lambda p, i=i: cut(p, i), stacked)
                           for i in range(count)}}

    return jax.tree.map(convert, tree, is_leaf=_is_stacked)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as the reference implementations do."""

    eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return _rms_norm(x, weight, self.eps, self.dtype)


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def _rms_norm(x, weight, eps, dtype):
    """RMSNorm recomputed in the backward pass from its input: a layer keeps `x` for each of
    its two norms rather than `x` and its normalized copy."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(dtype)


class Linear(nn.Module):
    """A projection whose weights sibling projections can read, to run several as one matmul.

    Same parameters as `nn.Dense` (`kernel` `[in, out]`, optional `bias`), declared in `setup`
    so a parent can concatenate kernels that share an input.
    """

    in_features: int
    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        self.kernel = self.param("kernel", _INIT, (self.in_features, self.features), self.param_dtype)
        if self.use_bias:
            self.bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)

    def __call__(self, x):
        return fused(x, [self])[0]


def fused(x, projections):
    """Apply projections that share the input `x` as one matmul; returns one output each.

    The matmul runs on `[B*S, in]` rows: then the weight gradient contracts one axis. Over
    `[B, S, in]` it contracts two, which XLA:CPU compiles into a transposed copy of the output
    gradient and a matmul at half the speed (the step ran 1.08-1.11x faster as rows).
    """
    kernels = [p.kernel for p in projections]
    kernel = kernels[0] if len(kernels) == 1 else jnp.concatenate(kernels, axis=1)
    dtype = projections[0].dtype
    out = _on_rows(x, kernel, dtype)
    if any(p.use_bias for p in projections):
        out = out + jnp.concatenate([
            p.bias if p.use_bias else jnp.zeros((p.features,), p.param_dtype) for p in projections
        ]).astype(dtype)
    cuts = np.cumsum([p.features for p in projections])[:-1].tolist()
    return jnp.split(out, cuts, axis=-1)


def _on_rows(x, kernel, dtype):
    """`x @ kernel` computed on `[B*S, in]` rows (see `fused`), shaped back like `x`."""
    rows = x.reshape(-1, x.shape[-1]).astype(dtype)
    return jnp.dot(rows, kernel.astype(dtype)).reshape(*x.shape[:-1], kernel.shape[-1])


def _dense(in_features, features, name, dtype, param_dtype, bias=False):
    return Linear(in_features, features, bias, dtype, param_dtype, name=name)


def attend(q, k, v, mask):
    """Grouped-query attention: q `[B, Q, H, D]`, k/v `[B, T, KV, D]`, mask `[B, Q, T]`.

    Computed heads-first with batch and kv-head merged into one batch axis (`[B*KV, G*Q, D]`):
    XLA:CPU runs a single-batch-axis product much faster than one with two batch axes. The
    dense reference for `attend_causal`, and what any other mask uses.
    """
    b, sq, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    t = k.shape[1]
    qh = q.reshape(b, sq, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b * kv, g * sq, d)
    kh = k.transpose(0, 2, 1, 3).reshape(b * kv, t, d)
    vh = v.transpose(0, 2, 1, 3).reshape(b * kv, t, d)
    return attention.heads(qh, kh, vh, mask, g).reshape(b, kv, g, sq, d).transpose(
        0, 3, 1, 2, 4).reshape(b, sq, h * d)


ATTENTION_KERNELS = ("auto", "fused", "blockwise")


def attend_causal(q, k, v, segment_ids, block: int, kernel: str = "auto"):
    """Causal self-attention within segments: q `[B, S, H, D]`, k/v `[B, S, KV, D]`,
    segment_ids `[B, S]` (a query sees earlier keys of its own segment; padding, segment 0,
    sees padding). Returns `[B, S, H * D]`.

    `kernel` picks the implementation: "fused", the compiled XLA:CPU kernel of
    `fused_attention` (tiles kept in cache; about twice the blockwise form's speed on CPU);
    "blockwise", XLA operations by blocks of `block` queries, for any backend and head size;
    "auto", the fused kernel when JAX's default backend is the CPU and the head dim is a
    multiple of 8, else blockwise.
    """
    b, s, h, d = q.shape
    if _use_fused(kernel, d, h, k.shape[2]):
        return fused_attention.causal_attention(q, k, v, segment_ids).reshape(b, s, h * d)
    return _attend_blockwise(q, k, v, segment_ids, block)


def _use_fused(kernel: str, head_dim: int, heads: int, kv_heads: int) -> bool:
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}")
    if kernel != "auto":
        return kernel == "fused"
    if jax.default_backend() != "cpu" or not fused_attention.supported(head_dim, heads, kv_heads):
        return False
    try:
        load_causal_attention()
    except KernelBuildError as error:
        _warn_blockwise(str(error))
        return False
    return True


@functools.cache
def _warn_blockwise(reason: str) -> None:
    warnings.warn(f"attention_kernel='auto' runs the slower blockwise attention: {reason}",
                  RuntimeWarning, stacklevel=4)


def _attend_blockwise(q, k, v, segment_ids, block: int):
    """Causal attention by blocks of `block` queries, in XLA operations.

    Query block i reads only keys `[0, (i + 1) * block)`: the blocks above the diagonal, always
    fully masked, are never computed, which halves the score and softmax work of long
    sequences. Each block's softmax runs over every key it may see, so the result equals
    `attend` with the dense mask.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qh = q.reshape(b, s, kv, g, d).transpose(0, 2, 3, 1, 4)  # [B, KV, G, S, D]
    kh = k.transpose(0, 2, 1, 3).reshape(b * kv, s, d)
    vh = v.transpose(0, 2, 1, 3).reshape(b * kv, s, d)
    out = attention.causal_heads(qh, kh, vh, segment_ids, g, block)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h * d)


def attend_cached(q, k, v, visible):
    """One query per row against a head-major cache: q `[B, 1, H, D]`, k/v `[B, KV, T, D]`."""
    b, _, h, d = q.shape
    kv = k.shape[1]
    g, t = h // kv, k.shape[2]
    q = q.reshape(b * kv, g, d)  # one merged batch axis, as in `attend`
    scores = jnp.einsum("ngd,ntd->ngt", q, k.reshape(b * kv, t, d), preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None, :], scores.reshape(b, kv, g, t) * (d**-0.5), attention.NEG)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b * kv, g, t)
    return jnp.einsum("ngt,ntd->ngd", weights, v.reshape(b * kv, t, d)).reshape(b, 1, h * d)


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _gated_down(gate, up, kernel, dtype):
    """The MLP's `down_proj(silu(gate) * up)` on rows, given the down projection's kernel.

    Under `jax.checkpoint` with the down projection inside: a layer keeps `gate` and `up` for
    the backward pass and recomputes the gated product there (an elementwise pass) rather
    than keeping it as the down projection's input, one `[B*S, mlp_features]` array fewer
    in the layer scan's stacked residuals, and five fewer than autodiff keeps for the SiLU.
    """
    return _on_rows(nn.silu(gate) * up, kernel, dtype)


class Block(nn.Module):
    """One pre-norm decoder layer."""

    features: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_features: int
    qk_norm: bool
    attention_bias: bool
    norm_eps: float
    dtype: Any
    param_dtype: Any

    def setup(self):
        h, kv, d, dt, pt = self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.param_dtype
        self.input_layernorm = RMSNorm(self.norm_eps, dt, pt)
        self.post_attention_layernorm = RMSNorm(self.norm_eps, dt, pt)
        e, m = self.features, self.mlp_features
        self.q_proj = _dense(e, h * d, "q_proj", dt, pt, self.attention_bias)
        self.k_proj = _dense(e, kv * d, "k_proj", dt, pt, self.attention_bias)
        self.v_proj = _dense(e, kv * d, "v_proj", dt, pt, self.attention_bias)
        self.o_proj = _dense(h * d, e, "o_proj", dt, pt)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.norm_eps, dt, pt)
            self.k_norm = RMSNorm(self.norm_eps, dt, pt)
        self.gate_proj = _dense(e, m, "gate_proj", dt, pt)
        self.up_proj = _dense(e, m, "up_proj", dt, pt)
        self.down_proj = _dense(m, e, "down_proj", dt, pt)

    def qkv(self, x, rope):
        """Rotated queries and keys and plain values for `x` `[B, S, E]`; `rope` is the
        `rotary.table` of the positions, shared by all layers."""
        b, s, _ = x.shape
        h = self.input_layernorm(x)
        q, k, v = fused(h, [self.q_proj, self.k_proj, self.v_proj])
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_kv_heads, self.head_dim)
        v = v.reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary.apply(q, rope)
        k = rotary.apply(k, rope)
        return q, k, v

    def finish(self, x, attended):
        """Output projection, residual, then the gated MLP with its residual."""
        x = x + self.o_proj(attended)
        h = self.post_attention_layernorm(x)
        gate, up = fused(h, [self.gate_proj, self.up_proj])
        return x + _gated_down(gate, up, self.down_proj.kernel, self.down_proj.dtype)

    def __call__(self, x, rope, segment_ids, block, kernel="auto"):
        q, k, v = self.qkv(x, rope)
        return self.finish(x, attend_causal(q, k, v, segment_ids, block, kernel)), (k, v)


class CausalTransformer(nn.Module):
    """Decoder-only transformer over token ids; returns float32 logits `[B, S, V]`."""

    vocab_size: int
    emb_features: int
    num_layers: int
    num_heads: int
    mlp_features: int
    max_seq_len: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10_000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    norm_eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    head_chunk: int | None = None  # tokens per chunk of the loss head; None: from the vocabulary
    attention_kernel: str = "auto"  # causal attention: "auto", "fused" (XLA:CPU) or "blockwise"
    attention_block: int = 256  # queries per block of blockwise attention
    scan_layers: bool = True  # layers as one lax.scan (compiles once); False: a loop, same params
    remat: bool = False  # recompute each layer's activations in the backward pass

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_features(self) -> int:
        return self.head_dim or self.emb_features // self.num_heads

    def setup(self):
        if self.attention_block < 1:
            raise ValueError(f"attention_block must be >= 1 query per block, got {self.attention_block}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got "
                             f"{self.attention_kernel!r}")
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}"
            )
        if self.head_dim is None and self.emb_features % self.num_heads:
            raise ValueError(
                f"emb_features={self.emb_features} does not divide into num_heads={self.num_heads};"
                " set head_dim explicitly"
            )
        inv_freq = rotary.inverse_frequencies(
            self.head_features, self.rope_theta, dict(self.rope_scaling or ())
        )
        self.embed_tokens = nn.Embed(
            self.vocab_size, self.emb_features, embedding_init=_INIT,
            dtype=self.dtype, param_dtype=self.param_dtype,
        )
        self.inv_freq = inv_freq
        if self.has_variable("params", "layers_0") and not self.has_variable("params", "layers"):
            raise ValueError(
                "these variables hold one `layers_i` subtree per layer, the layout before the "
                "decoder stacked its layers; convert them with "
                "dew_lib.models.decoder.stack_layers(variables)")
        self.layers = self.param("layers", self._init_layers)
        self.norm = RMSNorm(self.norm_eps, self.dtype, self.param_dtype)
        if not self.tie_embeddings:
            self.lm_head = _dense(self.emb_features, self.vocab_size, "lm_head", self.dtype,
                                  self.param_dtype)

    def _block_options(self):
        return dict(features=self.emb_features, num_heads=self.num_heads,
                    num_kv_heads=self.kv_heads, head_dim=self.head_features,
                    mlp_features=self.mlp_features, qk_norm=self.qk_norm,
                    attention_bias=self.attention_bias, norm_eps=self.norm_eps, dtype=self.dtype,
                    param_dtype=self.param_dtype)

    def _block(self) -> Block:
        """The layer module, unbound: applied to one layer's slice of `self.layers`."""
        return Block(**self._block_options(), parent=None)

    def _init_layers(self, key):
        """Every layer's parameters, stacked on a leading layer axis.

        Layer i draws from the random stream a child module named `layers_i` would get (the
        per-layer layout the decoder had before stacking), so a seed gives the same initial
        weights in both layouts. `key`, the stream of the `layers` parameter itself, serves only
        when there is no params stream: `apply` runs this under `eval_shape` to check shapes.
        """
        x = jnp.zeros((1, 1, self.emb_features), self.dtype)
        rope = rotary.table(jnp.zeros((1, 1), jnp.int32), self.inv_freq)
        segments = jnp.ones((1, 1), jnp.int32)
        block = self._block()
        stream = self.scope.rngs.get("params")
        keys = ([LazyRng.create(stream, f"layers_{i}") for i in range(self.num_layers)]
                if stream is not None else list(jax.random.split(key, self.num_layers)))
        layers = [block.init({"params": k}, x, rope, segments, self.attention_block)["params"]
                  for k in keys]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)

    def _layer(self, i: int):
        """Layer `i`'s parameters: a slice of the stacked `layers` subtree."""
        return jax.tree.map(lambda p: p[i], self.layers)

    def _run_layers(self, x, rope, segment_ids, return_kv: bool):
        """Every layer over `x`: one `lax.scan` over the stacked parameters (`scan_layers`), or
        a Python loop over static slices of them (one copy of the layer in the program per
        layer). Returns the output and, if asked, each layer's `(keys, values)` `[B, S, KV, D]`."""
        block = self._block()

        def body(x, params):
            x, kv = block.apply({"params": params}, x, rope, segment_ids, self.attention_block,
                                self.attention_kernel)
            return x, (kv if return_kv else None)

        if self.remat:
            body = jax.checkpoint(body)
        if self.scan_layers:
            x, kvs = jax.lax.scan(body, x, self.layers)
            return x, ([(kvs[0][i], kvs[1][i]) for i in range(self.num_layers)] if return_kv
                       else [])
        kvs = []
        for i in range(self.num_layers):
            x, kv = body(x, self._layer(i))
            kvs.append(kv)
        return x, (kvs if return_kv else [])

    def logits(self, hidden):
        """Project final hidden states to float32 vocabulary logits."""
        if self.tie_embeddings:
            out = self.embed_tokens.attend(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)

    def target_scores(self, hidden, targets, temperature: float = 1.0):
        """Scores of `targets` `[B, S]` under the output head, chunk by chunk (models/head.py).

        Returns `(log_probs, is_top)`, both `[B, S]`: log p(target) under
        `softmax(logits / temperature)` in float32 and whether the target has the highest logit.
        Neither the `[B, S, V]` logits nor their gradient exist whole: the head runs over chunks
        of `head_chunk` tokens (default: sized from the vocabulary) under a custom VJP.
        """
        return self._head(hidden, targets, temperature, entropy=False)

    def target_scores_with_entropy(self, hidden, targets, temperature: float = 1.0):
        """`target_scores` plus the entropy of each position's distribution `[B, S]` (nats),
        from the same chunks; differentiable like the log-probs."""
        return self._head(hidden, targets, temperature, entropy=True)

    def weighted_log_prob_sum(self, hidden, targets, token_weights):
        """`(sum(token_weights * log p(targets)), is_top)`, the LM loss with its gradient formed
        in the forward pass (models/head.py); `token_weights` is not differentiated."""
        weight, vocab_major = self._head_weight()
        return head.weighted_log_prob_sum(hidden, weight, targets, token_weights,
                                          vocab_major=vocab_major, chunk=self.head_chunk,
                                          compute_dtype=self.dtype)

    def _head_weight(self):
        """The output head's weight and whether it is vocabulary-major (a tied embedding)."""
        if self.tie_embeddings:
            return self.embed_tokens.embedding, True
        return self.lm_head.kernel, False

    def _head(self, hidden, targets, temperature, *, entropy):
        weight, vocab_major = self._head_weight()
        return head.target_scores(hidden, weight, targets, temperature=temperature,
                                  vocab_major=vocab_major, chunk=self.head_chunk,
                                  compute_dtype=self.dtype, entropy=entropy)

    def id_logits(self, hidden, ids):
        """Logits of the given ids only: hidden `[..., E]`, ids `[...]` -> float32 `[...]`.

        Reads one output row per id instead of projecting onto the whole vocabulary, for scoring
        over a small recorded support.
        """
        if self.tie_embeddings:
            rows = self.embed_tokens.embedding[ids]
        else:
            rows = jnp.moveaxis(jnp.take(self.lm_head.kernel, ids, axis=1), 0, -1)
        return jnp.einsum("...e,...e->...", hidden.astype(jnp.float32), rows.astype(jnp.float32))

    def hidden(self, tokens, segment_ids=None, positions=None, *, return_kv=False):
        """Final normed hidden states `[B, S, E]` (and each layer's keys and values if asked)."""
        b, s = tokens.shape
        if s > self.max_seq_len:
            raise ValueError(
                f"input of length {s} exceeds the model's max_seq_len={self.max_seq_len}; "
                "shorten the batch or build the model with a larger max_seq_len"
            )
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        # Padding (segment 0) attends to padding: never read, but keeps every row finite.
        x = self.embed_tokens(tokens)
        rope = rotary.table(positions, self.inv_freq)
        x, kvs = self._run_layers(x, rope, segment_ids, return_kv)
        x = self.norm(x)
        return (x, kvs) if return_kv else x

    def __call__(self, tokens, segment_ids=None, positions=None):
        return self.logits(self.hidden(tokens, segment_ids, positions))

    def prefill(self, tokens, segment_ids, positions):
        """Logits and per-layer keys/values of a whole prompt batch, for filling a cache."""
        hidden, kvs = self.hidden(tokens, segment_ids, positions, return_kv=True)
        return self.logits(hidden), kvs

    def decode(self, tokens, cache: KVCache, active, layers=None):
        """One step for every row: `tokens` `[B]` at position `cache.lengths`.

        Rows where `active` is false leave their cache untouched.
        Returns logits `[B, V]` and the updated cache.

        `layers`: the per-layer parameters from `split_layers(variables)`, taken once before a
        decode loop. Without them each step slices its layers out of the stacked parameters,
        and XLA:CPU copies a slice that feeds a matmul in every step (a decode loop ran 0.8x
        the time at batch 1 and 0.93x at batch 16 with the slices taken before it).
        """
        if len(cache.keys) != self.num_layers or len(cache.values) != self.num_layers:
            raise ValueError(f"the cache holds {len(cache.keys)} layers of keys and "
                             f"{len(cache.values)} of values; the model has {self.num_layers}")
        if layers is not None and len(layers) != self.num_layers:
            raise ValueError(f"decode got {len(layers)} layers' parameters; the model has "
                             f"{self.num_layers} (pass split_layers(variables))")
        b = tokens.shape[0]
        slots = cache.keys[0].shape[2]
        positions = cache.lengths[:, None]  # [B, 1]
        write_at = jnp.where(active, cache.lengths, slots)  # out of range: dropped
        rows = jnp.arange(b)
        visible = jnp.arange(slots)[None, :] <= cache.lengths[:, None]  # [B, T]
        x = self.embed_tokens(tokens[:, None])
        rope = rotary.table(positions, self.inv_freq)
        block = self._block()
        keys, values = [], []
        for i, (k_cache, v_cache) in enumerate(zip(cache.keys, cache.values, strict=True)):
            params = {"params": self._layer(i) if layers is None else layers[i]}
            q, k, v = block.apply(params, x, rope, method=Block.qkv)  # [B, 1, H or KV, D]
            k_cache = k_cache.at[rows, :, write_at].set(k[:, 0].astype(k_cache.dtype), mode="drop")
            v_cache = v_cache.at[rows, :, write_at].set(v[:, 0].astype(v_cache.dtype), mode="drop")
            x = block.apply(params, x, attend_cached(q, k_cache, v_cache, visible),
                            method=Block.finish)
            keys.append(k_cache)
            values.append(v_cache)
        logits = self.logits(self.norm(x))[:, 0]
        lengths = cache.lengths + active.astype(cache.lengths.dtype)
        return logits, KVCache(tuple(keys), tuple(values), lengths)

    def empty_cache(self, batch: int, slots: int) -> KVCache:
        """A zeroed cache with room for `slots` tokens per row."""
        shape = (batch, self.kv_heads, slots, self.head_features)

        def layers():
            return tuple(jnp.zeros(shape, self.dtype) for _ in range(self.num_layers))

        return KVCache(layers(), layers(), jnp.zeros((batch,), jnp.int32))
