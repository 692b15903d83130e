"""sessions: the merge rule, first-fit rows, aligned columns, statuses and advantages."""

import numpy as np
import pytest

from dew_lib.records.sessions import Call, Session, Status
from dew_lib.rollouts.packing import chain_lengths, chains, pack, rows_needed, session_metrics


def call(prompt, sampled, version=0, **extra):
    behavior = extra.pop("behavior", [-0.5] * len(sampled))
    return Call(prompt_ids=prompt, sampled_ids=sampled, behavior_log_probs=behavior,
                version=version, **extra)


def session(calls, reward=1.0, status=Status.COMPLETED, task="t", group=0, sample=0, **extra):
    return Session(task=task, group=group, sample=sample, calls=tuple(calls), status=status,
                   reward=reward, **extra)


def test_a_call_joins_the_chain_only_when_its_prompt_extends_every_id_so_far():
    first = call([1, 2], [3, 4])
    extends = call([1, 2, 3, 4, 7], [8])          # chain + observation 7, then samples 8
    prompt_only = call([1, 2, 9], [5])            # starts with the prompt but not the samples
    merged = chains(session([first, extends]))
    assert len(merged) == 1
    ids, call_of = merged[0].flat()
    assert ids.tolist() == [1, 2, 3, 4, 7, 8]
    assert call_of.tolist() == [-1, -1, 0, 0, -1, 1]
    split = chains(session([first, prompt_only]))
    assert [c.flat()[0].tolist() for c in split] == [[1, 2, 3, 4], [1, 2, 9, 5]]


