"""The decoder: packed documents behave like separate ones, padding is inert, options hold."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from dew_lib.models import rotary
from dew_lib.models.decoder_layer import Block, Linear


def init(model, width=8):
    return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, width), jnp.int32))


def test_parameter_names_follow_hugging_face_modules_stacked_by_layer():
    model = tiny_model()
    layers = init(model)["params"]["layers"]
    assert set(layers) == {"input_layernorm", "post_attention_layernorm", "q_proj", "k_proj",
                           "v_proj", "o_proj", "q_norm", "k_norm", "gate_proj", "up_proj",
                           "down_proj"}
    assert layers["k_proj"]["kernel"].shape == (2, 16, 2 * 4)  # [layers, in, out]
    assert layers["input_layernorm"]["weight"].shape == (2, 16)


def test_each_layer_starts_from_its_own_random_weights():
    layers = init(tiny_model(num_layers=3))["params"]["layers"]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        kernel = np.asarray(layers[name]["kernel"])
        assert np.std(kernel) > 0.01, name
        for i in range(3):
            for j in range(i):
                assert not np.allclose(kernel[i], kernel[j]), (name, i, j)
    np.testing.assert_array_equal(layers["post_attention_layernorm"]["weight"], 1.0)


def test_a_seed_gives_the_weights_of_one_module_per_layer():
    # Before the layers were stacked, layer i was a child module named `layers_i`; the stacked
    # initializer draws from the same streams, so a seed's initial weights did not change.
    model = tiny_model(num_layers=3)

    class PerLayer(nn.Module):
        @nn.compact
        def __call__(self, x, rope, segments):
            for i in range(model.num_layers):
                x, _, _ = Block(**model._block_options(), name=f"layers_{i}")(
                    x, rope, segments, model.attention_block)
            return x

    x = jnp.zeros((1, 1, model.emb_features))
    half_head = model.emb_features // model.num_heads // 2
    rope = rotary.table(jnp.zeros((1, 1), jnp.int32), np.ones(half_head))
    per_layer = jax.jit(PerLayer().init)(jax.random.key(0), x, rope, jnp.ones((1, 1), jnp.int32))["params"]
    stacked = jax.tree_util.tree_leaves_with_path(init(model)["params"]["layers"])
    for i in range(model.num_layers):
        expected = jax.tree_util.tree_leaves(per_layer[f"layers_{i}"])
        for (path, leaf), want in zip(stacked, expected, strict=True):
            np.testing.assert_array_equal(leaf[i], want, err_msg=f"layer {i} {path}")


def test_scanned_and_unrolled_layers_read_the_same_parameters():
    variables = init(tiny_model(num_layers=3))
    tokens = np.array([[4, 9, 2, 7, 7, 1]])
    scanned = tiny_model(num_layers=3).apply(variables, tokens)
    unrolled = tiny_model(num_layers=3, scan_layers=False).apply(variables, tokens)
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5)
    # Layer i of the stack is the i-th layer applied: reversing the stack changes the output.
    flipped = jax.tree.map(lambda x: x, variables)
    flipped["params"]["layers"] = jax.tree.map(lambda p: p[::-1], variables["params"]["layers"])
    assert not np.allclose(tiny_model(num_layers=3).apply(flipped, tokens), scanned, atol=1e-3)


def test_packed_documents_equal_separate_forward_passes():
    model = tiny_model()
    variables = init(model)
    first = np.array([5, 6, 7, 8, 9], np.int32)
    second = np.array([10, 11, 12], np.int32)
    packed = np.concatenate([first, second, [0, 0]])[None]
    segments = np.array([[1] * 5 + [2] * 3 + [0, 0]])
    positions = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]])
    logits = model.apply(variables, packed, segments, positions)
    alone_first = model.apply(variables, first[None])
    alone_second = model.apply(variables, second[None])
    np.testing.assert_allclose(logits[0, :5], alone_first[0], atol=1e-5)
    np.testing.assert_allclose(logits[0, 5:8], alone_second[0], atol=1e-5)


def test_left_padding_does_not_change_real_tokens():
    model = tiny_model()
    variables = init(model)
    tokens = np.array([[3, 4, 5, 6]], np.int32)
    padded = np.array([[0, 0, 3, 4, 5, 6]], np.int32)
    logits = model.apply(variables, padded, np.array([[0, 0, 1, 1, 1, 1]]),
                         np.array([[0, 0, 0, 1, 2, 3]]))
    np.testing.assert_allclose(logits[0, 2:], model.apply(variables, tokens)[0], atol=1e-5)
    assert np.isfinite(np.asarray(logits)).all()


def test_tied_embeddings_share_the_input_table():
    model = tiny_model(tie_embeddings=True)
    variables = init(model)
    assert "lm_head" not in variables["params"]
    hidden = model.apply(variables, np.array([[1, 2, 3]]), method=model.hidden)
    table = variables["params"]["embed_tokens"]["embedding"]
    np.testing.assert_allclose(model.apply(variables, np.array([[1, 2, 3]])), hidden @ table.T,
                               atol=1e-5)


def test_grouped_query_attention_equals_repeated_key_value_heads():
    """GQA with 2 kv heads equals full attention whose kv heads are those 2 repeated."""
    gqa = tiny_model(num_kv_heads=2, qk_norm=False)
    full = tiny_model(num_kv_heads=4, qk_norm=False)
    variables = init(gqa)
    expanded = jax.tree.map(lambda x: x, variables)
    layers = expanded["params"]["layers"]
    for proj in ("k_proj", "v_proj"):
        kernel = layers[proj]["kernel"].reshape(2, 16, 2, 4)  # [layers, E, KV, D]
        layers[proj] = {"kernel": jnp.repeat(kernel, 2, axis=2).reshape(2, 16, 16)}
    tokens = np.array([[1, 2, 3, 4, 5]])
    np.testing.assert_allclose(gqa.apply(variables, tokens), full.apply(expanded, tokens), atol=1e-5)


def test_bfloat16_compute_tracks_float32():
    tokens = np.array([[1, 2, 3, 4, 5, 6]])
    variables = init(tiny_model())
    exact = tiny_model().apply(variables, tokens)
    low = tiny_model(dtype=jnp.bfloat16).apply(variables, tokens)
    assert low.dtype == jnp.float32  # logits always come back in float32
    np.testing.assert_allclose(low, exact, atol=0.05)


def test_input_longer_than_max_seq_len_is_refused():
    model = tiny_model(max_seq_len=4)
    with pytest.raises(ValueError, match="max_seq_len=4"):
        init(model, width=5)


def test_heads_must_group_evenly():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        init(tiny_model(num_heads=4, num_kv_heads=3))


def test_unknown_model_and_option_are_named():
    from dew_lib import models

    with pytest.raises(ValueError, match="causal_transformer"):
        models.build("transformer")
    with pytest.raises(TypeError, match="layers"):
        models.build("causal_transformer", vocab_size=8, emb_features=8, layers=1)


def test_a_layers_backward_pass_keeps_matmul_inputs_not_what_it_can_recompute():
    # What the backward pass of one layer reads: each matmul's input and the attention's queries,
    # keys and values. The attention weights, the MLP's gated product and the norms' normalized
    # copies are recomputed (dew_lib/models/attention.py, `_gated_down`, `_rms_norm`).
    b, s, e, heads, m = 2, 6, 16, 4, 40
    block = Block(features=e, num_heads=heads, num_kv_heads=2, head_dim=4, mlp_features=m,
                  qk_norm=True, attention_bias=False, norm_eps=1e-6, dtype=jnp.float32,
                  param_dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(0), (b, s, e))
    rope = rotary.table(jnp.broadcast_to(jnp.arange(s), (b, s)), rotary.inverse_frequencies(4, 1e4, {}))
    segments = jnp.ones((b, s), jnp.int32)
    params = block.init(jax.random.key(1), x, rope, segments, 8)
    _, pullback = jax.vjp(lambda p, x: block.apply(p, x, rope, segments, 8)[0], params, x)
    kept = [leaf for leaf in jax.tree.leaves(pullback) if leaf.dtype == jnp.float32]
    shapes = [leaf.shape for leaf in kept]  # matmul inputs are kept as `[B*S, features]` rows

    def count(features):
        return shapes.count((b, s, features)) + shapes.count((b * s, features))

    assert count(m) == 2  # gate and up; their gated product, down_proj's input, is recomputed
    assert count(e) == 5  # the layer's input, the two norms' outputs, the attention output
    # (o_proj's input) and the residual stream between attention and MLP
    assert not [leaf for leaf in kept if leaf.size == b * heads * s * s]  # no attention weights


def _dot_contractions(jaxpr):
    """Contracting dims of every dot_general in a jaxpr and the jaxprs nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["dimension_numbers"][0])
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _dot_contractions(inner)
    return found


def test_projections_contract_one_axis_forward_and_backward():
    # A projection of `[B, S, E]` contracts B and S as two axes in its weight gradient, which
    # XLA:CPU compiles into a transposed copy and a matmul at half speed; as `[B*S, E]` rows
    # every product of the forward and backward pass contracts one axis.
    linear = Linear(16, 8)
    x = jax.random.normal(jax.random.key(0), (2, 6, 16))
    params = jax.jit(linear.init)(jax.random.key(1), x)
    grads = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(linear.apply(p, x) ** 2), argnums=(0, 1)))(params, x)
    contractions = _dot_contractions(grads.jaxpr)
    assert len(contractions) == 3  # forward, input gradient, weight gradient
    assert all(len(lhs) == 1 and len(rhs) == 1 for lhs, rhs in contractions)
