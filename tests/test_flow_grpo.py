"""Flow-GRPO: the spec's offline example, the rollout layout, the loss, learning and bad input.

Most tests share the spec example's model and shapes so their programs compile once per session.
"""

import itertools
import math

import jax
import numpy as np
import optax
import pytest

from dew_lib import Field, InputSpec, Trainer, models, presets
from dew_lib.data import Dataset
from dew_lib.diffusion import CFG, BagOfTokens, FlowGRPOObjective, FlowRollout, FlowSDE, WordTokenizer, group_statistics
from dew_lib.train.sinks import MemorySink

SPEC_EXAMPLE = '''
import itertools
import jax
import numpy as np
import optax
from dew_lib import Field, InputSpec, Trainer, models, presets
from dew_lib.data import Dataset
from dew_lib.diffusion import FlowGRPOObjective, FlowRollout

inputs = InputSpec(Field("image", (4, 4, 1)))
model = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8,
                         num_layers=1, num_heads=2, mlp_ratio=2)
objective = FlowGRPOObjective(model, presets.Flow()(), inputs,
                              guidance=None, beta=0.01, steps=5)

def brightness(images, batch):
    return images.mean(axis=(1, 2, 3))

rollout = FlowRollout(objective, brightness, groups=4, steps=5, train_steps=2)
batch = {"image": np.zeros((2, 4, 4, 1), dtype=np.uint8)}
data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=2, batch=2)
trainer = Trainer(objective, optax.adam(1e-3), key=jax.random.key(0), rollout=rollout)
state = trainer.fit(data, steps=2, log_every=1)
print(int(state.updates))
'''

INPUTS = InputSpec(Field("image", (4, 4, 1)))
MODEL = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8, num_layers=1, num_heads=2,
                         mlp_ratio=2)
SOURCE = {"image": np.zeros((2, 4, 4, 1), np.uint8)}


def brightness(images, batch):
    return images.mean(axis=(1, 2, 3))


def objective(**options):
    options = {"guidance": None, "steps": 5, **options}
    return FlowGRPOObjective(MODEL, presets.Flow()(), INPUTS, **options)


def state_for(obj, seed=0):
    return Trainer(obj, optax.adam(1e-3), key=jax.random.key(seed)).initial_state()


def test_spec_offline_example_runs_unchanged_and_prints_two(capsys):
    exec(compile(SPEC_EXAMPLE, "spec_example", "exec"), {"__name__": "spec_example"})
    assert capsys.readouterr().out.strip().splitlines()[-1] == "2"


