"""The chunked loss head equals the full-logits head: values, gradients, entropy, accuracy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on_host_devices, tiny_model

from dew_lib.models import head
from dew_lib.objectives.lm import score_targets, score_targets_with_entropy


def full_head(hidden, weight, targets, temperature, vocab_major):
    """The reference: whole logits, log-softmax, gathered target, entropy, argmax."""
    logits = hidden @ (weight.T if vocab_major else weight)
    log_softmax = jax.nn.log_softmax(logits / temperature, axis=-1)
    picked = jnp.take_along_axis(log_softmax, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(log_softmax) * log_softmax, axis=-1)
    return picked, jnp.argmax(logits, axis=-1) == targets, entropy


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_head_equals_the_full_head_with_gradients(vocab_major, temperature):
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (3, 7, 16))  # 21 tokens: chunks of 8 leave 3 of padding
    weight = 0.5 * jax.random.normal(keys[1], (40, 16) if vocab_major else (16, 40))
    targets = jax.random.randint(keys[2], (3, 7), 0, 40)
    mix = jax.random.normal(keys[3], (3, 7))

    def chunked(hidden, weight):
        return head.target_scores(hidden, weight, targets, temperature=temperature,
                                  vocab_major=vocab_major, chunk=8, entropy=True)

    def reference(hidden, weight):
        return full_head(hidden, weight, targets, temperature, vocab_major)

    for got, want in zip(chunked(hidden, weight), reference(hidden, weight), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)

    def objective(scores):  # uses log-probs and entropy with different weights per token
        return lambda h, w: jnp.sum(scores(h, w)[0] * mix + scores(h, w)[2] * mix**2)

    got = jax.grad(objective(chunked), argnums=(0, 1))(hidden, weight)
    want = jax.grad(objective(reference), argnums=(0, 1))(hidden, weight)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_weighted_sum_head_equals_the_full_head_and_forms_its_gradient_before_the_backward_pass(
        vocab_major):
    keys = jax.random.split(jax.random.key(5), 4)
    hidden = jax.random.normal(keys[0], (3, 7, 16))  # 21 tokens in chunks of 8
    weight = 0.5 * jax.random.normal(keys[1], (40, 16) if vocab_major else (16, 40))
    targets = jax.random.randint(keys[2], (3, 7), 0, 40)
    weights = jax.random.bernoulli(keys[3], 0.7, (3, 7)).astype(jnp.float32) * 1.5

    def chunked(h, w):
        return head.weighted_log_prob_sum(h, w, targets, weights, vocab_major=vocab_major, chunk=8)

    def reference(h, w):
        picked, top, _ = full_head(h, w, targets, 1.0, vocab_major)
        return jnp.sum(picked * weights), top

    (total, top), (want_total, want_top) = chunked(hidden, weight), reference(hidden, weight)
    np.testing.assert_allclose(total, want_total, rtol=1e-6)
    np.testing.assert_array_equal(top, want_top)
    for scale in (1.0, -0.25):  # the cotangent scales the gradient formed in the forward pass
        got = jax.grad(lambda h, w, s=scale: s * chunked(h, w)[0], argnums=(0, 1))(hidden, weight)
        want = jax.grad(lambda h, w, s=scale: s * reference(h, w)[0], argnums=(0, 1))(hidden, weight)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=2e-5)
    # under a loss the forward pass holds three head products per chunk and the backward none
    program = jax.jit(jax.grad(lambda h, w: chunked(h, w)[0], argnums=(0, 1))).lower(
        hidden, weight).as_text()
    assert program.count("dot_general") == 3


def test_without_entropy_the_head_returns_two_outputs_and_the_same_gradient():
    hidden = jax.random.normal(jax.random.key(1), (2, 5, 8))
    weight = jax.random.normal(jax.random.key(2), (8, 24))
    targets = jnp.arange(10).reshape(2, 5)
    out = head.target_scores(hidden, weight, targets, chunk=4)
    assert len(out) == 2 and out[1].dtype == jnp.bool_
    grad = jax.grad(lambda w: head.target_scores(hidden, w, targets, chunk=4)[0].sum())(weight)
    want = jax.grad(lambda w: full_head(hidden, w, targets, 1.0, False)[0].sum())(weight)
    np.testing.assert_allclose(grad, want, atol=2e-5)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_the_compiled_weight_gradient_contracts_no_leading_axes(vocab_major):
    # `h^T @ dz` with the transpose folded in contracts both operands' leading axes, a form
    # XLA:CPU leaves to its own emitter at half the rate of YNN on the plain layout. Both
    # heads' weight gradients compile without that form.
    hidden, targets, token_weights = jnp.ones((64, 16)), jnp.zeros((64,), jnp.int32), jnp.ones((64,))
    weight = jnp.ones((40, 16) if vocab_major else (16, 40))

    def weighted(h, w):
        return head.weighted_log_prob_sum(h, w, targets, token_weights, vocab_major=vocab_major, chunk=32)[0]

    def scored(h, w):
        return jnp.sum(head.target_scores(h, w, targets, vocab_major=vocab_major, chunk=32)[0])

    for loss in (weighted, scored):
        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, weight).compile().as_text()
        assert " dot(" in text or "__ynn_fusion" in text
        assert "lhs_contracting_dims={0}, rhs_contracting_dims={0}" not in text


def test_chunk_sizes_follow_the_vocabulary_and_the_token_count():
    assert head.chunk_tokens(8192, 4096) == 2048  # 64 MB of float32 logits
    assert head.chunk_tokens(151_936, 8192) == 128  # never below 128 tokens (78 MB here)
    assert head.chunk_tokens(32, 10**6) == 4096  # never above 4096
    assert head.chunk_tokens(8192, 21) == 24  # a short batch is one chunk, rounded up to 8
    with pytest.raises(ValueError, match="temperature"):
        head.target_scores(jnp.zeros((2, 4)), jnp.zeros((4, 8)), jnp.zeros((2,), jnp.int32),
                           temperature=0.0)


@pytest.mark.parametrize("tie", [False, True])
def test_model_scores_equal_full_logits_and_count_accuracy_the_same(tie):
    model = tiny_model(tie_embeddings=tie, head_chunk=16)  # 3 x 9 = 27 tokens: two chunks
    variables = jax.jit(model.init)(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))
    text = np.random.default_rng(4).integers(1, 32, (3, 10)).astype(np.int32)
    inputs, targets = text[:, :-1], text[:, 1:]
    log_probs, top, entropy = score_targets_with_entropy(model, variables, inputs, targets,
                                                         temperature=0.8)
    plain_lp, plain_top = score_targets(model, variables, inputs, targets, temperature=0.8)
    logits = model.apply(variables, inputs)
    want_lp, want_top, want_entropy = full_head(logits, jnp.eye(32), targets, 0.8, False)
    np.testing.assert_allclose(log_probs, want_lp, atol=2e-5)
    np.testing.assert_allclose(entropy, want_entropy, atol=2e-5)
    np.testing.assert_array_equal(plain_lp, log_probs)
    np.testing.assert_array_equal(top, want_top)
    np.testing.assert_array_equal(plain_top, top)

    def loss(params, scorer):
        return -scorer(params)[0].mean()

    chunked = jax.grad(loss)(variables, lambda p: score_targets(model, p, inputs, targets))
    full = jax.grad(loss)(variables, lambda p: full_head(model.apply(p, inputs), jnp.eye(32),
                                                         targets, 1.0, False))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), chunked, full)


def test_a_data_parallel_step_scores_each_device_s_own_tokens():
    # 8 rows x 8 tokens split over 2 host devices, the head in chunks of 8 tokens: every chunk
    # holds tokens of both devices, so no device gathers the other's hidden states to score
    # them, and each device joins its 4 tokens of two chunks into one chunk of 8
    out = run_on_host_devices("""
        import jax, numpy as np, optax
        from conftest import tiny_model
        from dew_lib import LMObjective, Trainer
        trainer = Trainer(LMObjective(tiny_model(head_chunk=8), seq_len=8, ema_decay=None),
                          optax.adam(1e-2), key=jax.random.key(0))
        state = trainer.initial_state()
        text = np.random.default_rng(0).integers(1, 32, (8, 9)).astype(np.int32)
        program = trainer._steps[True].lower(state, trainer._shard({"text": text})).compile().as_text()
        print(jax.device_count(), program.count("all-gather("), program.count("f32[8,32]"),
              program.count("f32[4,32]"))
    """)
    devices, gathers, full_chunks, half_chunks = map(int, out.split())
    assert (devices, gathers) == (2, 0)
    assert full_chunks > 0 and half_chunks == 0  # a device's logits: 8 tokens, never 4


@pytest.mark.parametrize("scorer", ["weighted_log_prob_sum", "target_scores"])
def test_a_data_parallel_head_sums_its_weight_gradient_once(scorer):
    # 64 tokens in 4 chunks of 16, split over 2 host devices: each device loops over its 8
    # tokens of every chunk, and the devices add their [16, 40] weight gradients after the
    # loop, not in every trip of it
    out = run_on_host_devices(f"""
        import re
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        from dew_lib.models import head

        keys = jax.random.split(jax.random.key(0), 4)
        hidden = jax.random.normal(keys[0], (8, 8, 16))
        weight = 0.5 * jax.random.normal(keys[1], (16, 40))
        targets = jax.random.randint(keys[2], (8, 8), 0, 40)
        mix = jax.random.normal(keys[3], (8, 8))

        def loss(hidden, weight, targets, mix):
            if "{scorer}" == "weighted_log_prob_sum":
                return head.weighted_log_prob_sum(hidden, weight, targets, mix, chunk=16)[0]
            log_probs, _, entropy = head.target_scores(hidden, weight, targets, chunk=16,
                                                       temperature=0.7, entropy=True)
            return jnp.sum(log_probs * mix + 0.1 * entropy)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        batch = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
        placed = [jax.device_put(x, batch) for x in (hidden, targets, mix)]
        args = (placed[0], weight, placed[1], placed[2])
        one, split = step(hidden, weight, targets, mix), step(*args)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(split)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        program = step.lower(*args).compile().as_text()
        bodies = set(re.findall(r"body=%?([\\w.\\-]+)", program))
        where, sums = None, []
        for line in program.splitlines():
            if line and not line.startswith(" ") and "{{" in line:
                where = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            if "all-reduce(" in line and "f32[16,40]" in line.split("all-reduce(")[0]:
                sums.append(where in bodies)
        print(len(bodies), sums)
    """)
    loops, sums = out.split(maxsplit=1)
    assert int(loops) >= 1 and sums.strip() == "[False]"
