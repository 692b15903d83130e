"""Causal attention, fused or blockwise, the scanned layer stack and remat change no numbers.

The reference is the dense attention the decoder used before: scores over every key under the
mask `causal & same segment`. Compared on plain, left-padded and packed batches, forward and
backward.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_mask, tiny_model

from dew_lib.models import attention
from dew_lib.models.decoder_attention import attend, attend_causal
from dew_lib.objectives.lm import score_targets

TOKENS = np.random.default_rng(0).integers(1, 32, (3, 13)).astype(np.int32)
LAYOUTS = {  # segment ids and positions of the 12 inputs of each row
    "plain": (np.ones((3, 12), np.int32), np.tile(np.arange(12), (3, 1))),
    "padded": (np.array([[0] * 4 + [1] * 8] * 3),
               np.array([[0] * 4 + list(range(8))] * 3)),
    "packed": (np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 3 + [2] * 3 + [3] * 6, [1] * 12]),
               np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0],
                         [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 5], list(range(12))])),
}


@pytest.mark.parametrize("kernel", ["blockwise", "fused"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_causal_attention_equals_dense_attention_with_gradients(layout, kernel):
    segments, _ = LAYOUTS[layout]
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (3, 12, 4, 8))
    k = jax.random.normal(keys[1], (3, 12, 2, 8))  # grouped: 2 query heads per key head
    v = jax.random.normal(keys[2], (3, 12, 2, 8))
    mix = jax.random.normal(keys[3], (3, 12, 32))

    def causal(q, k, v):
        return attend_causal(q, k, v, segments, block=5, kernel=kernel)  # blocks of 5, 5 and 2

    def dense(q, k, v):
        return attend(q, k, v, dense_mask(segments))

    np.testing.assert_allclose(causal(q, k, v), dense(q, k, v), atol=1e-6)
    grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * mix), argnums=(0, 1, 2))(q, k, v)
             for f in (causal, dense)]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(("kernel", "statistics"), [("blockwise", 2), ("fused", 1)])
def test_causal_attention_keeps_its_inputs_once_for_the_backward_pass(kernel, statistics):
    # Blockwise query block i reads the keys and values up to its end. What the backward pass
    # keeps is the queries, keys, values and output once each plus statistics per query and
    # head (blockwise: maximum and sum; fused: their log-sum-exp), not a copy of the key and
    # value prefix per block (2x each at three blocks, 4.5x at eight).
    b, s, h, kv, d = 2, 12, 4, 2, 8
    q = jax.random.normal(jax.random.key(0), (b, s, h, d))
    k, v = (jax.random.normal(jax.random.key(i), (b, s, kv, d)) for i in (1, 2))
    segments = jnp.ones((b, s), jnp.int32)
    _, pullback = jax.vjp(lambda q, k, v: attend_causal(q, k, v, segments, 4, kernel), q, k, v)
    kept = [leaf for leaf in jax.tree.leaves(pullback) if leaf.dtype == jnp.float32]
    assert sum(leaf.size for leaf in kept) == 2 * q.size + 2 * k.size + statistics * b * h * s


def softmax_attention(qh, kh, vh, mask, groups):
    """Attention as autodiff sees it: the weights are a residual of the backward pass."""
    b, sq, t = mask.shape
    n, d = qh.shape[0], qh.shape[-1]
    scores = jnp.einsum("nqd,ntd->nqt", qh, kh).reshape(b, n // b, groups, sq, t) * d**-0.5
    scores = jnp.where(mask[:, None, None], scores, attention.NEG)
    weights = jax.nn.softmax(scores, axis=-1).reshape(n, groups * sq, t)
    return jnp.einsum("nqt,ntd->nqd", weights, vh)


def test_attention_kernel_keeps_no_weights_for_the_backward_pass_and_changes_no_numbers():
    b, kv, groups, sq, t, d = 3, 2, 2, 7, 9, 8  # 3 rows, 4 query heads over 2 key heads
    keys = jax.random.split(jax.random.key(0), 5)
    qh = jax.random.normal(keys[0], (b * kv, groups * sq, d))
    kh, vh = (jax.random.normal(k, (b * kv, t, d)) for k in keys[1:3])
    mask = jax.random.bernoulli(keys[3], 0.6, (b, sq, t)).at[0, 0].set(False)  # a row sees nothing
    mix = jax.random.normal(keys[4], qh.shape)
    out, pullback = jax.vjp(lambda *a: attention.heads(*a, mask, groups), qh, kh, vh)
    want, want_pullback = jax.vjp(lambda *a: softmax_attention(*a, mask, groups), qh, kh, vh)

    np.testing.assert_array_equal(out, want)  # the forward pass is the same arithmetic
    for got, expected in zip(pullback(mix), want_pullback(mix), strict=True):
        np.testing.assert_allclose(got, expected, atol=2e-6)
    weights = b * kv * groups * sq * t
    assert max(x.size for x in jax.tree.leaves(want_pullback)) >= weights  # autodiff keeps them
    assert max(x.size for x in jax.tree.leaves(pullback)) < weights  # queries, keys, values, mask


@functools.partial(jax.jit, static_argnums=0)
def model_outputs(model, variables, segments, positions):
    """The logits and the gradients of the summed log-likelihood of `model` on a layout's batch,
    compiled: one program per model, which every layout (of the same shapes) runs."""
    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    logits = model.apply(variables, inputs, segments, positions)

    def loss(params):
        return -jnp.sum(score_targets(model, params, inputs, targets, segments, positions)[0]
                        * (segments > 0))

    return logits, jax.grad(loss)(variables)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decoder_logits_and_gradients_match_dense_attention_unrolled_and_without_remat(layout):
    # one block: the dense mask; heads of 8, which the fused kernel tiles
    reference = tiny_model(attention_kernel="blockwise", attention_block=64, scan_layers=False,
                           head_dim=8)
    variables = jax.jit(reference.init)(jax.random.key(2), jnp.zeros((1, 8), jnp.int32))
    want_logits, want_grads = model_outputs(reference, variables, *LAYOUTS[layout])
    blockwise = {"attention_kernel": "blockwise"}
    for options in ({**blockwise, "attention_block": 4},
                    {**blockwise, "attention_block": 4, "scan_layers": True},
                    {**blockwise, "attention_block": 5, "scan_layers": True, "remat": True},
                    {**blockwise, "attention_block": 64, "scan_layers": False, "remat": True},
                    {"attention_kernel": "fused"}, {"attention_kernel": "fused", "remat": True}):
        logits, grads = model_outputs(tiny_model(head_dim=8, **options), variables, *LAYOUTS[layout])
        np.testing.assert_allclose(logits, want_logits, atol=2e-5, err_msg=str(options))
        jax.tree.map(lambda a, b, o=options: np.testing.assert_allclose(a, b, atol=2e-5, err_msg=str(o)),
                     grads, want_grads)


def test_scanned_unrolled_and_remat_models_share_one_stacked_parameter_layout():
    shapes = [jax.tree.map(lambda leaf: leaf.shape, jax.eval_shape(tiny_model(**options).init,
        jax.random.key(0), jnp.zeros((1, 4), jnp.int32))) for options in
        ({"scan_layers": True}, {"remat": True}, {"scan_layers": False})]
    assert sorted(shapes[0]["params"]) == ["embed_tokens", "layers", "lm_head", "norm"]
    assert shapes[0]["params"]["layers"]["q_proj"]["kernel"] == (2, 16, 16)
    assert shapes[1] == shapes[0] and shapes[2] == shapes[0]


def test_attention_block_must_be_positive():
    with pytest.raises(ValueError, match="attention_block"):
        tiny_model(attention_block=0).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def test_attention_kernel_must_be_a_known_one():
    with pytest.raises(ValueError, match="attention_kernel must be one of .*'flash'"):
        tiny_model(attention_kernel="flash").init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
