"""The causal decoder: Llama/Qwen2/Qwen3 math in Flax linen.

RMSNorm before attention and MLP, rotary positions, a SiLU-gated MLP, optional grouped-query
attention, qk-norm (Qwen3), attention biases (Qwen2) and tied embeddings. Parameter names follow
the Hugging Face module names so checkpoint import is a rename and a transpose. The layers'
parameters are one `layers` subtree whose leaves are stacked on a leading `[num_layers]` axis
(`params["layers"]["q_proj"]["kernel"]` is `[L, E, H * D]`; Hugging Face's `model.layers.{i}`
tensors are index i): a training step runs the layers as one `lax.scan` over that axis, so its
compiled program does not grow with depth. (With `dense_layers`, each kind of MLP is stacked
over its own layers: models/decoder_stack.py.)

Inputs may be packed: `segment_ids` keep attention inside each document (0 marks padding) and
`positions` restart the rotary clock per document. Generation uses an explicit `KVCache` pytree
rather than a mutable Flax collection, so the decode loop can donate and carry it.

Adapter dropout (models/lora.py) runs when a call is given a `dropout` rng (`rngs={"dropout":
key}`), each layer with its own key (the layer index folded in). With `quantized` the layers'
projection kernels are int8 (models/quantize.py), read one layer at a time.

With `experts > 0` every layer's MLP is a mixture of experts (models/moe.py), except the
`dense_layers`, which keep the dense MLP (models/decoder_stack.py: how the stack holds and runs
both kinds): `hidden` can replay recorded routes and return what the routers did
(`moe.Routing`), and `prefill`/`decode` the experts each token used, over the sparse layers.

Not here: one layer and its parts (`decoder_layer`), the attention functions
(`decoder_attention`), sliding-window attention, dropout outside the adapters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core.scope import LazyRng

from dew_lib.models import decoder_stack, head, moe, partitioning, rotary
from dew_lib.models.decoder_attention import ATTENTION_KERNELS, attend_cached
from dew_lib.models.decoder_layer import _INIT, Block, RMSNorm, _dense
from dew_lib.models.decoder_stack import stack_layers, unstack_layers  # noqa: F401  (re-exported)
from dew_lib.models.lora import check_expert_targets
from dew_lib.options import choice

# Each parameter's logical axes (partitioning.py): the stacked layer axis is never split, the
# model width goes over `fsdp`, heads, the MLP's hidden units and the vocabulary over `tensor`.
partitioning.declare({
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("norm", "weight"): ("norm",),
    ("layers", "input_layernorm", "weight"): ("layers", "norm"),
    ("layers", "post_attention_layernorm", "weight"): ("layers", "norm"),
    ("layers", "q_norm", "weight"): ("layers", "head_dim"),
    ("layers", "k_norm", "weight"): ("layers", "head_dim"),
    ("layers", "q_proj", "kernel"): ("layers", "embed", "heads"),
    ("layers", "q_proj", "bias"): ("layers", "heads"),
    ("layers", "k_proj", "kernel"): ("layers", "embed", "kv_heads"),
    ("layers", "k_proj", "bias"): ("layers", "kv_heads"),
    ("layers", "v_proj", "kernel"): ("layers", "embed", "kv_heads"),
    ("layers", "v_proj", "bias"): ("layers", "kv_heads"),
    ("layers", "o_proj", "kernel"): ("layers", "heads", "embed"),
    ("layers", "gate_proj", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "up_proj", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "down_proj", "kernel"): ("layers", "mlp", "embed"),
    # low-rank adapters (models/lora.py): A splits like its kernel's input, B like its output
    **{("layers", name, "lora_a"): ("layers", into, None) for name, into in
       (("q_proj", "embed"), ("k_proj", "embed"), ("v_proj", "embed"), ("o_proj", "heads"),
        ("gate_proj", "embed"), ("up_proj", "embed"), ("down_proj", "mlp"))},
    **{("layers", name, "lora_b"): ("layers", None, out) for name, out in
       (("q_proj", "heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads"), ("o_proj", "embed"),
        ("gate_proj", "mlp"), ("up_proj", "mlp"), ("down_proj", "embed"))},
    # an int8 kernel's scale per output channel (models/quantize.py): split like that output
    **{("layers", name, "kernel_scale"): ("layers", out) for name, out in
       (("q_proj", "heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads"), ("o_proj", "embed"),
        ("gate_proj", "mlp"), ("up_proj", "mlp"), ("down_proj", "embed"))},
    # mixture of experts (models/moe.py): the router whole, experts stacked on their own axis
    ("layers", "router", "kernel"): ("layers", "embed", None),
    ("layers", "experts", "gate_proj"): ("layers", "experts", "embed", "mlp"),
    ("layers", "experts", "up_proj"): ("layers", "experts", "embed", "mlp"),
    ("layers", "experts", "down_proj"): ("layers", "experts", "mlp", "embed"),
    ("layers", "shared_expert", "gate_proj", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "shared_expert", "up_proj", "kernel"): ("layers", "embed", "mlp"),
    ("layers", "shared_expert", "down_proj", "kernel"): ("layers", "mlp", "embed"),
    ("layers", "shared_expert_gate", "kernel"): ("layers", "embed", None),
})

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
    With `dense_layers`, element i holds row i of every stacked part that has one
    (`decoder_stack.split`), and decode picks each layer's MLP from its kind's row.
    """
    params = variables["params"] if "params" in variables else variables
    return decoder_stack.split(params["layers"])


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
    # causal attention: "auto", "fused" (XLA:CPU), "dot_product" (jax.nn.dot_product_attention;
    # cuDNN on a GPU) or "blockwise" (any backend); decoder_attention.attend_causal says which
    # one "auto" runs where
    attention_kernel: str = "auto"
    attention_block: int = 256  # queries per block of blockwise attention
    scan_layers: bool = True  # layers as one lax.scan (compiles once); False: a loop, same params
    remat: bool = False  # recompute each layer's activations in the backward pass
    lora: Any = None  # a models.lora.LoRA: low-rank adapters on the projections it targets
    quantized: bool = False  # int8 layer projection kernels (models/quantize.quantize_base)
    # mixture of experts: routed experts per layer (0: the dense MLP), how many each token uses,
    # their MLP width (None: mlp_features), whether the k weights are renormalised, Qwen2-MoE's
    # shared expert width (0: none), and the router losses' coefficients the objectives add
    experts: int = 0
    experts_per_token: int = 2
    expert_features: int | None = None
    norm_topk_prob: bool = True
    shared_expert_features: int = 0
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # an MoE model's layers that keep the dense MLP of width mlp_features (Hugging Face's
    # mlp_only_layers and decoder_sparse_step, resolved); (): every layer sparse
    dense_layers: tuple[int, ...] = ()

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_features(self) -> int:
        return self.head_dim or self.emb_features // self.num_heads

    @property
    def sparse(self) -> moe.Sparse | None:
        """The layers' mixture-of-experts shape, or None for dense layers."""
        if not self.experts:
            return None
        return moe.Sparse(self.experts, self.experts_per_token, self.expert_features or self.mlp_features,
                          self.norm_topk_prob, self.shared_expert_features)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The indices of the sparse layers, in order: the layer axis of routes and `Routing`."""
        return decoder_stack.sparse_layers(self.num_layers, self.experts, self.dense_layers)

    def setup(self):
        if self.experts < 0 or (self.experts and not 1 <= self.experts_per_token <= self.experts):
            raise ValueError(f"experts={self.experts} with experts_per_token={self.experts_per_token}: a "
                             "mixture of experts routes each token to 1..experts of them (experts=0: dense)")
        decoder_stack.check_dense_layers(self.num_layers, self.experts, self.dense_layers)
        if self.lora is not None:
            check_expert_targets(self.experts, self.lora.targets)
        if self.attention_block < 1:
            raise ValueError(f"attention_block must be >= 1 query per block, got {self.attention_block}")
        choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
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
                    param_dtype=self.param_dtype, lora=self.lora, quantized=self.quantized,
                    sparse=self.sparse)

    def _block(self, sparse: bool = True) -> Block:
        """The layer module, unbound: applied to one layer's slice of `self.layers`; with
        `sparse` false, a dense layer of an MoE model."""
        options = self._block_options()
        if not sparse:
            options["sparse"] = None
        return Block(**options, parent=None)

    def _is_sparse(self, i: int) -> bool:
        return i in self.moe_layers

    def _init_layers(self, key):
        """Every layer's parameters, stacked on a leading layer axis.

        Layer i draws from the random stream a child module named `layers_i` would get (the
        per-layer layout the decoder had before stacking), so a seed gives the same initial
        weights in both layouts.

        Without a params stream this is Flax checking shapes: every `apply` traces the init of
        an existing parameter under `eval_shape` and compares shapes. Only shapes count there,
        so one layer of each kind (dense, sparse) is traced and repeated, not every layer:
        a forward's trace of a 28-layer decoder took seconds more otherwise.
        """
        x = jnp.zeros((1, 1, self.emb_features), self.dtype)
        rope = rotary.table(jnp.zeros((1, 1), jnp.int32), self.inv_freq)
        segments = jnp.ones((1, 1), jnp.int32)

        def layer(sparse: bool, layer_key):
            return self._block(sparse).init({"params": layer_key}, x, rope, segments, self.attention_block,
                                            self.attention_kernel)["params"]

        kinds = [self._is_sparse(i) for i in range(self.num_layers)]
        stream = self.scope.rngs.get("params")
        if stream is None:
            shapes = {sparse: layer(sparse, key) for sparse in set(kinds)}
            return decoder_stack.stack([shapes[sparse] for sparse in kinds])
        return decoder_stack.stack([layer(sparse, LazyRng.create(stream, f"layers_{i}"))
                                    for i, sparse in enumerate(kinds)])

    def _layer(self, i: int, rows=None):
        """Layer `i`'s parameters: a slice of the stacked `layers` subtree, or picked from
        `split_layers`' `rows`."""
        sparse = self._is_sparse(i)
        local = decoder_stack.local_index(i, self.moe_layers) if self.dense_layers else i
        if rows is not None:
            return decoder_stack.pick(rows, i, local, sparse)
        return decoder_stack.layer_params(self.layers, i, local, sparse)

    def _dropout_key(self):
        """The key of adapter dropout for this call, or None: only adapters with a nonzero rate
        in a call given a `dropout` rng (a training forward) drop anything."""
        if self.lora is None or not self.lora.dropout or not self.has_rng("dropout"):
            return None
        return self.make_rng("dropout")

    def _run_layers(self, x, rope, segment_ids, return_kv: bool, routes=None, routed=None):
        """Every layer over `x`: one `lax.scan` over the stacked parameters (`scan_layers`), or
        a Python loop over static slices of them (one copy of the layer in the program per
        layer). Returns the output, each layer's `(keys, values)` `[B, S, KV, D]` if asked (else
        []), and for sparse layers their `moe.LayerRouting` stacked on a leading layer axis
        (else None). `routes` `[B, S, sparse layers, k]`: the experts to replay where `routed`
        `[B, S]`. Layer i's adapter dropout draws from the call's dropout key folded with i.
        Mixed dense and sparse layers run as consecutive runs of one kind (decoder_stack)."""
        dropout = self._dropout_key()
        per_layer = None if routes is None else jnp.moveaxis(routes, 2, 0)  # [sparse layers, B, S, k]
        runs = decoder_stack.runs(self.num_layers, self.moe_layers)
        kvs, routings = [], []
        for run in runs:
            block = self._block(run.sparse)

            def body(x, layer, block=block):
                params, index, layer_routes = layer
                key = None if dropout is None else jax.random.fold_in(dropout, index)
                x, kv, routing = block.apply({"params": params}, partitioning.constrain_rows(x), rope, segment_ids,
                                             self.attention_block, self.attention_kernel, key, layer_routes, routed)
                return partitioning.constrain_rows(x), (kv if return_kv else None, routing)

            if self.remat:
                body = jax.checkpoint(body)
            whole = len(runs) == 1
            run_routes = None
            if per_layer is not None and run.sparse:
                run_routes = per_layer if whole else per_layer[run.offset:run.offset + run.size]
            if self.scan_layers:
                params = decoder_stack.run_params(self.layers, run, run.sparse, whole)
                index = jnp.arange(run.start, run.stop) if run.start else jnp.arange(run.stop)
                x, (kv, routing) = jax.lax.scan(body, x, (params, index, run_routes))
                kvs += [(kv[0][i], kv[1][i]) for i in range(run.size)] if return_kv else []
            else:
                outs = []
                for j, i in enumerate(range(run.start, run.stop)):
                    x, out = body(x, (self._layer(i), i, None if run_routes is None else run_routes[j]))
                    outs.append(out)
                kvs += [kv for kv, _ in outs] if return_kv else []
                routing = jax.tree.map(lambda *a: jnp.stack(a), *[r for _, r in outs]) if run.sparse else None
            if run.sparse:
                routings.append(routing)
        routing = decoder_stack.concat_routing(routings) if routings else None
        return x, kvs, routing

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

    def hidden(self, tokens, segment_ids=None, positions=None, *, return_kv=False, routes=None, routed=None,
               return_routing=False):
        """Final normed hidden states `[B, S, E]`, then each layer's keys and values if
        `return_kv`, then the `moe.Routing` if `return_routing` (a mixture of experts only).
        routes `[B, S, layers, experts_per_token]`, routed `[B, S]`: replay those experts where
        routed is true (routing replay); other tokens route freely."""
        b, s = tokens.shape
        if s > self.max_seq_len:
            raise ValueError(
                f"input of length {s} exceeds the model's max_seq_len={self.max_seq_len}; "
                "shorten the batch or build the model with a larger max_seq_len"
            )
        moe.check_routes(self, tokens.shape, routes, routed, return_routing)
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        # Padding (segment 0) attends to padding: never read, but keeps every row finite.
        x = self.embed_tokens(tokens)
        rope = rotary.table(positions, self.inv_freq)
        x, kvs, layers = self._run_layers(x, rope, segment_ids, return_kv, routes, routed)
        x = self.norm(x)
        out = (x, kvs) if return_kv else (x,)
        if return_routing:
            out = (*out, moe.combine(layers))
        return out if len(out) > 1 else x

    def __call__(self, tokens, segment_ids=None, positions=None):
        return self.logits(self.hidden(tokens, segment_ids, positions))

    def prefill(self, tokens, segment_ids, positions, *, return_routes=False):
        """Logits and per-layer keys/values of a whole prompt batch, for filling a cache; with
        `return_routes` (a mixture of experts) also each token's experts `[B, S, layers, k]`."""
        if return_routes:
            hidden, kvs, routing = self.hidden(tokens, segment_ids, positions, return_kv=True, return_routing=True)
            return self.logits(hidden), kvs, routing.experts
        hidden, kvs = self.hidden(tokens, segment_ids, positions, return_kv=True)
        return self.logits(hidden), kvs

    def decode(self, tokens, cache: KVCache, active, layers=None, *, return_routes=False):
        """One step for every row: `tokens` `[B]` at position `cache.lengths`.

        Rows where `active` is false leave their cache untouched.
        Returns logits `[B, V]` and the updated cache, and with `return_routes` (a mixture of
        experts) the experts each row's token used `[B, layers, k]`.

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
        moe.check_routes(self, (tokens.shape[0], 1), None, None, return_routes)
        b = tokens.shape[0]
        slots = cache.keys[0].shape[2]
        positions = cache.lengths[:, None]  # [B, 1]
        write_at = jnp.where(active, cache.lengths, slots)  # out of range: dropped
        rows = jnp.arange(b)
        visible = jnp.arange(slots)[None, :] <= cache.lengths[:, None]  # [B, T]
        x = self.embed_tokens(tokens[:, None])
        rope = rotary.table(positions, self.inv_freq)
        keys, values, routes = [], [], []
        for i, (k_cache, v_cache) in enumerate(zip(cache.keys, cache.values, strict=True)):
            block = self._block(self._is_sparse(i))
            params = {"params": self._layer(i, layers)}
            # flax annotates apply's result as "output or (output, mutated variables)"; without
            # `mutable` it is the method's output, here (q, k, v)
            qkv: Any = block.apply(params, x, rope, method=Block.qkv)
            q, k, v = qkv  # [B, 1, H or KV, D]
            k_cache = k_cache.at[rows, :, write_at].set(k[:, 0].astype(k_cache.dtype), mode="drop")
            v_cache = v_cache.at[rows, :, write_at].set(v[:, 0].astype(v_cache.dtype), mode="drop")
            finished: Any = block.apply(params, x, attend_cached(q, k_cache, v_cache, visible), method=Block.finish)
            x, routing = finished
            keys.append(k_cache)
            values.append(v_cache)
            if routing is not None:
                routes.append(routing.experts[:, 0])
        logits = self.logits(self.norm(x))[:, 0]
        lengths = cache.lengths + active.astype(cache.lengths.dtype)
        cache = KVCache(tuple(keys), tuple(values), lengths)
        return (logits, cache, jnp.stack(routes, axis=1)) if return_routes else (logits, cache)

    def empty_cache(self, batch: int, slots: int) -> KVCache:
        """A zeroed cache with room for `slots` tokens per row."""
        shape = (batch, self.kv_heads, slots, self.head_features)

        def layers():
            return tuple(jnp.zeros(shape, self.dtype) for _ in range(self.num_layers))

        return KVCache(layers(), layers(), jnp.zeros((batch,), jnp.int32))
