"""Dew's pure RL functions against fixtures written by TRL and verl (tools/parity_*.py).

The fixtures hold fixed float32 inputs and the references' outputs and autograd gradients; the
versions and file hashes they came from are recorded inside them. Where Dew differs on purpose
(singleton groups, the trainer's configured denominators) the test states the relation instead.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew_lib.objectives import algorithms
from dew_lib.objectives.dpo import dpo_loss

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "parity")


def load(name):
    with open(os.path.join(FIXTURES, name)) as handle:
        return json.load(handle)


def array(spec):
    return np.asarray(spec["data"], spec["dtype"]).reshape(spec["shape"])


GRPO = load("grpo_verl.json")
DPO = load("dpo_trl.json")
INPUTS = {name: array(spec) for name, spec in GRPO["inputs"].items()}
CASES = {case["name"]: case for case in GRPO["cases"]}
MASK = INPUTS["response_mask"].astype(np.float32)
ROWS, WIDTH = MASK.shape
CHAINS = np.arange(ROWS)[:, None] * WIDTH + 1 + np.zeros((ROWS, WIDTH), np.int32)  # a chain per row
SESSIONS = np.where(MASK > 0, np.arange(ROWS)[:, None], -1)
AGGREGATION = {"token-mean": "token-mean", "seq-mean-token-mean": "session-mean"}
LOSS = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo"}


def cases(kind):
    return [name for name, case in CASES.items() if case["kind"] == kind]


def policy_loss(case):
    options = case["options"]
    clip = algorithms.Clip(options["clip_ratio_low"], options["clip_ratio_high"],
                           options.get("clip_ratio_c"))
    inputs = {k: INPUTS[v] for k, v in case["inputs"].items()}
    weights = np.ones_like(MASK)
    if options["rollout_is_weights"]:
        weights = array(CASES[options["rollout_is_weights"]]["outputs"]["weights"])
    function = algorithms.POLICY_LOSSES[LOSS[options["loss_mode"]]]
    aggregate = algorithms.AGGREGATIONS[AGGREGATION[options["loss_agg_mode"]]]

    def total(log_prob):
        surrogate = function(log_prob, inputs["old_log_prob"], inputs["advantages"], MASK, CHAINS, clip)
        value, normalizer = aggregate(surrogate.loss * weights, MASK, SESSIONS)
        return value, (normalizer, surrogate)

    (value, (normalizer, surrogate)), grad = jax.value_and_grad(total, has_aux=True)(
        jnp.asarray(inputs["log_prob"]))
    return float(value), float(normalizer), np.asarray(grad), surrogate


@pytest.mark.parametrize("name", [n for n in cases("policy_loss") if "global" not in n])
def test_policy_losses_match_verl_values_gradients_and_clip_fractions(name):
    case = CASES[name]
    value, normalizer, grad, surrogate = policy_loss(case)
    # The reference's gradient is of its mean; Dew's update divides by the normalizer afterwards.
    np.testing.assert_allclose(grad / normalizer, array(case["outputs"]["grad_log_prob"]),
                               rtol=2e-5, atol=1e-7)
    if case["options"]["loss_mode"] != "cispo":  # CISPO's value holds log pi: only gradients compare
        np.testing.assert_allclose(value / normalizer, array(case["outputs"]["loss"]), rtol=2e-6, atol=1e-7)
    metrics = case["outputs"]["metrics"]
    count = MASK.sum()
    np.testing.assert_allclose((np.asarray(surrogate.clipped) * MASK).sum() / count,
                               metrics["actor/pg_clipfrac"], rtol=1e-6)
    np.testing.assert_allclose((np.asarray(surrogate.clipped_lower) * MASK).sum() / count,
                               metrics["actor/pg_clipfrac_lower"], rtol=1e-6)


def test_verl_trainer_denominators_divide_the_same_numerators():
    """verl's trainer divides by the mini-batch's global token or configured row count; Dew
    divides by what the update actually holds. The sums being divided agree."""
    for name, dew_count in (("vanilla_0_token-mean_global_tokens", MASK.sum()),
                            ("vanilla_0_seq-mean-token-mean_global_rows", (MASK.sum(1) > 0).sum())):
        case = CASES[name]
        info = case["options"]["global_batch_info"]
        value, normalizer, _, _ = policy_loss(case)
        assert normalizer == dew_count
        seq_mean = case["options"]["loss_agg_mode"] == "seq-mean-token-mean"
        denominator = info["global_batch_size"] if seq_mean else info["batch_num_tokens"]
        np.testing.assert_allclose(value / denominator, array(case["outputs"]["loss"]), rtol=2e-6)


@pytest.mark.parametrize("name", ["kl_kl_token-mean", "kl_k1_token-mean", "kl_k1_seq-mean-token-mean",
                                  "kl_low_var_kl_token-mean", "kl_k3_token-mean",
                                  "kl_k3_seq-mean-token-mean"])
def test_k1_and_k3_match_verl(name):
    case = CASES[name]
    estimator = algorithms.KL_ESTIMATORS[case["options"]["estimator"]]
    aggregate = algorithms.AGGREGATIONS[AGGREGATION[case["options"]["loss_agg_mode"]]]
    reference = INPUTS["ref_log_prob"]

    def mean(log_prob):
        value, normalizer = aggregate(estimator(log_prob, reference), MASK, SESSIONS)
        return value / normalizer

    per_token = estimator(jnp.asarray(INPUTS["log_prob"]), reference)
    np.testing.assert_allclose(per_token, array(case["outputs"]["kl"]), rtol=1e-6, atol=1e-7)
    value, grad = jax.value_and_grad(mean)(jnp.asarray(INPUTS["log_prob"]))
    np.testing.assert_allclose(value, array(case["outputs"]["loss"]), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(grad, array(case["outputs"]["grad_log_prob"]), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("name,estimator", [
    ("advantage_grpo_std", "group"), ("advantage_grpo_vectorized_std", "group"),
    ("advantage_grpo_no_std", "mean"), ("advantage_grpo_vectorized_no_std", "mean"),
    ("advantage_rloo", "rloo"), ("advantage_rloo_vectorized", "rloo"),
])
def test_advantages_match_verl_except_for_singletons(name, estimator):
    groups = INPUTS["index"]
    expected = array(CASES[name]["outputs"]["row_advantages"])
    ours = algorithms.advantages(estimator, INPUTS["scores"], groups)
    singleton = np.bincount(np.unique(groups, return_inverse=True)[1])[np.unique(groups, return_inverse=True)[1]] == 1
    assert singleton.sum() == 1
    np.testing.assert_allclose(ours[~singleton], expected[~singleton], rtol=1e-5, atol=1e-6)
    # A lone member has nothing to be compared with: Dew gives 0 where verl's loop versions give
    # (about) its raw score and its vectorized RLOO gives 0.
    assert ours[singleton] == 0.0
    if name == "advantage_rloo_vectorized":
        assert expected[singleton] == 0.0
    else:
        np.testing.assert_allclose(expected[singleton], INPUTS["scores"][singleton], rtol=1e-5)


def test_token_tis_and_icepop_weights_match_verl():
    old, behavior = INPUTS["old_log_prob"], INPUTS["rollout_log_prob"]
    tis = algorithms.truncated_importance(old, behavior, 2.0) * MASK
    np.testing.assert_allclose(tis, array(CASES["tis_token_2.0"]["outputs"]["weights"]), rtol=1e-6)
    icepop = algorithms.band_weights(old, behavior, 0.5, 2.0) * MASK
    np.testing.assert_allclose(icepop, array(CASES["icepop_token_0.5_2.0"]["outputs"]["weights"]),
                               rtol=1e-6)


@pytest.mark.parametrize("name,band,mean", [
    ("rejection_seq_sum_k1_0.5_1.5", (0.5, 1.5), False),
    ("rejection_seq_sum_k1_2.0", (0.5, 2.0), False),   # one number u means [1/u, u]
    ("rejection_seq_mean_k1_0.8_1.25", (0.8, 1.25), True),
])
def test_sequence_and_geometric_masks_match_verl_rejection(name, band, mean):
    kept = algorithms.chain_k1_mask(INPUTS["old_log_prob"], INPUTS["rollout_log_prob"], MASK,
                                    CHAINS, *band, mean=mean)
    expected = array(CASES[name]["outputs"]["mask"])
    np.testing.assert_array_equal(np.asarray(kept) * MASK, expected * MASK)
    assert 0 < (expected * MASK).sum() < MASK.sum()  # the case keeps some chains and drops some


def test_bypass_band_is_verl_token_k1_rejection_with_inverted_bounds():
    # token_k1 keeps log lo <= log(behavior / train) <= log hi, i.e. 1/hi <= train/behavior <= 1/lo.
    kept = algorithms.band_mask(INPUTS["old_log_prob"], INPUTS["rollout_log_prob"], 1 / 1.25, 1 / 0.5)
    expected = array(CASES["rejection_token_k1_0.5_1.25"]["outputs"]["mask"])
    np.testing.assert_array_equal(np.asarray(kept) * MASK, expected * MASK)


def test_mismatch_metrics_match_verl_off_policy_kl():
    metrics = CASES["correction_tis_2.0_seq_sum_k1_0.5_1.5"]["outputs"]["metrics"]
    ours = algorithms.mismatch_metrics(INPUTS["old_log_prob"], INPUTS["rollout_log_prob"], MASK)
    for name, theirs in (("mismatch/kl", "rollout_corr/kl"), ("mismatch/k3_kl", "rollout_corr/k3_kl")):
        total, count = ours[name]
        np.testing.assert_allclose(float(total) / float(count), metrics[theirs], rtol=1e-5)


@pytest.mark.parametrize("case", DPO["cases"], ids=[c["name"] for c in DPO["cases"]])
def test_dpo_loss_rewards_and_gradients_match_trl(case):
    tokens = array(case["inputs"]["token_log_probs"])
    mask = array(case["inputs"]["completion_mask"]).astype(np.float32)
    reference = array(case["inputs"]["reference_log_probs"])
    beta = case["options"]["beta"]

    def mean_loss(token_log_probs):
        # Dew's objective: target t is predicted at input position t - 1 and weighed by its mask.
        summed = (token_log_probs[..., 1:] * mask[..., 1:]).sum(-1)
        losses, chosen, rejected = dpo_loss(summed[:, 0], summed[:, 1], reference[:, 0],
                                            reference[:, 1], beta)
        return losses.mean(), (summed, losses, chosen, rejected)

    (value, (summed, losses, chosen, rejected)), grad = jax.value_and_grad(mean_loss, has_aux=True)(
        jnp.asarray(tokens))
    out = case["outputs"]
    np.testing.assert_allclose(summed, array(out["policy_log_probs"]), rtol=1e-6)
    np.testing.assert_allclose(value, array(out["loss"]), rtol=1e-6, atol=6e-8)
    np.testing.assert_allclose(losses, array(out["pair_loss"]), rtol=1e-6, atol=6e-8)
    np.testing.assert_allclose(chosen, array(out["chosen_rewards"]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rejected, array(out["rejected_rewards"]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(chosen > rejected, np.float32), array(out["reward_accuracy"]))
    np.testing.assert_allclose(grad, array(out["grad_token_log_probs"]), rtol=1e-6, atol=1e-12)
    assert DPO["reference"]["package"] == "trl"