def test_rollout_returns_groups_of_the_first_train_steps_transitions():
    obj = objective(beta=0.01)
    records = []
    rollout = FlowRollout(obj, brightness, groups=4, steps=5, train_steps=2, records=records.append)
    state = state_for(obj)
    batch = rollout(state, SOURCE, jax.random.key(1))
    obj.check_batch(batch)
    assert batch["latents"].shape == batch["next_latents"].shape == (8, 2, 4, 4, 1)
    np.testing.assert_array_equal(batch["timesteps"], np.tile([1.0, 0.75], (8, 1)))
    np.testing.assert_array_equal(batch["next_timesteps"], np.tile([0.75, 0.5], (8, 1)))
    np.testing.assert_array_equal(batch["latents"][:, 1], batch["next_latents"][:, 0])
    assert batch["rewards"].dtype == np.float64 and batch["advantages"].dtype == np.float32
    # advantages are (reward - group mean) / (population std + 1e-4) over contiguous groups of 4
    rewards = batch["rewards"].reshape(2, 4)
    expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(batch["advantages"], expected.reshape(-1).astype(np.float32))
    assert batch["transition_mask"].all()
    # the recorded densities are what the objective rescores with the same parameters
    np.testing.assert_allclose(obj.log_probs(state.params, batch), batch["old_log_probs"], rtol=1e-4, atol=1e-3)
    # the host record carries every sample's reward and its group statistics
    (record,) = records
    assert record is rollout.last and record.step == 0
    np.testing.assert_array_equal(record.group, [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(record.rewards, batch["rewards"])
    np.testing.assert_allclose(record.group_mean, np.repeat(rewards.mean(1), 4))
    np.testing.assert_allclose(record.group_std, np.repeat(rewards.std(1), 4))
    assert record.rows()[5]["group"] == 1 and record.rows()[5]["reward"] == batch["rewards"][5]
    np.testing.assert_allclose(record.images.mean(axis=(1, 2, 3)), record.rewards, rtol=1e-6)
    assert record.preview().png().startswith(b"\x89PNG")


def test_at_the_rollout_parameters_the_loss_is_minus_the_mean_advantage():
    # ratio == 1 at the sampling parameters, so each kept transition contributes -advantage and the
    # KL to an identical reference is 0.
    obj = objective(beta=0.5, adv_clip_max=0.8)
    state = state_for(obj)
    batch = FlowRollout(obj, brightness, groups=4, steps=5)(state, SOURCE, jax.random.key(2))
    mean_loss, aux = jax.jit(lambda p, b: obj.loss(p, b, 0, reference=p))(state.params, batch)
    clipped = np.clip(batch["advantages"], -0.8, 0.8)
    assert float(aux["kept_transitions"]) == 8 * 4
    np.testing.assert_allclose(mean_loss, -clipped.mean(), atol=1e-4)
    assert float(aux["kl"]) == 0 and float(aux["clipfrac"]) == 0
    np.testing.assert_allclose(aux["ratio"], 1.0, atol=1e-5)


def test_the_ratio_is_clipped_below_at_clip_range_and_above_at_clip_range_high():
    symmetric, wider = objective(clip_range=0.2, adv_clip_max=10.0), objective(
        clip_range=0.2, clip_range_high=0.7, adv_clip_max=10.0)
    state = state_for(symmetric)
    batch = FlowRollout(symmetric, brightness, groups=4, steps=5)(state, SOURCE, jax.random.key(2))
    # Recorded densities lowered by log 1.5 per coordinate: every kept ratio is 1.5.
    coordinates = 4 * 4 * 1
    batch = {**batch, "old_log_probs": batch["old_log_probs"] - coordinates * np.log(1.5)}
    advantages = batch["advantages"]
    for obj, bounded, clipfrac in ((symmetric, 1.2, 1.0), (wider, 1.5, 0.0)):
        loss, aux = jax.jit(lambda p, b, obj=obj: obj.loss(p, b, 0, reference=p))(state.params, batch)
        # max(-A r, -A clip(r)): a positive advantage takes the bound, a negative one the ratio.
        expected = np.where(advantages > 0, -advantages * bounded, -advantages * 1.5).mean()
        # the mean of terms near +-1.5 that cancel to about 0: float32 rounding of the terms' size
        np.testing.assert_allclose(loss, expected, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(aux["clipfrac"], clipfrac)
        np.testing.assert_allclose(aux["ratio"], 1.5, rtol=1e-4)


def test_zero_advantage_groups_and_deterministic_intervals_never_enter_the_loss():
    sde = FlowSDE(noise_level=0.7, window=(0.5, 1.0))  # times 1, .75, .5, .25, 0: two stochastic
    obj = objective(sde=sde)
    state = state_for(obj)

    def first_group_flat(images, batch):
        return np.concatenate([np.full(4, 0.5), images[4:].mean(axis=(1, 2, 3))])

    batch = FlowRollout(obj, first_group_flat, groups=4, steps=5)(state, SOURCE, jax.random.key(3))
    np.testing.assert_array_equal(batch["advantages"][:4], 0)
    mask = batch["transition_mask"]
    assert not mask[:4].any() and mask[4:, :2].all() and not mask[:, 2:].any()
    assert np.all(batch["old_log_probs"][:, 2:] == 0)

    @jax.jit
    def total_weight_and_grads(params, batch):
        def total(p):
            terms = obj.terms(p, batch, step=0, reference=None, key=None)
            return terms.total, terms.weight
        return jax.value_and_grad(total, has_aux=True)(params)

    (total, weight), _ = total_weight_and_grads(state.params, batch)
    assert float(weight) == 4 * 2
    moved = dict(batch, next_latents=batch["next_latents"].copy())
    moved["next_latents"][:, 2:] += 5.0  # deterministic transitions
    moved["next_latents"][:4] += 5.0  # zero-advantage rows
    (again, _), grads = total_weight_and_grads(state.params, moved)
    np.testing.assert_allclose(float(again), float(total), rtol=1e-6)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_rewards_stay_float64_through_the_group_statistics():
    # Differences of 1e-9 vanish in float32 (1 + 1e-9 == 1) but set the ranking in float64.
    rewards = 1.0 + np.array([0.0, 1e-9, 2e-9, 3e-9, 5.0, 5.0, 5.0, 5.0])
    _, _, advantages = group_statistics(rewards, 4)
    assert np.all(np.diff(advantages[:4]) > 0) and np.all(advantages[4:] == 0)
    _, _, narrowed = group_statistics(rewards.astype(np.float32), 4)
    assert np.all(narrowed[:4] == 0)  # what an early float32 conversion loses


@pytest.mark.slow
def test_brightness_reward_rises_over_a_few_dozen_updates():
    inputs = InputSpec(Field("image", (4, 4, 1)))
    model = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=16, num_layers=1, num_heads=2,
                             mlp_ratio=2)
    obj = FlowGRPOObjective(model, presets.Flow()(), inputs, guidance=None, steps=6)
    means = []
    rollout = FlowRollout(obj, brightness, groups=4, steps=6, records=lambda r: means.append(r.rewards.mean()))
    source = {"image": np.zeros((4, 4, 4, 1), np.uint8)}
    data = Dataset(train=lambda partition: itertools.repeat(source), val=lambda partition: [source], batch=4)
    trainer = Trainer(obj, optax.adam(3e-3), key=jax.random.key(0), rollout=rollout)
    before = obj.preview(trainer.initial_state().params, source, scored=brightness)
    sink = MemorySink()
    state = trainer.fit(data, steps=30, log_every=10, eval_every=30, sinks=[sink])
    assert int(state.updates) == 30 and state.ema is None  # beta = 0 keeps no reference
    early, late = np.mean(means[:5]), np.mean(means[-5:])
    assert late > early + 0.2, means
    after = obj.preview(state.params, source, scored=brightness)
    assert after.scores.mean() > before.scores.mean() + 0.2  # the deterministic sampler brightens too
    assert sink.series("val/sample_mean")[-1][1] == pytest.approx(after.images.mean(), abs=1e-5)


def test_beta_freezes_the_starting_policy_in_the_ema_slot():
    obj = objective(beta=0.1)
    assert obj.ema_decay == 1.0 and objective().ema_decay is None
    rollout = FlowRollout(obj, brightness, groups=4, steps=5, train_steps=2)
    data = Dataset(train=lambda partition: itertools.repeat(SOURCE), batch=2)
    trainer = Trainer(obj, optax.adam(1e-2), key=jax.random.key(0), rollout=rollout)
    start = trainer.initial_state()
    sink = MemorySink()
    state = trainer.fit(data, steps=3, log_every=1, sinks=[sink])
    for frozen, initial in zip(jax.tree.leaves(state.ema), jax.tree.leaves(start.params)):
        np.testing.assert_array_equal(frozen, initial)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(start.params)))
    kl = [v for _, v in sink.series("kl")]
    assert kl[0] == 0 and kl[-1] > 0


