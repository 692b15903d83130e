"""The DPO family (TRL's loss_type): each loss against TRL 1.12's own trainers, the reference it
does or does not hold, KTO's unpaired data and KL baseline, and the options that choose them.

The fixture (tests/fixtures/parity/dpo_family_trl.json) is written by
`python3 tools/parity_dpo.py --family`; it holds TRL's losses, logged rewards and autograd
gradients on fixed float32 log-probs. The bound is the sigmoid DPO parity test's
(tests/test_parity_references.py): rtol 1e-6 with atol 6e-8 on losses, 1e-7 on rewards.
"""

import itertools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import pairs_batch

from dew_lib import Dataset, Trainer, models
from dew_lib.data import DataError, Loading, Partition, PreferencePairs, UnpairedExamples
from dew_lib.objectives import DPOObjective, KTOObjective, loss
from dew_lib.objectives.dpo import family_terms
from dew_lib.objectives.preference_losses import (
    REFERENCE_FREE,
    LossSettings,
    PairScores,
    kto_baseline,
    kto_loss,
    log1mexp,
)
from dew_lib.recipes import DPOOptions, build_dpo

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "parity", "dpo_family_trl.json")
with open(FIXTURE) as handle:
    TRL = json.load(handle)
CASES = {case["name"]: case for case in TRL["cases"]}
MODEL = models.build("causal_transformer", vocab_size=12, emb_features=16, num_layers=1,
                     num_heads=2, mlp_features=32, max_seq_len=8)
LOADING = Loading(workers=0, threads=1, read_buffer=2)


def array(spec):
    return np.asarray(spec["data"], spec["dtype"]).reshape(spec["shape"])


def settings(options):
    return LossSettings(beta=options["beta"], label_smoothing=options.get("label_smoothing", 0.0),
                        simpo_gamma=options.get("simpo_gamma", 0.5))


