"""Parity with the released Flow-GRPO code on fixed tensors (fixture from tools/parity_flow.py).

Where Dew differs on purpose, the test states the exact relation instead of equality:
- Dew keeps joint log densities (summed over coordinates); the released step returns their mean
  per coordinate, so Dew's value divided by the coordinate count must match. Ratios are the same.
- Dew's KL is the conditional Gaussian KL with the transition's own variance (elapsed time
  included); the released SD3 trainer divides by the diffusion coefficient squared only, so its
  regularizer equals Dew's KL times the elapsed time `t - t_next`.
- Group statistics run in float64 in both; Dew keeps callback rewards float64 (the released
  trainer converted scores to float32 first), so the fixture's float64 rewards match exactly.
"""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dew_lib.diffusion import FlowSDE, gaussian_log_density, group_statistics, presets, transition_kl

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "flow", "flow_grpo_sde.json")
REFERENCE = json.load(open(FIXTURE, encoding="utf-8"))
CASES = REFERENCE["cases"]


def f32(values):
    return jnp.asarray(np.asarray(values, np.float32))


def test_fixture_names_the_reference_and_its_revision():
    assert REFERENCE["repository"] == "yifan123/flow_grpo"
    assert len(REFERENCE["revision"]) == 40
    assert set(REFERENCE["files"]) == {"flow_grpo/diffusers_patch/sd3_sde_with_logprob.py",
                                       "flow_grpo/stat_tracking.py"}


@pytest.mark.parametrize("case", CASES, ids=[f"steps{c['steps']}-shift{c['shift']}" for c in CASES])
def test_time_grid_matches_the_recorded_schedule(case):
    times = presets.Flow(shift=case["shift"])().times(case["steps"])
    np.testing.assert_array_equal(np.asarray(times), np.asarray(case["times"], np.float32))


def _transitions():
    for case in CASES:
        for j, step in enumerate(case["transitions"]):
            yield pytest.param(case["noise_level"], step, id=f"steps{case['steps']}-shift{case['shift']}-t{j}")


@pytest.mark.parametrize("noise_level,step", list(_transitions()))
def test_transition_mean_std_log_density_and_kl_match_the_released_step(noise_level, step):
    x, v, v_ref, drawn = (f32(step[k]) for k in ("x", "v", "v_ref", "next"))
    rows = x.shape[0]
    t, t_next = jnp.full((rows,), step["t"]), jnp.full((rows,), step["t_next"])
    sde = FlowSDE(noise_level=noise_level)
    mean, std = sde.transition(x, v, t, t_next)
    mean_ref, _ = sde.transition(x, v_ref, t, t_next)

    np.testing.assert_allclose(mean, np.asarray(step["mean"], np.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mean_ref, np.asarray(step["mean_ref"], np.float32), rtol=1e-6, atol=1e-6)
    released_std = np.asarray(step["std_dev_t"], np.float32) * np.asarray(step["sqrt_dt"], np.float32)
    np.testing.assert_allclose(np.asarray(std).reshape(-1), released_std, rtol=1e-6)

    coordinates = math.prod(x.shape[1:])
    joint = gaussian_log_density(drawn, mean, std)
    np.testing.assert_allclose(joint / coordinates, np.asarray(step["log_prob"], np.float32),
                               rtol=1e-5, atol=2e-6)

    elapsed = step["t"] - step["t_next"]
    ours = float(jnp.mean(transition_kl(mean, mean_ref, std)))
    assert ours * elapsed == pytest.approx(step["kl_loss"], rel=2e-5)


def test_first_transition_uses_the_next_time_in_place_of_t_equals_one():
    # At t = 1, sigma = a sqrt(t / (1 - t)) is infinite; like the released step, the 1 - t uses
    # the next point of the grid. This is what the recorded std of the first transition shows.
    case = CASES[0]
    first = case["transitions"][0]
    assert first["t"] == 1.0
    expected = case["noise_level"] * math.sqrt(1.0 / (1.0 - first["t_next"]))
    np.testing.assert_allclose(first["std_dev_t"], expected, rtol=1e-6)


def test_group_advantages_match_the_released_stat_tracker():
    groups = REFERENCE["groups"]
    rewards = np.asarray(groups["rewards"], np.float64)
    mean, std, advantages = group_statistics(rewards, groups["size"])
    np.testing.assert_allclose(advantages, groups["advantages"], rtol=1e-12, atol=1e-15)
    assert advantages.dtype == np.float64
    # the constant group (rows 8..11) has zero advantage and the population std of zero
    assert np.all(advantages[8:] == 0) and np.all(std[8:] == 0)
    np.testing.assert_allclose(std[:4], np.std(rewards[:4]), rtol=1e-15)
