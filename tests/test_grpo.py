"""GRPOObjective: packed equals unpacked, the loss options, bypass mode and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from dew_lib.objectives import GRPOObjective, PackedBatch, loss
from dew_lib.objectives.lm import score_targets
from dew_lib.records.sessions import Call, Session
from dew_lib.rollouts.packing import pack

MODEL = tiny_model()
WIDTH = 16


@functools.cache
def weights(seed):
    """MODEL's weights from key `seed`, made once, on first use, not at import (every xdist worker
    imports every module, and at import XLA would compile with all its optimizations on)."""
    return jax.jit(MODEL.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))


def variables():
    return weights(0)


def other():
    return weights(1)


# Compiled once per objective (and batch shape): called eagerly, every call traced the layers'
# scan anew and compiled it again, op by op around it.
@functools.partial(jax.jit, static_argnums=0)
def compiled_loss(objective, params, batch, reference=None):
    """`dew_lib.objectives.loss`, compiled."""
    return loss(objective, params, batch, reference=reference)


@functools.partial(jax.jit, static_argnums=0)
def target_log_probs(objective, params, batch):
    return objective.target_log_probs(params, batch)


@functools.partial(jax.jit, static_argnums=0)
def forward(model, params, ids):
    return model.apply(params, ids)


@functools.partial(jax.jit, static_argnums=0)
def compiled_value_and_grad(objective, batches, params, reference):
    """The mean loss and its gradient on each of `batches`: one program for all of them."""
    def f(p, batch):
        terms = objective.terms(p, batch, step=jnp.int32(0), reference=reference,
                                key=jax.random.key(0))
        return terms.total / terms.weight

    return tuple(jax.value_and_grad(f)(params, batch) for batch in batches)


def sessions(seed=0):
    """Two groups of two sessions; the first session's second call extends its chain."""
    rng = np.random.default_rng(seed)

    def draw(n):
        return rng.integers(1, 32, n), -rng.uniform(0.1, 3.0, n), -rng.uniform(0.1, 3.0, n)

    out = []
    for task in range(2):
        for sample in range(2):
            ids, raw, behavior = draw(3)
            prompt = rng.integers(1, 32, 2 + task)
            calls = [Call(prompt_ids=prompt, sampled_ids=ids, behavior_log_probs=behavior,
                          raw_log_probs=raw)]
            if task == 0 and sample == 0:
                more, raw2, behavior2 = draw(2)
                context = np.concatenate([prompt, ids, [7]])  # chain + one observation id
                calls.append(Call(prompt_ids=context, sampled_ids=more, behavior_log_probs=behavior2,
                                  raw_log_probs=raw2))
            out.append(Session(task=str(task), group=task, sample=sample, calls=tuple(calls),
                               reward=float(rng.uniform())))
    return out


def unmerged(members, width):
    """The same calls, one call per row, with the columns pack gives their sampled ids."""
    packed = pack(members, width)
    rows = []
    for s_index, s in enumerate(members):
        advantage = packed["advantages"][packed["session_index"] == s_index][0]
        weight = packed["session_weights"][packed["session_index"] == s_index][0]
        for c_index, call in enumerate(s.calls):
            ids = np.concatenate([call.prompt_ids, call.sampled_ids])
            row = {k: np.zeros(width, v.dtype) for k, v in packed.items()}
            n, p = ids.size, call.prompt_ids.size
            row["input_ids"][:n] = ids
            row["text_segment_ids"][:n] = 1
            row["text_positions"][:n] = np.arange(n)
            row["response_mask"][p:n] = 1
            row["behavior_log_probs"][p:n] = call.behavior_log_probs
            row["old_log_probs"][p:n] = call.raw_log_probs
            row["advantages"][:n] = advantage
            row["session_weights"][p:n] = weight
            row["session_index"][:] = -1
            row["session_index"][p:n] = s_index
            row["call_index"][:] = -1
            row["call_index"][p:n] = c_index
            rows.append(row)
    return {k: np.stack([r[k] for r in rows]) for k in packed}


def value_and_grad(objective, *batches):
    """(mean loss, its gradient) on each batch, at weights(0) with the reference weights(1)."""
    return compiled_value_and_grad(objective, batches, variables(), other())