def test_the_fixture_records_trl_1_12_and_every_loss_type():
    assert TRL["reference"]["package"] == "trl" and TRL["reference"]["version"] == "1.12.0"
    assert {case["options"]["loss_type"] for case in TRL["cases"]} == {
        "sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "kto"}


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["kind"] == "pair"])
def test_paired_losses_match_trl_values_rewards_and_gradients(name):
    case = CASES[name]
    options, out = case["options"], case["outputs"]
    mask = array(case["inputs"]["completion_mask"])[..., 1:].astype(np.float32)
    reference = None if options["loss_type"] in REFERENCE_FREE else array(case["inputs"]["reference_log_probs"])

    def mean_loss(token_log_probs):
        # What DPOObjective.terms computes: target t's log-prob sits at position t.
        (losses, chosen, rejected), nll, _ = family_terms(
            token_log_probs[..., 1:], mask, reference, loss_type=options["loss_type"],
            settings=settings(options), cpo_alpha=options.get("cpo_alpha", 0.0))
        return losses.mean() + (0.0 if nll is None else nll), (losses, chosen, rejected)

    (value, (losses, chosen, rejected)), grad = jax.value_and_grad(mean_loss, has_aux=True)(
        jnp.asarray(array(case["inputs"]["token_log_probs"])))
    np.testing.assert_allclose(value, array(out["loss"]), rtol=1e-6, atol=6e-8)
    np.testing.assert_allclose(losses, array(out["pair_loss"]), rtol=1e-6, atol=6e-8)
    np.testing.assert_allclose(chosen, array(out["chosen_rewards"]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rejected, array(out["rejected_rewards"]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(chosen.mean()), out["metrics"]["rewards/chosen"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, array(out["grad_token_log_probs"]), rtol=1e-6, atol=6e-8)


@pytest.mark.parametrize("name", ["kto", "kto_clamped"])
def test_kto_matches_trl_loss_kl_baseline_rewards_and_gradients(name):
    case = CASES[name]
    inputs, options, out = case["inputs"], case["options"], case["outputs"]
    mask = array(inputs["completion_mask"])[:, 1:].astype(np.float32)
    kl_mask = array(inputs["kl_completion_mask"])[:, 1:].astype(np.float32)
    kl_tokens = array(inputs["kl_token_log_probs"])
    desirable = array(inputs["label"]) > 0

    def mean_loss(token_log_probs):
        baseline = kto_baseline((kl_tokens[:, 1:] * kl_mask).sum(-1), array(inputs["reference_kl_log_probs"]))
        losses, rewards = kto_loss((token_log_probs[:, 1:] * mask).sum(-1), array(inputs["reference_log_probs"]),
                                   desirable, baseline, beta=options["beta"],
                                   desirable_weight=options["desirable_weight"],
                                   undesirable_weight=options["undesirable_weight"])
        return losses.mean(), (baseline, rewards)

    (value, (baseline, rewards)), grad = jax.value_and_grad(mean_loss, has_aux=True)(
        jnp.asarray(array(inputs["token_log_probs"])))
    metrics = out["metrics"]
    np.testing.assert_allclose(value, array(out["loss"]), rtol=1e-6, atol=6e-8)
    np.testing.assert_allclose(baseline, metrics["kl"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(rewards[desirable].mean()), metrics["rewards/chosen"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(rewards[~desirable].mean()), metrics["rewards/rejected"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, array(out["grad_token_log_probs"]), rtol=1e-6, atol=6e-8)
    if name == "kto_clamped":  # the mismatched pairs' mean log-ratio is below 0: the baseline is 0
        assert float(baseline) == 0.0
    else:
        assert float(baseline) > 0.0


def scores(policy, reference, lengths=((2.0, 2.0),)):
    return PairScores(jnp.asarray(policy), None if reference is None else jnp.asarray(reference),
                      jnp.asarray(lengths))


@pytest.mark.parametrize(("loss_type", "expected"), [
    ("sigmoid", math.log(2)), ("ipo", (1 / (2 * 0.1)) ** 2), ("hinge", 1.0), ("robust", math.log(2))])
def test_a_policy_at_its_reference_has_each_losss_textbook_value(loss_type, expected):
    from dew_lib.objectives.preference_losses import PAIR_LOSSES

    out = PAIR_LOSSES[loss_type](scores([[-3.0, -5.0]], [[-3.0, -5.0]]), LossSettings(beta=0.1, label_smoothing=0.0))
    np.testing.assert_allclose(out.loss, [expected], rtol=1e-6)
    assert float(out.chosen_rewards[0]) == float(out.rejected_rewards[0]) == 0.0


def test_label_smoothing_gives_cdpo_and_unbiased_robust_losses():
    from dew_lib.objectives.preference_losses import robust, sigmoid

    pair = scores([[-1.0, -3.0]], [[-2.0, -2.0]])  # margin d = 1 - (-1) = 2, beta d = 0.2
    smooth = LossSettings(beta=0.1, label_smoothing=0.25)
    soft = -math.log(1 / (1 + math.exp(-0.2)))  # -log s(0.2)
    flipped = -math.log(1 / (1 + math.exp(0.2)))  # -log s(-0.2)
    np.testing.assert_allclose(sigmoid(pair, smooth).loss, [0.75 * soft + 0.25 * flipped], rtol=1e-6)
    np.testing.assert_allclose(robust(pair, smooth).loss, [(0.75 * soft - 0.25 * flipped) / 0.5], rtol=1e-6)


def test_simpo_and_orpo_read_mean_log_probs_and_no_reference():
    from dew_lib.objectives.preference_losses import orpo, simpo

    tie = scores([[-2.0, -4.0]], None, lengths=((2.0, 4.0),))  # both answers average -1 per token
    simpo_out = simpo(tie, LossSettings(beta=2.0, simpo_gamma=0.5))
    np.testing.assert_allclose(simpo_out.loss, [math.log1p(math.exp(0.5))], rtol=1e-6)  # -log s(-gamma)
    np.testing.assert_allclose(simpo_out.chosen_rewards, [-2.0])  # beta x mean log-prob
    orpo_out = orpo(tie, LossSettings(beta=0.1))
    np.testing.assert_allclose(orpo_out.loss, [0.1 * math.log(2)], rtol=1e-6)  # equal odds: log ratio 0
    # log(1 - exp(x)) on both sides of TRL's branch point, with finite gradients
    x = jnp.array([-3.0, -0.5, -1e-3])
    np.testing.assert_allclose(log1mexp(x), np.log(-np.expm1(np.array([-3.0, -0.5, -1e-3]))), rtol=1e-5)
    assert np.isfinite(np.asarray(jax.grad(lambda v: log1mexp(v).sum())(x))).all()


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_keep_no_reference_copy_and_learn(loss_type):
    objective = DPOObjective(MODEL, seq_len=3, beta=0.5, loss_type=loss_type)
    assert objective.ema_decay is None
    batch = pairs_batch()
    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(1))
    assert trainer.initial_state().ema is None
    start = jax.device_get(jax.jit(objective.init)(trainer.init_key))
    before = loss(objective, start, batch)[0]
    data = Dataset(train=lambda partition: itertools.repeat(batch), batch=8)
    state = trainer.fit(data, steps=6, log_every=3)
    assert state.ema is None and float(loss(objective, state.params, batch)[0]) < float(before)


def test_orpo_adds_the_chosen_nll_over_prompt_and_completion():
    objective = DPOObjective(MODEL, seq_len=3, beta=0.1, loss_type="orpo")
    variables = objective.init(jax.random.key(0))
    batch = pairs_batch()
    value, metrics = loss(objective, variables, batch)
    summed, log_probs, *_ = objective._scores(variables, batch)
    chosen = np.asarray(log_probs).reshape(8, 2, 3)[:, 0]  # the targets 1->p, p->3, 3->5: all real tokens
    np.testing.assert_allclose(metrics["nll"], -chosen.mean(), rtol=1e-6)
    np.testing.assert_allclose(value, metrics["dpo_loss"] + metrics["nll"], rtol=1e-6)


def unpaired_records():
    rows = [{"prompt": [1, 2], "completion": [3, 5], "label": True},
            {"prompt": [1, 6, 7], "completion": [4, 4, 5], "label": False},
            {"prompt": [1], "completion": [3, 3, 3, 5], "label": True},
            {"prompt": [1, 8], "completion": [4, 5], "label": False}]
    return tuple(json.dumps(row) for row in rows)


def test_unpaired_examples_load_trls_layout_with_mismatched_kl_rows():
    in_order = Loading(workers=0, threads=1, seed=None)
    spec = UnpairedExamples(records=unpaired_records(), seq_len=6, loading=in_order)
    batch = next(iter(spec.load(batch=4).train(Partition())))
    np.testing.assert_array_equal(batch["input_ids"], [[1, 2, 3, 5, 0, 0], [1, 6, 7, 4, 4, 5],
                                                       [1, 3, 3, 3, 5, 0], [1, 8, 4, 5, 0, 0]])
    np.testing.assert_array_equal(batch["completion_mask"], [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1],
                                                             [0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["label"], [1, 0, 1, 0])
    # row i: its own prompt, row i-1's completion (row 0 the last row's); cut at the row width
    np.testing.assert_array_equal(batch["kl_input_ids"], [[1, 2, 4, 5, 0, 0], [1, 6, 7, 3, 5, 0],
                                                          [1, 4, 4, 5, 0, 0], [1, 8, 3, 3, 3, 5]])
    np.testing.assert_array_equal(batch["kl_completion_mask"], [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0],
                                                                [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])


def test_unpaired_examples_refuse_bad_rows_naming_the_field():
    with pytest.raises(DataError, match="field 'label' is 'yes'"):
        UnpairedExamples(records=(json.dumps({"prompt": [1], "completion": [2], "label": "yes"}),),
                         seq_len=4, loading=LOADING).load(batch=1)
    with pytest.raises(DataError, match="hold 5 ids, more than seq_len=4"):
        UnpairedExamples(records=(json.dumps({"prompt": [1, 2], "completion": [3, 4, 5], "label": True}),),
                         seq_len=4, loading=LOADING).load(batch=1)


def test_pairs_become_a_desirable_chosen_and_an_undesirable_rejected_example():
    pairs = PreferencePairs(records=(json.dumps({"chosen": [1, 2, 3, 5], "rejected": [1, 2, 4, 5],
                                                 "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1]}),),
                            seq_len=4, loading=Loading(workers=0, threads=1, seed=None))
    batch = next(iter(UnpairedExamples.from_pairs(pairs).load(batch=2).train(Partition())))
    np.testing.assert_array_equal(batch["input_ids"], [[1, 2, 3, 5], [1, 2, 4, 5]])
    np.testing.assert_array_equal(batch["label"], [1, 0])
    np.testing.assert_array_equal(batch["kl_input_ids"], [[1, 2, 4, 5], [1, 2, 3, 5]])


def kto_batch():
    spec = UnpairedExamples(records=unpaired_records() * 2, seq_len=6, loading=LOADING)
    return next(iter(spec.load(batch=8).train(Partition())))


def test_kto_at_its_reference_weighs_each_side_half_way_up_the_sigmoid():
    objective = KTOObjective(MODEL, seq_len=5, beta=0.1, desirable_weight=1.0, undesirable_weight=1.5)
    variables = objective.init(jax.random.key(0))
    value, metrics = loss(objective, variables, kto_batch(), reference=variables)
    # r = 0 and z = 0: each example's loss is its weight x (1 - s(0)); half the rows are desirable
    np.testing.assert_allclose(value, (0.5 * 1.0 + 0.5 * 1.5) / 2, rtol=1e-6)
    assert float(metrics["kl"]) == 0.0 and float(metrics["desirable"]) == 0.5


def test_kto_training_raises_desirable_and_lowers_undesirable_rewards():
    batch = kto_batch()
    objective = KTOObjective(MODEL, seq_len=5, beta=0.5)
    objective.check_batch(batch)
    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(3))
    reference = jax.device_get(jax.jit(objective.init)(trainer.init_key))
    data = Dataset(train=lambda partition: itertools.repeat(batch), batch=8)
    state = trainer.fit(data, steps=10, log_every=5)
    _, metrics = loss(objective, state.params, batch, reference=reference)
    assert float(metrics["rewards/chosen"]) > 0 > float(metrics["rewards/rejected"])


def test_options_refuse_combinations_the_loss_cannot_read():
    for fields, message in [
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing=0.1 is read only by loss_type"),
        ({"loss_type": "orpo"}, "nll_weight=1.0 adds RPO's chosen NLL"),
        ({"loss_type": "hinge", "cpo_alpha": 1.0}, "cpo_alpha=1.0 weighs CPO's chosen NLL"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
        ({"loss_type": "dpop"}, "loss_type"),
    ]:
        with pytest.raises(ValueError, match=message):
            DPOOptions(**fields)
    with pytest.raises(ValueError, match="loss_type='kto' reads unpaired examples"):
        DPOObjective(MODEL, seq_len=3, loss_type="kto")


@pytest.mark.parametrize("loss_type", ["robust", "simpo", "kto"])
def test_build_dpo_reaches_each_loss_from_the_stage_options(loss_type):
    options = DPOOptions(steps=1, batch=8, loss_type=loss_type, nll_weight=0.0,
                         label_smoothing=0.1 if loss_type != "kto" else 0.0, desirable_weight=1.2)
    pairs = PreferencePairs(records=tuple(json.dumps({"chosen": [1, 2, 3, 5], "rejected": [1, 2, 4, 5],
                                                      "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1]})
                                          for _ in range(8)), seq_len=4, loading=LOADING)
    built = build_dpo(MODEL, None, pairs, options)
    batch = next(iter(built.dataset.train(Partition())))
    built.objective.check_batch(batch)
    if loss_type == "kto":
        assert isinstance(built.objective, KTOObjective) and built.objective.desirable_weight == 1.2
        assert batch["input_ids"].shape == (8, 4) and sorted(batch["label"].tolist()) == [0] * 4 + [1] * 4
    else:
        assert built.objective.loss_type == loss_type and built.objective.settings.label_smoothing == 0.1
        assert built.objective.ema_decay == (None if loss_type == "simpo" else 1.0)


def test_the_pipeline_s_dpo_stage_reads_the_family_and_keys_it_only_once_chosen():
    from tasks.manifests import keyed
    from tasks.params import PipelineParams

    params = PipelineParams.model_validate({"dpo": {"loss_type": "kto", "nll_weight": 0.0, "undesirable_weight": 1.5}})
    assert params.dpo.loss_type == "kto" and params.dpo.undesirable_weight == 1.5
    assert "loss_type" in keyed(params.dpo) and "undesirable_weight" in keyed(params.dpo)
    plain = keyed(PipelineParams().dpo)  # earlier runs' DPO stages keep their keys
    assert not {"loss_type", "label_smoothing", "simpo_gamma", "cpo_alpha", "desirable_weight",
                "undesirable_weight"} & plain.keys()
