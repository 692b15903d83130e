"""PPO with a critic: GAE, the clipped value loss and the composite loss against verl's own
(tests/fixtures/parity/ppo_verl.json, written by tools/parity_ppo.py), PPORollout's targets over
multi-turn square-tool episodes, and a short run that trains both the policy and the critic."""

import itertools
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_tool_episodes import SAMPLING, P, R, Square, T, counts, tasks, trained_policy, verify  # noqa: F401

from dew_lib import Dataset, Trainer, models
from dew_lib.objectives import PPOObjective, ValueHead, algorithms, split_optimizer
from dew_lib.objectives.batch import PackedBatch
from dew_lib.rollouts import EpisodeRollout, PPORollout

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "parity" / "ppo_verl.json").read_text())


def array(entry):
    return np.asarray(entry["data"], dtype=entry["dtype"]).reshape(entry["shape"])


INPUTS = {name: array(entry) for name, entry in FIXTURE["inputs"].items()}
CASES = {case["name"]: case for case in FIXTURE["cases"]}
MASK = INPUTS["response_mask"].astype(np.float32)


def test_the_fixture_names_its_reference():
    reference = FIXTURE["reference"]
    assert reference["package"] == "verl" and reference["version"] == "0.9.1"
    assert "verl.trainer.ppo.core_algos.compute_gae_advantage_return" in reference["functions"]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["kind"] == "gae"])
def test_gae_over_multi_turn_rows_matches_verl(name):
    case = CASES[name]
    advantages, returns = algorithms.gae(INPUTS["token_level_rewards"], INPUTS["values"], MASK,
                                         case["options"]["gamma"], case["options"]["lam"])
    np.testing.assert_allclose(algorithms.masked_whiten(advantages, MASK), array(case["outputs"]["advantages"]),
                               atol=3e-7)
    np.testing.assert_allclose(returns, array(case["outputs"]["returns"]), atol=1e-7)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["kind"] == "value_loss"])
def test_the_clipped_value_loss_matches_verl_under_both_reductions(name):
    case = CASES[name]
    options = case["options"]
    _, returns = algorithms.gae(INPUTS["token_level_rewards"], INPUTS["values"], MASK, 1.0, 0.95)
    rows = np.where(MASK > 0, np.arange(MASK.shape[0])[:, None], -1)  # each token's session
    aggregate = algorithms.AGGREGATIONS["token-mean" if options["loss_agg_mode"] == "token-mean" else "session-mean"]

    def loss(predictions):
        values, clipped = algorithms.clipped_value_loss(predictions, returns, INPUTS["values"],
                                                        options["cliprange_value"])
        total, normalizer = aggregate(values, MASK, rows)
        return total / normalizer, clipped

    (value, clipped), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(INPUTS["vpreds"]))
    np.testing.assert_allclose(value, array(case["outputs"]["vf_loss"]), rtol=1e-6)
    assert float((clipped * MASK).sum() / MASK.sum()) == pytest.approx(float(array(case["outputs"]["vf_clipfrac"])))
    np.testing.assert_allclose(grad, array(case["outputs"]["grad_vpreds"]), atol=1e-8)


class Table(nn.Module):
    """A 'model' whose scores are its parameters: the policy's log-probabilities of the sampled
    ids (through the decoders' hidden/target_scores seam), or the critic's values."""

    table: np.ndarray
    vocab_size: int = 2

    def setup(self):
        self.values = self.param("table", lambda key: jnp.asarray(self.table))

    def hidden(self, tokens, segment_ids=None, positions=None):
        return self.values

    def target_scores(self, hidden, targets, temperature=1.0):
        return hidden, jnp.zeros(hidden.shape, bool)

    def __call__(self, tokens, segment_ids=None, positions=None):
        return self.values


def fixture_batch(source):
    """verl's [rows, length] tensors, with the advantages and returns of its GAE case `source`,
    as packed rows of width length + 1 (column 0: no target)."""
    advantages, returns = (array(CASES[source]["outputs"][name]) for name in ("advantages", "returns"))
    rows, length = MASK.shape

    def packed(values, dtype=np.float32):
        return np.pad(np.asarray(values, dtype), ((0, 0), (1, 0)))

    return PackedBatch(
        input_ids=np.zeros((rows, length + 1), np.int32), text_segment_ids=np.ones((rows, length + 1), np.int32),
        text_positions=np.tile(np.arange(length + 1, dtype=np.int32), (rows, 1)),
        response_mask=packed(MASK, np.int32), behavior_log_probs=packed(INPUTS["old_log_prob"] * MASK),
        old_log_probs=packed(INPUTS["old_log_prob"]), advantages=packed(advantages * MASK),
        session_index=np.repeat(np.arange(rows, dtype=np.int32)[:, None], length + 1, axis=1),
        old_values=packed(INPUTS["values"]), returns=packed(returns))