def test_pack_places_chains_first_fit_with_segments_positions_and_aligned_columns():
    a = session([call([1, 2], [3, 4], version=5, behavior=[-0.1, -0.2],
                      raw_log_probs=[-0.3, -0.4])], reward=1.0, sample=0)
    b = session([call([1, 2], [6], version=6, behavior=[-0.7], raw_log_probs=[-0.8])],
                reward=0.0, sample=1)
    c = session([call([7, 7, 7], [8, 8, 8], version=6, behavior=[-1.0] * 3,
                      raw_log_probs=[-1.1] * 3)], reward=0.5, task="u", group=1)
    batch = pack([a, b, c], width=8)
    # a (4 ids) and b (3 ids) share row 0; c (6 ids) needs row 1.
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 1, 2, 6, 0], [7, 7, 7, 8, 8, 8, 0, 0]]
    assert batch["text_segment_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0]]
    assert batch["text_positions"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 1, 0], [0, 0, 0, 1, 1, 1, 0, 0]]
    np.testing.assert_allclose(batch["behavior_log_probs"][0], [0, 0, -0.1, -0.2, 0, 0, -0.7, 0])
    np.testing.assert_allclose(batch["old_log_probs"][0], [0, 0, -0.3, -0.4, 0, 0, -0.8, 0])
    assert batch["versions"][0].tolist() == [-1, -1, 5, 5, -1, -1, 6, -1]
    assert batch["session_index"].tolist() == [[-1, -1, 0, 0, -1, -1, 1, -1], [-1, -1, -1, 2, 2, 2, -1, -1]]
    assert batch["call_index"][1].tolist() == [-1, -1, -1, 0, 0, 0, -1, -1]
    np.testing.assert_allclose(batch["session_weights"][0], [0, 0, .5, .5, 0, 0, 1, 0])
    # Group (t, 0) holds rewards 1 and 0: advantages +-1 / (std + eps) with std = sqrt(1/2).
    expected = 0.5 / (np.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(batch["advantages"][0, :4], expected, rtol=1e-6)
    np.testing.assert_allclose(batch["advantages"][0, 4:7], -expected, rtol=1e-6)
    # Group (u, 1) has one member: nothing to compare with, advantage 0.
    np.testing.assert_allclose(batch["advantages"][1], 0.0)
    np.testing.assert_allclose(batch["rewards"][1, :6], 0.5)


def test_statuses_that_never_train_take_no_rows_and_no_part_in_the_baseline():
    members = [
        session([call([1], [2])], reward=1.0, sample=0),
        session([call([1], [3])], reward=0.0, sample=1),
        session([call([1], [4])], reward=None, status=Status.INFRA_ERROR, sample=2),
        session([call([1], [5])], reward=None, status=Status.CANCELLED, sample=3),
        session([call([1], [6, 6], finish_reason="length")], reward=9.0,
                status=Status.TRUNCATED, sample=4),
    ]
    masked = pack(members, width=4, estimator="mean")
    assert masked["session_index"].max() == 1  # only the two completed sessions
    np.testing.assert_allclose(masked["advantages"][masked["response_mask"] == 1], [0.5, -0.5])
    scored = pack(members, width=4, estimator="mean", truncation="score")
    # Rewards 1, 0, 9: mean 10/3.
    assert sorted(set(scored["session_index"][scored["response_mask"] == 1].tolist())) == [0, 1, 4]
    zeroed = pack(members, width=4, estimator="mean", truncation="zero")
    truncated = zeroed["session_index"] == 4
    np.testing.assert_allclose(zeroed["advantages"][truncated], 0 - 1 / 3, rtol=1e-6)


def test_rloo_compares_each_session_with_the_rest_of_its_group():
    members = [session([call([1], [2])], reward=r, sample=i) for i, r in enumerate([1.0, 0.0, 0.5])]
    batch = pack(members, width=4, estimator="rloo")
    advantages = [batch["advantages"][batch["session_index"] == i][0] for i in range(3)]
    np.testing.assert_allclose(advantages, [1 - 0.25, 0 - 0.75, 0.5 - 0.5])


def test_rows_needed_and_chain_lengths_agree_with_pack():
    members = [session([call([1] * n, [2] * n)], sample=i) for i, n in enumerate([3, 2, 1, 2])]
    lengths = chain_lengths(members, width=6)
    assert lengths == [6, 4, 2, 4]
    assert rows_needed(lengths, 6) == 3
    assert pack(members, width=6)["input_ids"].shape == (3, 6)
    assert pack(members, width=6, rows=5)["input_ids"].shape == (5, 6)


def test_pack_refuses_what_cannot_fit_or_cannot_train():
    members = [session([call([1, 1], [2, 2])], sample=i) for i in range(3)]
    with pytest.raises(ValueError, match="need 2 rows of width 8, but pack was given rows=1"):
        pack(members, width=8, rows=1)
    with pytest.raises(ValueError, match="chain of 4 ids, wider than the row width 3"):
        pack(members, width=3)
    with pytest.raises(ValueError, match="has no reward"):
        pack([session([call([1], [2])], reward=None)], width=4)
    with pytest.raises(ValueError, match="reward nan"):
        pack([session([call([1], [2])], reward=float("nan"))], width=4)
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpo'"):
        pack(members, width=8, estimator="grpo")
    with pytest.raises(ValueError, match="truncation must be one of"):
        pack(members, width=8, truncation="drop")


def test_calls_refuse_misaligned_records():
    with pytest.raises(ValueError, match="2 entries for 1 sampled ids"):
        Call(prompt_ids=[1], sampled_ids=[2], behavior_log_probs=[-1.0, -1.0])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        Call(prompt_ids=[], sampled_ids=[2], behavior_log_probs=[-1.0])
    with pytest.raises(TypeError, match="integer token ids"):
        Call(prompt_ids=[1.5], sampled_ids=[2], behavior_log_probs=[-1.0])
    with pytest.raises(ValueError, match="does not contain the id sampled there"):
        Call(prompt_ids=[1], sampled_ids=[2], behavior_log_probs=[-1.0], support=[[3, 4]])


def test_support_and_routing_columns_follow_the_sampled_ids():
    s = session([Call(prompt_ids=[1, 2], sampled_ids=[3, 4], behavior_log_probs=[-1.0, -1.0],
                      support=[[3, 5], [4]],
                      routed_experts=np.arange(4 * 2 * 1).reshape(4, 2, 1).astype(np.int16))])
    with pytest.raises(ValueError, match="needs support_capacity"):
        pack([s], width=6)
    batch = pack([s], width=6, support_capacity=4)
    assert batch["support_ids"].tolist() == [[3, 5, 4, -1]]
    assert batch["support_columns"].tolist() == [[2, 2, 3, -1]]
    assert batch["routed"].tolist() == [[True, True, True, True, False, False]]
    assert batch["routed_experts"].dtype == np.int16
    assert batch["routed_experts"][0, 3].tolist() == [[6], [7]]
    with pytest.raises(ValueError, match="holds 3 support ids but support_capacity is 2"):
        pack([s], width=6, support_capacity=2)


def test_session_metrics_report_merges_masks_rewards_latency_and_lag():
    merged = session([call([1], [2], version=3), call([1, 2, 9], [4], version=4)], reward=1.0,
                     components={"format": 1.0})
    failed = session([call([1], [2, 2, 2, 2])], reward=None, status=Status.INFRA_ERROR, sample=1)
    metrics = session_metrics([merged, failed], latencies=[1.0, 3.0], version=5)
    assert metrics["calls_per_chain"] == 2.0
    assert metrics["sessions/infra_error"] == 0.5
    assert metrics["masked/infra_error"] == pytest.approx(4 / 6)
    assert metrics["reward/mean"] == 1.0 and metrics["reward/format"] == 1.0
    assert metrics["latency/max"] == 3.0
    assert metrics["lag/max"] == 2.0 and metrics["lag/mean"] == 1.5
