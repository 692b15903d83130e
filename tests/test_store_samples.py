"""The run store's `samples` table: one row per image sample of a Flow-GRPO rollout."""

import json
import os
import shutil

import duckdb
import numpy as np
import pytest

from dew_lib.diffusion import encode_png
from dew_lib.diffusion.flow_rollout import FlowRolloutRecord, group_statistics
from dew_lib.store import Store


def record(step, rewards, groups=2, captions=None):
    rewards = np.asarray(rewards, np.float64)
    mean, std, advantages = group_statistics(rewards, groups)
    advantages = advantages.astype(np.float32)
    n = len(rewards)
    return FlowRolloutRecord(step=step, images=np.zeros((n, 2, 2, 3), np.float32),
                             group=np.repeat(np.arange(n // groups), groups), rewards=rewards,
                             group_mean=mean, group_std=std, advantages=advantages,
                             kept=advantages != 0, captions=tuple(captions or [""] * n))


def test_samples_round_trip_rewards_in_float64_with_their_group_statistics(tmp_path):
    # Two samples of group 0 differ by 1e-9: float64 keeps them apart, float32 would not.
    first = record(7, [0.5, 0.5 + 1e-9, 0.25, 0.25], captions=["a red square"] * 2 + ["a cross"] * 2)
    pixel = encode_png(np.full((1, 1, 3), 200, np.uint8))
    store = Store(tmp_path)
    with store.writer("run-a") as run, run.stage("flow_grpo", kind="flow_grpo") as stage:
        stage.samples(first, images=[pixel, None, pixel, None])
    columns, rows = store.rows("SELECT update, row, group_id, sample, reward, group_mean, group_std, "
                               "advantage, kept, caption, image FROM samples ORDER BY row")
    assert columns[0] == "update"
    assert [r[:4] for r in rows] == [(7, 0, 0, 0), (7, 1, 0, 1), (7, 2, 1, 0), (7, 3, 1, 1)]
    assert [r[4] for r in rows] == [0.5, 0.5 + 1e-9, 0.25, 0.25]
    assert rows[0][5] == 0.5 + 0.5e-9 and rows[0][6] == pytest.approx(0.5e-9, rel=1e-6)
    # (r - mean) / (std + 1e-4): a 1e-9 spread gives a tiny but nonzero advantage.
    assert rows[0][7] == pytest.approx(-0.5e-9 / (0.5e-9 + 1e-4), rel=1e-5) and rows[0][8]
    assert [r[7] for r in rows[2:]] == [0.0, 0.0] and [r[8] for r in rows[2:]] == [False, False]
    assert [r[9] for r in rows] == ["a red square"] * 2 + ["a cross"] * 2
    assert rows[0][10] == pixel and rows[1][10] is None


def test_sample_numbers_count_within_each_group_whatever_the_order(tmp_path):
    shuffled = record(0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    shuffled = FlowRolloutRecord(**{**shuffled.__dict__, "group": np.array([2, 0, 2, 1, 0, 2])})
    store = Store(tmp_path)
    with store.writer("r") as run, run.stage("g") as stage:
        stage.samples(shuffled)
    rows = store.rows("SELECT group_id, sample FROM samples ORDER BY row")[1]
    assert rows == [(2, 0), (0, 0), (2, 1), (1, 0), (0, 1), (2, 2)]


def test_a_retry_replaces_the_samples_of_an_update_instead_of_adding_to_them(tmp_path):
    store = Store(tmp_path)
    with store.writer("r") as run, run.stage("flow_grpo") as stage:
        for step in (0, 1, 2):
            stage.samples(record(step, [0.0, 1.0, 2.0, 3.0]))
    # The retry resumed from the checkpoint at update 1: it drops update 2 and redraws update 1.
    with store.writer("r") as run, run.stage("flow_grpo") as stage:
        stage.discard_after(1)
        stage.samples(record(1, [5.0, 6.0, 7.0, 9.0]))
    counts = store.rows("SELECT update, count(*), sum(reward) FROM samples GROUP BY update ORDER BY update")[1]
    assert counts == [(0, 4, 6.0), (1, 4, 27.0)]


def test_samples_are_readable_while_the_stage_is_still_writing(tmp_path):
    store = Store(tmp_path)
    with store.writer("r") as run, run.stage("flow_grpo") as stage:
        stage.samples(record(0, [0.0, 1.0, 2.0, 3.0]))
        stage.flush()
        assert Store(tmp_path).rows("SELECT count(*) FROM samples")[1] == [(4,)]  # another reader
        with duckdb.connect(store.database, read_only=True) as client:  # the duckdb client's view
            assert client.sql("SELECT max(reward) FROM samples").fetchall() == [(3.0,)]
        stage.samples(record(1, [0.0, 1.0, 2.0, 3.0]))
        stage.flush()
        assert Store(tmp_path).rows("SELECT count(DISTINCT update) FROM samples")[1] == [(2,)]


def test_bad_sample_records_are_refused_naming_the_field(tmp_path):
    store = Store(tmp_path)
    good = record(0, [0.0, 1.0])
    with store.writer("r") as run, run.stage("g") as stage:
        with pytest.raises(TypeError, match=r"lacks \['group'"):
            stage.samples(object())
        broken = FlowRolloutRecord(**{**good.__dict__, "rewards": np.array([0.0, np.nan])})
        with pytest.raises(ValueError, match="reward must be finite; rows \\[1\\]"):
            stage.samples(broken)
        with pytest.raises(ValueError, match="one value per sample .*'image': 1"):
            stage.samples(good, images=[b"png"])
        with pytest.raises(ValueError, match="update must be >= 0"):
            stage.samples(good, update=-1)


def test_a_store_made_before_the_samples_table_gains_it_when_read(tmp_path):
    store = Store(tmp_path)
    with store.writer("r") as run, run.stage("sft") as stage:
        stage.metrics(1, {"loss": 1.0})
    shutil.rmtree(os.path.join(store.directory, "samples"))  # as an older Dew left it
    with open(os.path.join(store.directory, "views.json"), "w", encoding="utf-8") as marker:
        json.dump({"format": 1, "store": store.directory}, marker)
    assert Store(tmp_path).rows("SELECT count(*) FROM samples")[1] == [(0,)]
    with duckdb.connect(store.database, read_only=True) as client:
        assert client.sql("SELECT count(*) FROM samples").fetchall() == [(0,)]