def composite(name, **changes):
    """The loss and gradients PPOObjective gives on a composite case's tensors."""
    case = CASES[name]
    options = case["options"]
    settings = dict(critic=Table(INPUTS["vpreds"]), beta=options["kl_coef"],
                    value_coefficient=options["vf_coef"], value_clip=options["cliprange_value"],
                    epsilon_low=options["clip_ratio_low"], epsilon_high=options["clip_ratio_high"],
                    dual_clip=options["clip_ratio_c"])
    objective = PPOObjective(Table(INPUTS["log_prob"]), MASK.shape[1], **{**settings, **changes})
    variables = objective.init(jax.random.key(0))
    reference = {"params": {"table": jnp.asarray(INPUTS["ref_log_prob"])}}
    batch = fixture_batch(options["advantages_from"])
    objective.check_batch(batch)

    def loss(params):
        terms = objective.terms(params, batch, step=0, reference=reference, key=None)
        return terms.total / terms.weight

    value, grads = jax.value_and_grad(loss)(variables)
    return case, value, grads


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["kind"] == "composite"])
def test_the_composite_loss_and_its_gradients_match_verl(name):
    case, value, grads = composite(name)
    outputs = {key: array(entry) for key, entry in case["outputs"].items()}
    np.testing.assert_allclose(value, outputs["loss"], atol=1e-7)
    np.testing.assert_allclose(grads["policy"]["params"]["table"], outputs["grad_log_prob"], atol=2e-8)
    np.testing.assert_allclose(grads["critic"]["params"]["table"], outputs["grad_vpreds"], atol=2e-8)


@pytest.mark.parametrize("change", [dict(value_coefficient=0.0), dict(beta=0.0),
                                    dict(epsilon_low=0.99, epsilon_high=1e6, dual_clip=None)],
                         ids=["no-critic", "no-kl", "no-clipping"])
def test_leaving_out_any_term_breaks_the_comparison(change):
    case, value, grads = composite("composite_gae_1.0_0.95", **change)
    outputs = {key: array(entry) for key, entry in case["outputs"].items()}
    matches = (np.allclose(value, outputs["loss"], atol=1e-7)
               and np.allclose(grads["policy"]["params"]["table"], outputs["grad_log_prob"], atol=2e-8)
               and np.allclose(grads["critic"]["params"]["table"], outputs["grad_vpreds"], atol=2e-8))
    assert not matches


# ----- episodes ------------------------------------------------------------------------------------

POLICY = models.build("causal_transformer", vocab_size=16, emb_features=32, num_layers=2, num_heads=4,
                      mlp_features=64, max_seq_len=16)
CRITIC = ValueHead(models.build("causal_transformer", vocab_size=16, emb_features=16, num_layers=1,
                                num_heads=2, mlp_features=32, max_seq_len=16))


@pytest.fixture(scope="module")
def protocol():
    return trained_policy(300)


def ppo(protocol, **options):
    objective = PPOObjective(POLICY, seq_len=P + R - 1, critic=CRITIC, pretrained=protocol, beta=0.03)
    episodes = EpisodeRollout(objective.policy(), Square, verify, max_prompt_tokens=P, max_new_tokens=R,
                              max_turns=T, groups=4, sampling=SAMPLING)
    return objective, PPORollout(objective, episodes, **options)


def reference_gae(rewards, values, gamma, lam):
    advantages, running = np.zeros(len(values)), 0.0
    for t in reversed(range(len(values))):
        following = values[t + 1] if t + 1 < len(values) else 0.0
        running = rewards[t] + gamma * following - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