def test_conditioned_rollout_with_guidance_and_prompt_only_batches():
    words = WordTokenizer(("bright", "dark"), length=1)
    inputs = InputSpec(Field("image", (4, 4, 1)),
                       Field("prompt", (1,), encoder=BagOfTokens(words.vocab_size), tokenizer=words))
    obj = FlowGRPOObjective(MODEL, presets.Flow()(), inputs, guidance=CFG(2.0), steps=3)
    prompts = inputs.tokenize(["bright", "dark"])
    seen = []

    def follow_prompt(images, batch):
        seen.append(batch["prompt"][:, 0].tolist())
        sign = np.where(batch["prompt"][:, 0] == 1, 1.0, -1.0)
        return sign * images.mean(axis=(1, 2, 3))

    state = Trainer(obj, optax.adam(1e-3), key=jax.random.key(0)).initial_state()
    batch = FlowRollout(obj, follow_prompt, groups=2, steps=3)(state, prompts, jax.random.key(4))
    assert seen == [[1, 1, 2, 2]] and batch["prompt"].shape == (4, 1)
    obj.check_batch(batch)
    terms = jax.jit(lambda p, b: obj.terms(p, b, step=0, reference=None, key=None))(state.params, batch)
    assert np.isfinite(float(terms.total))
    preview = obj.preview(state.params, prompts, scored=follow_prompt)
    assert preview.captions == ("bright", "dark") and preview.labels()[0].startswith("bright | reward ")
    metrics = jax.jit(obj.evaluate)(state.params, prompts)
    assert float(metrics["sample_mean"][1]) == 2 * 16


