"""LMObjective: which targets count, and the errors a wrong batch gets."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model

from dew_lib import Dataset, LMObjective, Trainer
from dew_lib.data.chat import Role
from dew_lib.objectives import loss
from dew_lib.objectives.lm import score_targets, token_log_probs
from dew_lib.train.sinks import MemorySink

MODEL = tiny_model()


@functools.cache
def variables():
    """MODEL's weights, made once, on first use, not at import (every xdist worker imports every
    module, and at import XLA would compile with all its optimizations on)."""
    return jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


# Compiled once per objective (or shape): called eagerly, every call traced the layers' scan anew
# and compiled it again, op by op around it.
@functools.partial(jax.jit, static_argnums=0)
def compiled_loss(objective, params, batch):
    """`dew_lib.objectives.loss`, compiled."""
    return loss(objective, params, batch)


@jax.jit
def target_log_probs(params, ids):
    return token_log_probs(MODEL.apply(params, ids[:, :-1]), ids[:, 1:])


def nll(ids):
    """Per-target negative log-likelihood of one unpacked sequence."""
    return -np.asarray(target_log_probs(variables(), np.asarray(ids)[None]))[0]


def test_role_mask_equals_the_loss_on_the_sliced_assistant_targets():
    text = np.array([[4, 5, 6, 7, 8, 9, 10, 11]], np.int32)
    roles = np.array([[2, 2, 2, 3, 3, 3, 2, 3]], np.int8)
    objective = LMObjective(MODEL, seq_len=7, loss_role=Role.ASSISTANT)
    value, metrics = compiled_loss(objective, variables(), {"text": text, "text_roles": roles})
    per_target = nll(text[0])
    # targets are ids 1..7; their roles are roles[1:]; assistant targets: 8, 9, 10 and 11
    expected = per_target[[2, 3, 4, 6]].mean()
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    assert metrics["tokens"] == 4


def test_document_transitions_and_padding_never_count():
    first, second = [4, 5, 6, 7], [8, 9, 10]
    text = np.array([first + second + [0]], np.int32)
    segments = np.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 0]])
    objective = LMObjective(MODEL, seq_len=7, ema_decay=None)
    value, metrics = compiled_loss(objective, variables(), {
        "text": text, "text_segment_ids": segments, "text_positions": positions})
    expected = np.concatenate([nll(first), nll(second)]).mean()
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    assert metrics["tokens"] == 5


def test_without_loss_role_every_target_counts():
    text = np.array([[4, 5, 6, 7, 8]], np.int32)
    value, _ = compiled_loss(LMObjective(MODEL, seq_len=4), variables(), {"text": text})
    np.testing.assert_allclose(value, nll(text[0]).mean(), rtol=1e-6)


def test_batches_this_objective_cannot_read_are_refused_with_the_fix():
    objective = LMObjective(MODEL, seq_len=7, loss_role=Role.ASSISTANT)
    with pytest.raises(KeyError, match="text_roles"):
        objective.check_batch({"text": np.zeros((2, 8), np.int32)})
    with pytest.raises(KeyError, match="'text'"):
        objective.check_batch({"tokens": np.zeros((2, 8), np.int32)})
    with pytest.raises(ValueError, match=r"\[B, 8\]"):
        objective.check_batch({"text": np.zeros((2, 9), np.int32),
                               "text_roles": np.zeros((2, 9), np.int8)})
    with pytest.raises(ValueError, match="text_segment_ids"):
        LMObjective(MODEL, seq_len=7).check_batch(
            {"text": np.zeros((2, 8), np.int32), "text_segment_ids": np.zeros((2, 7), np.int32)})
    with pytest.raises(ValueError, match="max_seq_len=32"):
        LMObjective(MODEL, seq_len=33)
    with pytest.raises(ValueError, match="'params'"):
        LMObjective(MODEL, seq_len=7, pretrained=variables()["params"])


def test_the_specs_sft_example_trains_only_on_the_response():
    """The spec's SFT example, after the dew -> dew_lib rename, on a small made-up vocabulary."""
    prompt, response = [5, 6, 7, 8, 9], [10, 11, 12, 13]
    row = np.array(prompt + response, dtype=np.int32)
    roles = np.array([Role.USER] * len(prompt) + [Role.ASSISTANT] * len(response), dtype=np.int8)
    sft_batch = {"text": np.tile(row, (8, 1)), "text_roles": np.tile(roles, (8, 1))}
    sft_data = Dataset(train=lambda partition: itertools.repeat(sft_batch), val=None, records=8,
                       batch=8)
    sft_objective = LMObjective(MODEL, seq_len=len(row) - 1, pretrained=variables(),
                                loss_role=Role.ASSISTANT, ema_decay=None)
    sink = MemorySink()
    sft_state = Trainer(sft_objective, optax.adamw(1e-2), key=jax.random.key(2)).fit(
        sft_data, steps=20, log_every=10, sinks=[sink])
    assert int(sft_state.step) == 20 and int(sft_state.updates) == 20
    assert sft_state.ema is None
    losses = [value for _, value in sink.series("loss")]
    assert losses[-1] < 0.5 * losses[0]
    assert sink.series("tokens")[0][1] == 4 * 8  # 4 assistant targets per row


def test_token_accuracy_is_one_on_the_models_own_greedy_text():
    """Every target is the argmax here, so anything below 1.0 is a miscounted hit.

    Wide enough (E=128, 8 x 48 targets) that a top-1 test mixing two summation orders of the
    same logit would miss some of them.
    """
    from dew_lib.sampling import Sampling, generate

    model = tiny_model(emb_features=128, mlp_features=256, vocab_size=256, max_seq_len=64)
    # compiled whole: a model of its own shapes would otherwise compile operation by operation
    variables = jax.jit(model.init)(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))
    prompt = np.arange(1, 9, dtype=np.int32)[:, None]
    out = generate(model, variables, prompt, np.ones(8, np.int32), key=jax.random.key(0),
                   max_new_tokens=48, sampling=Sampling(temperature=0.0))
    text = np.concatenate([prompt, np.asarray(out.tokens)], axis=1)
    objective = LMObjective(model, seq_len=48)
    _, metrics = jax.jit(lambda variables, batch: loss(objective, variables, batch))(variables, {"text": text})
    assert metrics["accuracy"] == 1.0


@functools.partial(jax.jit, static_argnums=0)
def scored_and_forward(model, text):
    """`model`'s fused target scores and its logits on `text`, at weights from key 1: one program
    per model (init, scoring and forward compiled together, not operation by operation)."""
    weights = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))
    return score_targets(model, weights, text[:, :-1], text[:, 1:]), model.apply(weights, text[:, :-1])


def test_fused_target_scores_equal_full_log_softmax():
    text = np.random.default_rng(0).integers(1, 32, (3, 9)).astype(np.int32)
    for model in (MODEL, tiny_model(tie_embeddings=True)):
        (fused, top), logits = scored_and_forward(model, text)
        np.testing.assert_allclose(fused, token_log_probs(logits, text[:, 1:]), atol=1e-5)
        np.testing.assert_array_equal(top, np.argmax(np.asarray(logits), -1) == text[:, 1:])
