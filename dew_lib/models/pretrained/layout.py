"""Which Hugging Face tensor is which decoder parameter, and how their layouts differ.

The decoder's parameter names mirror the Hugging Face module names, so the map is a rename plus a
transpose for every linear layer: PyTorch's `nn.Linear.weight` is `[out, in]`, Flax's
`Dense.kernel` is `[in, out]`. Biases, norm weights and the embedding table keep their layout.
The decoder stacks its layers: `model.layers.{i}.…` is index i on the leading axis of the leaf
under `params["layers"]`. The list is in the order transformers writes its state dict, which is
also the order Dew saves in.

With dense layers among sparse ones (`dense_layers`), an MLP's leaves are stacked over the layers
of its kind only (models/decoder_stack.py): layer i's tensors go to its row among the sparse or
among the dense layers, its attention and norms to row i.

A mixture-of-experts layer keeps its routed experts stacked too: the Hub's per-expert tensors
`model.layers.{i}.mlp.experts.{j}.gate_proj.weight` (Mixtral: `block_sparse_moe.experts.{j}.w1`)
are index `[i, j]` of `params["layers"]["experts"]["gate_proj"]` `[L, E, X, M]`. That per-expert
layout is what transformers' `save_pretrained` writes (it converts back from its fused in-memory
tensors), what the Hub's checkpoints hold and what older transformers, vLLM and SGLang read, so
Dew saves it. transformers 5 can also write its in-memory layout (`save_original_format=False`):
`mlp.experts.gate_up_proj` `[E, 2M, X]` (gate rows, then up rows), `mlp.experts.down_proj`
`[E, X, M]` and, for Mixtral, `mlp.` in place of `block_sparse_moe.`; `tensors(..., fused=True)`
describes it for loading.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

# Tensors some checkpoints carry that no model reads (old Llama conversions stored the rotary
# frequency buffer); loading skips them instead of calling them unexpected.
IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor: its Hugging Face name and shape, and where it lives in `params`."""

    name: str
    path: tuple[str, ...]  # keys under the variables' "params" collection
    shape: tuple[int, ...]  # the Hugging Face shape
    transpose: bool  # a linear weight: the Flax kernel swaps its last two axes
    layer: int | None = None  # index on the leading axis of a stacked layer leaf at `path`
    expert: int | None = None  # index on the expert axis, after the layer axis
    # A fused tensor's rows `[start, stop)` on its second-to-last axis fill this leaf (the gate
    # or the up half of `gate_up_proj`); None: all of it.
    rows: tuple[int, int] | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """Where this tensor goes in its leaf: `()`, `(layer,)` or `(layer, expert)`."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)

    @property
    def flax_shape(self) -> tuple[int, ...]:
        """The shape of this tensor in Flax's layout (one layer's slice of a stacked leaf)."""
        shape = self.shape
        if self.rows is not None:
            shape = shape[:-2] + (self.rows[1] - self.rows[0], shape[-1])
        return shape[:-2] + (shape[-1], shape[-2]) if self.transpose else shape

    def to_flax(self, array: Any) -> Any:
        """The stored array (NumPy) in Flax's layout: the rows taken, the last two axes swapped."""
        if self.rows is not None:
            array = array[..., self.rows[0]:self.rows[1], :]
        return array.swapaxes(-1, -2) if self.transpose else array


def leaf_shapes(tensors: list[Tensor]) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The shape of every params leaf the tensors fill: a layer leaf gains its leading axis, an
    expert leaf its layer and expert axes."""
    lead: dict[tuple[str, ...], list[int]] = {}
    shapes: dict[tuple[str, ...], tuple[int, ...]] = {}
    for tensor in tensors:
        shapes[tensor.path] = tensor.flax_shape
        index = tensor.index
        sizes = lead.setdefault(tensor.path, [0] * len(index))
        lead[tensor.path] = [max(size, i + 1) for size, i in zip(sizes, index, strict=True)]
    return {path: tuple(lead[path]) + shape for path, shape in shapes.items()}


def _linear(hf: str, layer: int, module: str, name: str, rows: int, cols: int, bias: bool = False):
    """A linear layer's weight (and bias); `name` "a/b" is the nested module `params[...]["a"]["b"]`."""
    at = ("layers", *name.split("/"))
    weight = Tensor(f"{hf}.{module}.weight", (*at, "kernel"), (rows, cols), True, layer)
    if not bias:
        return [weight]
    return [weight, Tensor(f"{hf}.{module}.bias", (*at, "bias"), (rows,), False, layer)]


def _norm(hf: str, layer: int, module: str, name: str, size: int):
    return [Tensor(f"{hf}.{module}.weight", ("layers", name, "weight"), (size,), False, layer)]