# ----- bad input --------------------------------------------------------------------------------
def test_a_process_without_velocity_prediction_is_refused():
    with pytest.raises(ValueError, match="velocity prediction, got prediction='noise'"):
        FlowGRPOObjective(MODEL, presets.Flow(prediction="noise")(), INPUTS, guidance=None)


def test_guidance_without_a_condition_is_refused():
    with pytest.raises(ValueError, match="pass guidance=None"):
        FlowGRPOObjective(MODEL, presets.Flow()(), INPUTS)  # the default CFG(3.0)


@pytest.mark.parametrize("options,message", [
    (dict(groups=1), r"groups must be an integer >= 2.*got 1"),
    (dict(steps=5, train_steps=5), r"train_steps=5 must be between 1 and the 4 transitions that steps=5"),
    (dict(steps=5, train_steps=0), r"train_steps=0"),
    (dict(steps=1), r"steps counts time points"),
])
def test_rollout_options_are_refused_with_the_value(options, message):
    with pytest.raises(ValueError, match=message):
        FlowRollout(objective(), brightness, **options)


def test_train_steps_that_select_no_stochastic_transition_are_refused():
    obj = objective(sde=FlowSDE(window=(0.0, 0.5)))  # times 1, .75, .5, ...: the first two are ODE
    with pytest.raises(ValueError, match="none of the first 2 transitions"):
        FlowRollout(obj, brightness, steps=5, train_steps=2)


@pytest.mark.parametrize("reward,message", [
    (lambda images, batch: images.mean(axis=(1, 2)), r"shape \(8, 1\).*one scalar per sample, shape \(8,\)"),
    (lambda images, batch: images.mean(), r"shape \(\).*shape \(8,\)"),
    (lambda images, batch: np.where(np.arange(8) == 3, np.nan, 0.0), r"non-finite values \[nan\] at samples \[3\]"),
    (lambda images, batch: np.full(8, np.inf), r"non-finite"),
])
def test_a_reward_of_the_wrong_shape_or_not_finite_is_refused(reward, message):
    obj = objective()
    rollout = FlowRollout(obj, reward, groups=4, steps=5)
    with pytest.raises(ValueError, match=message):
        rollout(state_for(obj), SOURCE, jax.random.key(0))


def test_a_batch_whose_image_field_does_not_match_the_input_spec_is_refused():
    obj = objective()
    rollout = FlowRollout(obj, brightness, groups=4, steps=5)
    with pytest.raises(ValueError, match=r"'image' has shape \(2, 8, 8, 1\), but the InputSpec expects \(2, 4, 4, 1\)"):
        rollout(state_for(obj), {"image": np.zeros((2, 8, 8, 1), np.uint8)}, jax.random.key(0))
    with pytest.raises(ValueError, match=r"'latents' has shape \(8, 2, 8, 8, 1\), expected \[N, K, \*\(4, 4, 1\)\]"):
        obj.check_batch({"latents": np.zeros((8, 2, 8, 8, 1)), "next_latents": 0, "timesteps": 0,
                         "next_timesteps": 0, "old_log_probs": 0, "transition_mask": 0, "advantages": 0})


def test_coordinates_and_held_variables():
    obj = objective()
    assert obj.coordinates == math.prod((4, 4, 1))
    with pytest.raises(ValueError, match="without pretrained"):
        obj.held_variables()
    variables = obj.init(jax.random.key(0))
    held = objective(pretrained=variables)
    for a, b in zip(jax.tree.leaves(held.held_variables()), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(held.init(jax.random.key(5))), jax.tree.leaves(variables)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_toy_command_writes_both_preview_grids(tmp_path):
    from dew_lib.diffusion import toy

    result = toy.run(str(tmp_path), pretrain_steps=2, grpo_steps=2, width=8, layers=1)
    assert len(result["reward_curve"]) == 2
    for path in result["paths"].values():
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
