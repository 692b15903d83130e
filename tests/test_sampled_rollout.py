"""SampledRollout: what the reward sees, what the batch holds, learning, and bad input."""

import hashlib
import itertools

import jax
import numpy as np
import optax
import pytest

from dew_lib import Dataset, Trainer, models
from dew_lib.objectives import GRPOObjective, algorithms, loss
from dew_lib.rollouts import RewardFailed, SampledRollout, prompt_tasks
from dew_lib.sampling import Sampling
from dew_lib.train.sinks import MemorySink

EOS = 2
MODEL = models.build("causal_transformer", vocab_size=16, emb_features=32, num_layers=2,
                     num_heads=4, mlp_features=64, max_seq_len=16)


def prompts(rows=2):
    prompt = np.array([[0, 0, 3, 4], [0, 5, 6, 7]], np.int32)
    ground_truth = np.zeros((2, 3), np.int32)
    ground_truth[:, :1] = ord("9")
    return {"prompt": np.tile(prompt, (rows // 2, 1)),
            "prompt_length": np.tile([2, 3], rows // 2).astype(np.int32),
            "data_source": np.tile(np.frombuffer(b"toy", np.uint8).astype(np.int32), (rows, 1)),
            "ground_truth": np.tile(ground_truth, (rows // 2, 1)),
            "extra_info": np.zeros((rows, 0), np.int32)}


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, data_source, completion, ground_truth, extra_info):
        self.calls.append((data_source, completion, ground_truth, extra_info))
        return float(completion.split().count(ground_truth)) / 6


def test_each_completion_is_scored_on_its_text_and_packed_with_eos_in_the_mask():
    objective = GRPOObjective(MODEL, seq_len=9)
    reward = Recorder()
    rollout = SampledRollout(objective, reward=reward, groups=3, max_new_tokens=6,
                             sampling=Sampling(temperature=1.0, eos_id=EOS), workers=1)
    trainer = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0))
    state = trainer.initial_state()
    batch = rollout(state, prompts(), jax.random.key(4))
    assert batch["input_ids"].shape == (6, 10)
    assert {c[0] for c in reward.calls} == {"toy"} and {c[2] for c in reward.calls} == {"9"}
    stopped = 0
    for n, session in enumerate(rollout.last_sessions):
        call = session.calls[0]
        sampled = call.sampled_ids.tolist()
        text = [c[1] for c in reward.calls][n]
        if call.finish_reason == "stop":
            stopped += 1
            assert sampled[-1] == EOS and session.status.value == "completed"
            assert text == " ".join(map(str, sampled[:-1]))  # EOS never reaches the reward
        else:
            assert len(sampled) == 6 and session.status.value == "truncated"
            assert text == " ".join(map(str, sampled))
        row = batch["session_index"] == n
        assert batch["input_ids"][row].tolist() == sampled  # EOS included in the response mask
        np.testing.assert_allclose(batch["old_log_probs"][row], call.raw_log_probs)
        assert session.task == rollout.last_tasks[n // 3].id  # the dataset's id (see below)
        assert session.group == n // 3 and session.sample == n % 3
    assert 0 < stopped < 6  # both kinds occurred with this seed
    assert batch["response_mask"].sum() == sum(len(s.calls[0].sampled_ids) for s in rollout.last_sessions)


def test_sessions_name_the_prompt_by_its_stable_task_id_and_repeated_prompts_stay_two_groups():
    # Rows 0 and 2 (and 1 and 3) hold the same prompt: one task id, two groups, each normalized
    # against its own samples only.
    objective = GRPOObjective(MODEL, seq_len=9)
    rollout = SampledRollout(objective, reward=lambda s, completion, t, e: float(len(completion.split())),
                             groups=3, max_new_tokens=6, sampling=Sampling(temperature=1.0, eos_id=EOS),
                             workers=1)
    state = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0)).initial_state()
    batch = prompts(4)
    packed = rollout(state, batch, jax.random.key(3))
    expected = [hashlib.sha256(np.asarray(ids, np.int32).tobytes() + b"\0" + b"9").hexdigest()[:16]
                for ids in ([3, 4], [5, 6, 7])]
    assert [t.id for t in rollout.last_tasks] == expected * 2 == [t.id for t in prompt_tasks(batch)]
    assert [t.data["prompt_ids"].tolist() for t in rollout.last_tasks] == [[3, 4], [5, 6, 7]] * 2
    sessions = rollout.last_sessions
    assert [(s.task, s.group, s.sample) for s in sessions] == [
        (expected[b % 2], b, k) for b in range(4) for k in range(3)]
    rewards = np.array([s.reward for s in sessions])
    want = algorithms.advantages("group", rewards, np.repeat(np.arange(4), 3))
    for n, advantage in enumerate(want):
        assert np.allclose(packed["advantages"][packed["session_index"] == n], advantage)
    merged = algorithms.advantages("group", rewards, np.repeat(np.arange(4) % 2, 3))
    assert not np.allclose(want, merged)  # the check above would see one group per prompt

    batch["task_id"] = np.array([11, 12, 11, 13])  # a dataset's own ids win
    rollout(state, batch, jax.random.key(3))
    assert [s.task for s in rollout.last_sessions[::3]] == ["11", "12", "11", "13"]
    assert [s.group for s in rollout.last_sessions[::3]] == [0, 1, 2, 3]


def test_at_another_temperature_the_update_scores_the_old_policy_itself():
    # The sampler reports untempered log-probs; at temperature 0.7 the batch instead says that
    # the proximal policy is the weights being trained, so the on-policy ratio is exactly 1.
    objective = GRPOObjective(MODEL, seq_len=9, sampling_temperature=0.7)
    rollout = SampledRollout(objective, reward=Recorder(), groups=2, max_new_tokens=6,
                             sampling=Sampling(temperature=0.7, eos_id=EOS), workers=1)
    trainer = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0))
    state = trainer.initial_state()
    batch = rollout(state, prompts(), jax.random.key(4))
    assert "old_log_probs" not in batch and batch.proximal == "in_update"
    _, metrics = loss(objective, state.params, batch)
    assert float(metrics["ratio"]) == 1.0 and float(metrics["clipfrac"]) == 0.0