def test_gae_runs_over_each_episodes_sampled_ids_in_draw_order_across_turns(protocol):
    objective, rollout = ppo(protocol, gamma=0.9, lam=0.8)
    variables = objective.init(jax.random.key(1))
    results = rollout.episodes.collect(variables, tasks(1, 2, 3), jax.random.key(4))
    from dew_lib.rollouts import project

    packed = project(results, width=P + R, rows=rollout.episodes.rows(3))
    prepared = rollout.prepare(variables, packed, episodes=len(results))
    mask = np.asarray(prepared["response_mask"]) > 0
    raw, everything = {}, []
    for n, result in enumerate(results):
        if result.episode.status.value != "completed":
            assert not mask[np.asarray(prepared["session_index"]) == n].any()  # truncated: masked
            continue
        spots = [tuple(s) for s in np.argwhere(mask & (np.asarray(prepared["session_index"]) == n))]
        spots.sort(key=lambda s: (prepared["call_index"][s], s))
        assert [int(prepared["input_ids"][s]) for s in spots] == \
               [i for t in result.episode.transitions for i in t.action.tokens.tolist()]
        values = np.array([prepared["old_values"][s] for s in spots])
        rewards = np.zeros(len(spots))
        rewards[-1] = result.session.reward
        raw[n] = (spots, reference_gae(rewards, values, 0.9, 0.8), values)
        everything += list(raw[n][1])
    assert any(len(r.episode.transitions) > 1 for r in results if r.episode.status.value == "completed")
    mean, std = np.mean(everything), np.std(everything, ddof=1)
    for spots, advantages, values in raw.values():
        got = np.array([prepared["advantages"][s] for s in spots])
        np.testing.assert_allclose(got, (advantages - mean) / np.sqrt(std ** 2 + 1e-8), atol=2e-5)
        np.testing.assert_allclose([prepared["returns"][s] for s in spots], advantages + values, atol=2e-5)
    assert not np.asarray(prepared["advantages"])[~mask].any()


def test_one_trainable_id_is_refused_and_none_gives_zero_targets(protocol):
    objective, rollout = ppo(protocol)
    variables = objective.init(jax.random.key(1))
    rows = dict(input_ids=np.zeros((2, P + R), np.int32), text_segment_ids=np.ones((2, P + R), np.int32),
                text_positions=np.tile(np.arange(P + R, dtype=np.int32), (2, 1)),
                behavior_log_probs=np.zeros((2, P + R), np.float32), advantages=np.zeros((2, P + R), np.float32),
                session_index=np.zeros((2, P + R), np.int32), call_index=np.zeros((2, P + R), np.int32),
                rewards=np.ones((2, P + R), np.float32), old_log_probs=np.zeros((2, P + R), np.float32))
    single = np.zeros((2, P + R), np.int32)
    single[0, 3] = 1
    with pytest.raises(ValueError, match="exactly one"):
        rollout.prepare(variables, PackedBatch.of({**rows, "response_mask": single}), episodes=1)
    empty = rollout.prepare(variables, PackedBatch.of({**rows, "response_mask": np.zeros_like(single)}), episodes=1)
    assert not any(np.asarray(empty[name]).any() for name in ("advantages", "returns", "old_values"))


def test_a_short_run_trains_policy_and_critic_and_keeps_the_reference(protocol):
    objective, rollout = ppo(protocol)
    data = Dataset(train=lambda part: itertools.repeat(tasks(*range(6))), batch=6)
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), rollout=rollout)
    start = trainer.initial_state()
    probe = rollout(start, tasks(*range(6)), jax.random.key(11))

    def critic_error(params):
        values = np.asarray(objective.packed_values(params["critic"], probe))
        mask = np.asarray(probe["response_mask"]) > 0
        return float(np.mean((values[mask] - np.asarray(probe["returns"])[mask]) ** 2))

    state = trainer.fit(data, steps=2, log_every=1)
    assert int(state.updates) == 2
    for part in ("policy", "critic"):
        moved = jax.tree.map(lambda a, b: not np.allclose(a, b), start.params[part], state.params[part])
        assert any(jax.tree.leaves(moved)), part
    same = jax.tree.map(np.array_equal, jax.device_get(state.ema), jax.device_get(start.params["policy"]))
    assert all(jax.tree.leaves(same))  # the reference is the starting policy, and only the policy
    assert critic_error(state.params) < critic_error(start.params)