@pytest.mark.parametrize("options", [
    dict(policy_loss="ppo", beta=0.05),
    dict(policy_loss="cispo", aggregation="session-mean"),
    dict(policy_loss="ppo", behavior_importance=2.0, aggregation="session-mean"),
    dict(policy_loss="ppo", behavior_importance=(0.5, 2.0)),
])
def test_packed_rows_equal_one_call_per_row_gradients_included(options):
    members = sessions()
    objective = GRPOObjective(MODEL, seq_len=WIDTH - 1, **options)
    packed = pack(members, WIDTH)
    separate = unmerged(members, WIDTH)
    assert packed["input_ids"].shape[0] < separate["input_ids"].shape[0]  # chains share rows
    (value, grads), (expected, expected_grads) = value_and_grad(objective, packed, separate)
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_gspo_pools_its_ratio_per_chain_whatever_shares_the_row():
    members = [s for s in sessions() if len(s.calls) == 1]
    objective = GRPOObjective(MODEL, seq_len=WIDTH - 1, policy_loss="gspo")
    (value, grads), (expected, expected_grads) = value_and_grad(objective, pack(members, WIDTH),
                                                                unmerged(members, WIDTH))
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_on_policy_ppo_loss_is_minus_the_mean_advantage_and_kl_to_itself_is_zero():
    batch = pack(sessions(), WIDTH)
    objective = GRPOObjective(MODEL, seq_len=WIDTH - 1, beta=0.1)
    batch["old_log_probs"] = np.asarray(objective.packed_log_probs(variables(), batch))
    value, metrics = compiled_loss(objective, variables(), batch, reference=variables())
    mask = batch["response_mask"][:, 1:]
    expected = -(batch["advantages"][:, 1:] * mask).sum() / mask.sum()
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7)
    assert abs(float(metrics["kl"])) < 1e-6
    assert float(metrics["clipfrac"]) == 0.0
    np.testing.assert_allclose(metrics["ratio"], 1.0, rtol=1e-6)


@pytest.mark.parametrize("options", [dict(behavior_importance=2.0, beta=0.05),
                                     dict(behavior_importance=(0.5, 2.0), policy_loss="cispo")])
def test_a_proximal_policy_scored_in_the_update_equals_a_rescoring_pass(options):
    # What the scheduler relies on: a batch whose proximal policy is scored in the update instead of rescoring
    # old_log_probs under the same weights changes neither the loss nor its gradients.
    objective = GRPOObjective(MODEL, seq_len=WIDTH - 1, **options)
    rescored = pack(sessions(), WIDTH)
    rescored["old_log_probs"] = np.asarray(objective.packed_log_probs(variables(), rescored))
    in_step = PackedBatch.of({k: v for k, v in rescored.items() if k != "old_log_probs"},
                             proximal="in_update")
    objective.check_batch(in_step)
    (value, grads), (expected, expected_grads) = value_and_grad(objective, in_step, rescored)
    np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="two different proximal policies"):
        PackedBatch.of({**in_step, "old_log_probs": rescored["old_log_probs"]}, proximal="in_update")


def test_packed_log_probs_score_each_id_against_its_own_chain():
    members = sessions()
    batch = pack(members, WIDTH)
    objective = GRPOObjective(MODEL, seq_len=WIDTH - 1)
    scores = np.asarray(objective.packed_log_probs(variables(), batch))
    # The merged first session, scored alone from position 0.
    first = np.concatenate([members[0].calls[1].prompt_ids, members[0].calls[1].sampled_ids])
    alone, _ = jax.jit(score_targets, static_argnums=0)(MODEL, variables(), first[None, :-1], first[None, 1:])
    row, start = np.argwhere(batch["session_index"] == 0)[0]
    start -= members[0].calls[0].prompt_ids.size
    np.testing.assert_allclose(scores[row, start + 1:start + first.size], np.asarray(alone)[0],
                               rtol=1e-5, atol=1e-6)
    assert scores[row, start] == 0.0
    assert np.all(scores[batch["text_segment_ids"] == 0] == 0.0)


def test_bypass_mode_uses_behavior_as_old_policy_and_band_masks_leave_the_denominator():
    batch = pack(sessions(), WIDTH)
    batch.pop("old_log_probs")
    objective = GRPOObjective(MODEL, seq_len=WIDTH - 1, behavior_importance=(0.2, 5.0))
    value, metrics = compiled_loss(objective, variables(), batch)
    scored = np.asarray(target_log_probs(objective, variables(), batch))
    mask = batch["response_mask"][:, 1:] > 0
    ratio = np.exp(scored - batch["behavior_log_probs"][:, 1:])
    band = (ratio >= 0.2) & (ratio <= 5.0) & mask
    assert 0 < band.sum() < mask.sum()  # the band removes some tokens here
    assert float(metrics["masked/behavior_band"]) == pytest.approx(1 - band.sum() / mask.sum())
    adv = batch["advantages"][:, 1:]
    clipped = np.clip(ratio, 0.8, 1.2)
    per_token = np.maximum(-adv * ratio, -adv * clipped)
    per_token = np.where(adv < 0, np.minimum(per_token, -adv * 3.0), per_token)
    np.testing.assert_allclose(value, per_token[band].sum() / band.sum(), rtol=1e-5)
    assert "mismatch/kl" in metrics and "mismatch/ess" in metrics


def test_sequence_and_geometric_masks_reject_whole_chains():
    batch = pack(sessions(), WIDTH)
    objective = GRPOObjective(MODEL, seq_len=WIDTH - 1, sequence_mask=(0.999, 1.001))
    _, metrics = compiled_loss(objective, variables(), batch)
    assert float(metrics["masked/sequence"]) == 1.0  # recorded raw and behavior differ a lot
    loose = GRPOObjective(MODEL, seq_len=WIDTH - 1, geometric_mask=(1e-6, 1e6))
    _, metrics = compiled_loss(loose, variables(), batch)
    assert float(metrics["masked/geometric"]) == 0.0