@pytest.mark.slow
def test_grpo_raises_the_mean_reward_of_a_tiny_decoder():
    objective = GRPOObjective(MODEL, seq_len=9, beta=0.01)
    rollout = SampledRollout(objective, reward=Recorder(), groups=4, max_new_tokens=6,
                             sampling=Sampling(temperature=1.0, eos_id=EOS))
    data = Dataset(train=lambda partition: itertools.repeat(prompts(8)), batch=8)
    sink = MemorySink()
    Trainer(objective, optax.adam(5e-3), key=jax.random.key(0), rollout=rollout).fit(
        data, steps=24, log_every=6, sinks=[sink])
    rewards = [value for _, value in sink.series("reward")]
    assert rewards[0] < 0.3 and rewards[-1] > 2 * rewards[0] + 0.2, rewards
    assert sink.history[-1][1]["compilations"] == 1


def test_bad_settings_and_failing_rewards_name_the_cause():
    objective = GRPOObjective(MODEL, seq_len=9)
    with pytest.raises(ValueError, match="groups must be an integer >= 2 .*got 1"):
        SampledRollout(objective, reward=Recorder(), groups=1, max_new_tokens=6)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        SampledRollout(objective, reward=Recorder(), max_new_tokens=6, estimator="ppo")
    state = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0)).initial_state()
    short = SampledRollout(objective, reward=Recorder(), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"set GRPOObjective\(seq_len=7\)"):
        short(state, prompts(), jax.random.key(0))

    def broken(data_source, completion, ground_truth, extra_info):
        raise KeyError("answer")

    with pytest.raises(RewardFailed, match="raised KeyError.*prompt row 0, sample 0, completion '"):
        SampledRollout(objective, reward=broken, max_new_tokens=6, workers=1)(
            state, prompts(), jax.random.key(0))
    with pytest.raises(RewardFailed, match="returned nan on prompt row 0"):
        SampledRollout(objective, reward=lambda *a: float("nan"), max_new_tokens=6, workers=1)(
            state, prompts(), jax.random.key(0))


def test_reward_details_are_kept_beside_the_session_they_describe():
    import threading

    local = threading.local()

    def reward(data_source, completion, ground_truth, extra_info):
        local.seen = completion  # what a reward like CodeReward keeps per thread
        return float(len(completion.split()))

    objective = GRPOObjective(MODEL, seq_len=9)
    rollout = SampledRollout(objective, reward=reward, groups=3, max_new_tokens=6, workers=4,
                             sampling=Sampling(temperature=1.0, eos_id=EOS),
                             reward_details=lambda: local.seen)
    state = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0)).initial_state()
    rollout(state, prompts(4), jax.random.key(1))
    assert len(rollout.last_reward_details) == len(rollout.last_sessions) == 12
    for session, text in zip(rollout.last_sessions, rollout.last_reward_details, strict=True):
        call = session.calls[0]
        ids = call.sampled_ids.tolist()
        assert text == " ".join(map(str, ids[:-1] if call.finish_reason == "stop" else ids))
        assert session.reward == len(text.split())
    with pytest.raises(TypeError, match="reward_details must be callable"):
        SampledRollout(objective, reward=reward, max_new_tokens=6, reward_details="last_runs")