def test_split_optimizer_gives_the_critic_its_own_rate(protocol):
    """A frozen policy (rate 0) beside Adam on the critic: the critic moves exactly as under one
    Adam for the whole tree (Adam is elementwise), and the policy not at all."""
    objective, rollout = ppo(protocol)
    data = Dataset(train=lambda part: itertools.repeat(tasks(*range(4))), batch=4)

    def one_step(optimizer):
        return Trainer(objective, optimizer, key=jax.random.key(0), rollout=rollout).fit(data, steps=1)

    start = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0), rollout=rollout).initial_state()
    split = one_step(split_optimizer(optax.sgd(0.0), optax.adam(3e-3)))
    joint = one_step(optax.adam(3e-3))
    same = jax.tree.map(np.array_equal, jax.device_get(split.params["policy"]), jax.device_get(start.params["policy"]))
    assert all(jax.tree.leaves(same))
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), split.params["critic"], start.params["critic"])
    assert any(jax.tree.leaves(moved))
    for a, b in zip(jax.tree.leaves(split.params["critic"]), jax.tree.leaves(joint.params["critic"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)


def test_the_metrics_report_the_critic(protocol):
    from dew_lib.train.sinks import MemorySink

    objective, rollout = ppo(protocol)
    data = Dataset(train=lambda part: itertools.repeat(tasks(*range(4))), batch=4)
    log = MemorySink()
    Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=rollout).fit(
        data, steps=1, log_every=1, sinks=[log])
    metrics = log.history[-1][1]
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "kl", "pg_loss"} <= set(metrics)
    assert metrics["critic/vf_explained_var"] <= 1.0


def test_bad_settings_are_refused_naming_the_field(protocol):
    with pytest.raises(ValueError, match="behavior_importance"):
        PPOObjective(POLICY, seq_len=P + R - 1, critic=CRITIC, behavior_importance=(0.5, 2.0))
    with pytest.raises(ValueError, match="value_clip"):
        PPOObjective(POLICY, seq_len=P + R - 1, critic=CRITIC, value_clip=0.0)
    objective = PPOObjective(POLICY, seq_len=P + R, critic=CRITIC)
    episodes = EpisodeRollout(objective.policy(), Square, verify, max_prompt_tokens=P, max_new_tokens=R,
                              max_turns=T, groups=4, sampling=SAMPLING)
    with pytest.raises(ValueError, match="seq_len"):
        PPORollout(objective, episodes)
    with pytest.raises(KeyError, match="PPORollout"):
        PPOObjective(Table(INPUTS["log_prob"]), MASK.shape[1], critic=Table(INPUTS["vpreds"])).check_batch(
            {k: v for k, v in fixture_batch("gae_1.0_0.95").items() if k != "returns"})


def test_two_epochs_train_the_same_collection_twice_as_a_kept_batch_would(protocol):
    data = Dataset(train=lambda part: itertools.repeat(tasks(*range(4))), batch=4)

    def fit(rollout):
        objective = rollout.objective
        return Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=rollout).fit(data, steps=2)

    objective, once = ppo(protocol)
    kept = []

    def keep(state, batch, key):  # collect at the first step, train the same rows at the second
        if not kept:
            kept.append(once(state, batch, key))
        return kept[0]

    keep.objective = objective
    by_hand = fit(keep)
    _, twice = ppo(protocol, epochs=2)
    calls = []
    collect = twice.collect
    twice.collect = lambda *args: calls.append(1) or collect(*args)
    for a, b in zip(jax.tree.leaves(by_hand.params), jax.tree.leaves(fit(twice).params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(calls) == 1


def test_minibatches_split_each_epoch_into_equal_slices_of_the_collection(protocol):
    objective, rollout = ppo(protocol, epochs=2, minibatches=2)
    state = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=rollout).initial_state()
    prepared = rollout.collect(state, tasks(1, 2), jax.random.key(3))
    slices = rollout.slices(prepared, jax.random.key(3))
    assert len(slices) == 4 and {np.shape(s["input_ids"])[0] for s in slices} == {rollout.episodes.rows(2) // 2}
    for epoch in (slices[:2], slices[2:]):  # each epoch holds every row once, targets unchanged
        rows = np.concatenate([np.asarray(s["input_ids"]) for s in epoch])
        returns = np.concatenate([np.asarray(s["returns"]) for s in epoch])
        order = np.lexsort(rows.T[::-1])
        expected = np.lexsort(np.asarray(prepared["input_ids"]).T[::-1])
        np.testing.assert_array_equal(rows[order], np.asarray(prepared["input_ids"])[expected])
        assert np.isclose(returns.sum(), np.asarray(prepared["returns"]).sum())
    with pytest.raises(ValueError, match="minibatches"):
        ppo(protocol, minibatches=5)[1].collect(state, tasks(1, 2), jax.random.key(3))