def test_sampling_temperature_and_support_change_what_a_sampled_id_scores():
    s = Session(task="0", calls=(Call(prompt_ids=[1, 2], sampled_ids=[3, 4],
                                      behavior_log_probs=[-1.0, -1.0], support=[[3, 5, 6], [4]]),),
                reward=1.0)
    batch = pack([s], 6, support_capacity=6)
    objective = GRPOObjective(MODEL, seq_len=5, sampling_temperature=0.7)
    scored = np.asarray(target_log_probs(objective, variables(), batch))[0]
    logits = np.asarray(forward(MODEL, variables(), batch["input_ids"][:, :-1]))[0] / 0.7
    # Column 2 (id 3) over its support {3, 5, 6}; column 3 (id 4) alone in its support.
    expected = logits[1, 3] - np.log(np.exp(logits[1, [3, 5, 6]]).sum())
    np.testing.assert_allclose(scored[1], expected, rtol=1e-5)
    np.testing.assert_allclose(scored[2], 0.0, atol=1e-6)
    # Without a support, the full vocabulary at the temperature.
    batch.pop("support_ids"), batch.pop("support_columns")
    full = np.asarray(target_log_probs(objective, variables(), batch))[0]
    np.testing.assert_allclose(full[1], logits[1, 3] - np.log(np.exp(logits[1]).sum()), rtol=1e-5)


def test_bad_options_and_batches_are_refused_with_the_value():
    with pytest.raises(ValueError, match="beta must be >= 0"):
        GRPOObjective(MODEL, seq_len=15, beta=-1)
    with pytest.raises(ValueError, match="policy_loss must be one of .*got 'grpo'"):
        GRPOObjective(MODEL, seq_len=15, policy_loss="grpo")
    with pytest.raises(ValueError, match="aggregation must be one of .*got 'seq-mean'"):
        GRPOObjective(MODEL, seq_len=15, aggregation="seq-mean")
    with pytest.raises(ValueError, match="low < 1 < high"):
        GRPOObjective(MODEL, seq_len=15, geometric_mask=(2.0, 3.0))
    with pytest.raises(ValueError, match="TIS cap must be >= 1"):
        GRPOObjective(MODEL, seq_len=15, behavior_importance=0.5)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        GRPOObjective(MODEL, seq_len=64)
    objective = GRPOObjective(MODEL, seq_len=WIDTH - 1, behavior_importance=2.0)
    batch = pack(sessions(), WIDTH)
    bypass = {k: v for k, v in batch.items() if k != "old_log_probs"}
    with pytest.raises(ValueError, match="would count that correction twice"):
        objective.check_batch(bypass)
    shifted = dict(batch, behavior_log_probs=np.roll(batch["behavior_log_probs"], 1, axis=1))
    with pytest.raises(ValueError, match="not aligned with the sampled ids"):
        objective.check_batch(shifted)
    with pytest.raises(ValueError, match=r"expected \[rows, seq_len \+ 1\] = \[rows, 17\]"):
        GRPOObjective(MODEL, seq_len=WIDTH).check_batch(batch)
    with pytest.raises(KeyError, match="must go through a rollout"):
        objective.check_batch({"input_ids": batch["input_ids"]})
    too_big = dict(batch, input_ids=np.where(batch["input_ids"] > 0, 40, 0).astype(np.int32))
    with pytest.raises(ValueError, match="token id 40, but the model's vocab_size is 32"):
        objective.check_batch(too_big)


def test_the_kl_estimator_is_chosen_by_name():
    from dew_lib.objectives import algorithms

    current, reference = jnp.array([-1.0, -2.0]), jnp.array([-1.5, -1.0])
    delta = np.array([0.5, -1.0])  # current - reference
    np.testing.assert_allclose(algorithms.k1(current, reference), delta)
    np.testing.assert_allclose(algorithms.k2(current, reference), delta ** 2 / 2)
    np.testing.assert_allclose(algorithms.k3(current, reference), np.exp(-delta) + delta - 1, rtol=1e-6)
    batch = pack(sessions(), WIDTH)
    kls = {}
    for name in ("k1", "k2", "k3"):
        objective = GRPOObjective(MODEL, seq_len=WIDTH - 1, beta=0.1, kl_estimator=name)
        _, metrics = compiled_loss(objective, variables(), batch, reference=other())
        kls[name] = float(metrics["kl"])
    assert len(set(kls.values())) == 3 and kls["k2"] > 0 and kls["k3"] > 0
    with pytest.raises(ValueError, match="kl_estimator must be one of .*got 'mse'"):
        GRPOObjective(MODEL, seq_len=WIDTH - 1, beta=0.1, kl_estimator="mse")
