"""Which Hugging Face tensor is which decoder parameter, and how their layouts differ.

The decoder's parameter names mirror the Hugging Face module names, so the map is a rename plus a
transpose for every linear layer: PyTorch's `nn.Linear.weight` is `[out, in]`, Flax's
`Dense.kernel` is `[in, out]`. Biases, norm weights and the embedding table keep their layout.
The decoder stacks its layers: `model.layers.{i}.…` is index i on the leading axis of the leaf
under `params["layers"]`. The list is in the order transformers writes its state dict, which is
also the order Dew saves in.
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
    transpose: bool  # a linear weight: the Flax kernel is the transpose
    layer: int | None = None  # index on the leading axis of a stacked layer leaf at `path`

    @property
    def flax_shape(self) -> tuple[int, ...]:
        """The shape of this tensor in Flax's layout (one layer's slice of a stacked leaf)."""
        return self.shape[::-1] if self.transpose else self.shape


def leaf_shapes(tensors: list[Tensor]) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The shape of every params leaf the tensors fill: a layer leaf gains its leading axis."""
    layers: dict[tuple[str, ...], int] = {}
    shapes: dict[tuple[str, ...], tuple[int, ...]] = {}
    for tensor in tensors:
        shapes[tensor.path] = tensor.flax_shape
        if tensor.layer is not None:
            layers[tensor.path] = max(layers.get(tensor.path, 0), tensor.layer + 1)
    return {path: ((layers[path],) if path in layers else ()) + shape
            for path, shape in shapes.items()}


def _linear(hf: str, layer: int, module: str, name: str, rows: int, cols: int, bias: bool = False):
    weight = Tensor(f"{hf}.{module}.weight", ("layers", name, "kernel"), (rows, cols), True, layer)
    if not bias:
        return [weight]
    return [weight, Tensor(f"{hf}.{module}.bias", ("layers", name, "bias"), (rows,), False, layer)]


def _norm(hf: str, layer: int, module: str, name: str, size: int):
    return [Tensor(f"{hf}.{module}.weight", ("layers", name, "weight"), (size,), False, layer)]


def tensors(model: Any) -> list[Tensor]:
    """Every tensor a Hugging Face checkpoint of `model` holds, in transformers' order."""
    e, h, kv, d = model.emb_features, model.num_heads, model.kv_heads, model.head_features
    m, bias = model.mlp_features, model.attention_bias
    out = [Tensor("model.embed_tokens.weight", ("embed_tokens", "embedding"),
                  (model.vocab_size, e), False)]
    for i in range(model.num_layers):
        at = (f"model.layers.{i}", i)
        out += _linear(*at, "self_attn.q_proj", "q_proj", h * d, e, bias)
        out += _linear(*at, "self_attn.k_proj", "k_proj", kv * d, e, bias)
        out += _linear(*at, "self_attn.v_proj", "v_proj", kv * d, e, bias)
        out += _linear(*at, "self_attn.o_proj", "o_proj", e, h * d)
        if model.qk_norm:
            out += _norm(*at, "self_attn.q_norm", "q_norm", d)
            out += _norm(*at, "self_attn.k_norm", "k_norm", d)
        out += _linear(*at, "mlp.gate_proj", "gate_proj", m, e)
        out += _linear(*at, "mlp.up_proj", "up_proj", m, e)
        out += _linear(*at, "mlp.down_proj", "down_proj", e, m)
        out += _norm(*at, "input_layernorm", "input_layernorm", e)
        out += _norm(*at, "post_attention_layernorm", "post_attention_layernorm", e)
    out.append(Tensor("model.norm.weight", ("norm", "weight"), (e,), False))
    if not model.tie_embeddings:
        out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), (model.vocab_size, e), True))
    return out


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