def tensors(model: Any, family: Any = None, *, fused: bool = False) -> list[Tensor]:
    """Every tensor a Hugging Face checkpoint of `model` holds, in transformers' order.

    `family` (a `families.Family`) names an MoE model's expert tensors; a dense model needs none.
    `fused`: the MoE tensors as transformers 5 holds them in memory (see the module docstring),
    a layout Dew reads but never writes.
    """
    e, h, kv, d = model.emb_features, model.num_heads, model.kv_heads, model.head_features
    m, bias = model.mlp_features, model.attention_bias
    experts = int(getattr(model, "experts", 0) or 0)
    if experts and (family is None or not family.moe):
        raise ValueError(f"a model with experts={experts} needs its MoE family to name its tensors")
    out = [Tensor("model.embed_tokens.weight", ("embed_tokens", "embedding"),
                  (model.vocab_size, e), False)]
    dense = set(getattr(model, "dense_layers", ()) or ())
    seen = {True: 0, False: 0}  # layers of each kind so far: a layer's row in its MLP's leaves
    for i in range(model.num_layers):
        at = (f"model.layers.{i}", i)
        sparse = bool(experts) and i not in dense
        mlp = (at[0], seen[sparse])
        seen[sparse] += 1
        out += _linear(*at, "self_attn.q_proj", "q_proj", h * d, e, bias)
        out += _linear(*at, "self_attn.k_proj", "k_proj", kv * d, e, bias)
        out += _linear(*at, "self_attn.v_proj", "v_proj", kv * d, e, bias)
        out += _linear(*at, "self_attn.o_proj", "o_proj", e, h * d)
        if model.qk_norm:
            out += _norm(*at, "self_attn.q_norm", "q_norm", d)
            out += _norm(*at, "self_attn.k_norm", "k_norm", d)
        if sparse:
            out += _sparse(*mlp, model, family, fused)
        else:
            out += _linear(*mlp, "mlp.gate_proj", "gate_proj", m, e)
            out += _linear(*mlp, "mlp.up_proj", "up_proj", m, e)
            out += _linear(*mlp, "mlp.down_proj", "down_proj", e, m)
        out += _norm(*at, "input_layernorm", "input_layernorm", e)
        out += _norm(*at, "post_attention_layernorm", "post_attention_layernorm", e)
    out.append(Tensor("model.norm.weight", ("norm", "weight"), (e,), False))
    if not model.tie_embeddings:
        out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), (model.vocab_size, e), True))
    return out


def _sparse(hf: str, layer: int, model: Any, family: Any, fused: bool) -> list[Tensor]:
    """One sparse MLP block: router, routed experts, and the shared expert where the family has
    one (Qwen2-MoE)."""
    e, experts = model.emb_features, int(model.experts)
    width = int(getattr(model, "expert_features", None) or model.mlp_features)
    block = f"{hf}.{'mlp' if fused else family.moe_module}"
    out = [Tensor(f"{block}.gate.weight", ("layers", "router", "kernel"), (experts, e), True, layer)]
    gate, up, down = (("layers", "experts", name) for name in ("gate_proj", "up_proj", "down_proj"))
    if fused:
        gate_up = f"{block}.experts.gate_up_proj"
        out += [Tensor(gate_up, gate, (experts, 2 * width, e), True, layer, rows=(0, width)),
                Tensor(gate_up, up, (experts, 2 * width, e), True, layer, rows=(width, 2 * width)),
                Tensor(f"{block}.experts.down_proj", down, (experts, e, width), True, layer)]
    else:
        names = family.expert_names
        for j in range(experts):
            at = f"{block}.experts.{j}"
            out += [Tensor(f"{at}.{names[0]}.weight", gate, (width, e), True, layer, j),
                    Tensor(f"{at}.{names[1]}.weight", up, (width, e), True, layer, j),
                    Tensor(f"{at}.{names[2]}.weight", down, (e, width), True, layer, j)]
    if family.shared_expert:
        shared = int(model.shared_expert_features)
        out += _linear(hf, layer, "mlp.shared_expert.gate_proj", "shared_expert/gate_proj", shared, e)
        out += _linear(hf, layer, "mlp.shared_expert.up_proj", "shared_expert/up_proj", shared, e)
        out += _linear(hf, layer, "mlp.shared_expert.down_proj", "shared_expert/down_proj", e, shared)
        out += _linear(hf, layer, "mlp.shared_expert_gate", "shared_expert_gate", 1, e)
    return out


def is_fused(names: Any) -> bool:
    """Whether stored tensor names hold MoE experts in transformers 5's fused in-memory layout."""
    return any(name.endswith(".experts.gate_up_proj") for name in names)


TIED_COPY = "lm_head.weight"  # what a tied checkpoint may also store; see `ignorable`


def ignorable(name: str, model: Any) -> bool:
    """A tensor present in a checkpoint that loading may skip without changing the model.

    A tied model reads its output projection from the embedding, so a stored `lm_head.weight`
    is skipped too, provided it equals the embedding: transformers unties the two when they
    differ, so the loader checks that (see `Pretrained.load`).
    """
    if model.tie_embeddings and name == TIED_COPY:
        return True
    return any(pattern.fullmatch(name) for pattern in IGNORED)
