"""DPOObjective: the loss against TRL's formula, the frozen reference, learning and bad input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import pairs_batch

from dew_lib import Dataset, Trainer, models
from dew_lib.objectives import DPOObjective, loss
from dew_lib.objectives.dpo import dpo_loss
from dew_lib.train.sinks import MemorySink

MODEL = models.build("causal_transformer", vocab_size=12, emb_features=16, num_layers=1,
                     num_heads=2, mlp_features=32, max_seq_len=8)


def test_dpo_loss_matches_the_sigmoid_formula():
    losses, chosen, rejected = dpo_loss(jnp.array([-1.0, -2.0]), jnp.array([-3.0, -1.0]),
                                        jnp.array([-2.0, -2.0]), jnp.array([-2.0, -2.0]), 0.5)
    margin = 0.5 * np.array([(-1 + 2) - (-3 + 2), (-2 + 2) - (-1 + 2)])
    np.testing.assert_allclose(losses, np.log1p(np.exp(-margin)), rtol=1e-6)
    np.testing.assert_allclose(chosen, [0.5, 0.0])
    np.testing.assert_allclose(rejected, [-0.5, 0.5])


def test_a_policy_equal_to_its_reference_has_loss_log_2_and_no_rewards():
    objective = DPOObjective(MODEL, seq_len=3, beta=0.1)
    variables = objective.init(jax.random.key(0))
    value, metrics = loss(objective, variables, pairs_batch(), reference=variables)
    np.testing.assert_allclose(value, np.log(2.0), rtol=1e-6)
    assert float(metrics["rewards/chosen"]) == 0.0 and float(metrics["rewards/accuracy"]) == 0.0


def test_training_raises_the_chosen_over_rejected_win_rate_and_keeps_the_reference():
    batch = pairs_batch()
    objective = DPOObjective(MODEL, seq_len=3, beta=0.1)
    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(1))
    reference = jax.device_get(jax.jit(objective.init)(trainer.init_key))  # what fit starts from

    def win_rate(params):
        summed, *_ = objective._scores(params, batch)
        return float(np.mean(np.asarray(summed[:, 0] > summed[:, 1])))

    before = win_rate(reference)
    sink = MemorySink()
    data = Dataset(train=lambda partition: itertools.repeat(batch), batch=8)
    state = trainer.fit(data, steps=12, log_every=4, sinks=[sink])
    assert before < 1.0 and win_rate(state.params) == 1.0
    margins = [m for _, m in sink.series("rewards/margin")]
    assert margins[-1] > margins[0] > 0
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(state.ema), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), atol=1e-6)


def test_validation_reports_chosen_answer_perplexity():
    objective = DPOObjective(MODEL, seq_len=3)
    variables = objective.init(jax.random.key(0))
    batch = pairs_batch()
    metrics = objective.evaluate(variables, batch)
    total, count = (float(x) for x in metrics["loss"])
    assert count == 2 * 8  # two chosen completion targets (3 and 5) per pair
    derived = objective.derive({"loss": total / count})
    np.testing.assert_allclose(derived["perplexity"], np.exp(total / count), rtol=1e-6)


def test_bad_options_and_batches_are_refused():
    with pytest.raises(ValueError, match="beta must be positive, got 0"):
        DPOObjective(MODEL, seq_len=3, beta=0)
    with pytest.raises(ValueError, match="ema_decay must be 1.0; got 0.99"):
        DPOObjective(MODEL, seq_len=3, ema_decay=0.99)
    objective = DPOObjective(MODEL, seq_len=4)
    with pytest.raises(ValueError, match=r"DPOObjective\(seq_len=PreferencePairs.seq_len - 1\)"):
        objective.check_batch(pairs_batch())
    batch = dict(pairs_batch())
    batch["input_ids"] = np.where(batch["input_ids"] == 5, 20, batch["input_ids"])
    with pytest.raises(ValueError, match="token id 20, but the model's vocab_size is 12"):
        DPOObjective(MODEL, seq_len=3).check_batch(batch)
    with pytest.raises(KeyError, match="needs 'completion_mask'"):
        DPOObjective(MODEL, seq_len=3).check_batch({"input_ids": batch["input_ids"]})
