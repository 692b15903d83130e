"""The grpo flow in asynchronous mode: the scheduler on the native server trains the stage,
records every scheduler record and session with its cause in the run store, and a rerun that
resumes the stage from its checkpoint trains the rollouts the earlier run finished but did not
train on instead of drawing them again."""

import pytest

pytest.importorskip("prefect")

from pydantic import ValidationError  # noqa: E402
from test_pipeline import TINY  # noqa: E402

from dew_lib.store import Store  # noqa: E402
from tasks.params import GRPOParams, PipelineParams  # noqa: E402


def test_async_settings_are_checked_like_the_scheduler_checks_them():
    with pytest.raises(ValidationError, match=r"max_lag=1 is below ahead \+ sync_every - 1 = 2"):
        GRPOParams(mode="async", ahead=2)
    assert GRPOParams(mode="async", ahead=2, max_lag=2).mode == "async"
    assert GRPOParams(ahead=2).mode == "sync"  # the sync path ignores the async settings
    form = GRPOParams.model_json_schema()["properties"]  # what the Prefect UI's form shows
    assert form["mode"]["enum"] == ["sync", "async"] and "RolloutScheduler" in form["mode"]["description"]
    assert all(form[name].get("description") for name in ("ahead", "max_lag", "sync_every", "slots"))


@pytest.mark.slow
def test_the_grpo_flow_trains_asynchronously_records_why_and_resumes_with_finished_rollouts(
        prefect_harness, tmp_path):
    from flows.pipeline import pipeline

    def run_steps(steps):
        grpo = {**TINY["grpo"], "steps": steps, "mode": "async", "slots": 8}
        return pipeline(PipelineParams(root=str(tmp_path), name="async",
                                       **{**TINY, "grpo": grpo, "stages": ("grpo",)}))["run"]

    first = run_steps(3)
    store = Store(str(tmp_path))
    _, records = store.rows("SELECT updates, groups, lag FROM scheduler_records WHERE run = ? "
                            "ORDER BY updates", [first])
    assert records == [(0, 2, 0), (1, 2, 1), (2, 2, 1)]  # one batch ahead: later batches lag 1
    _, trained = store.rows("SELECT update, count(*) FROM sessions WHERE run = ? AND cause = "
                            "'admitted' GROUP BY update ORDER BY update", [first])
    assert trained == [(0, 8), (1, 8), (2, 8)]  # 2 prompts x 4 samples per update
    # Batch 3 was drawn during the last update; what finished is kept for a resumed run.
    _, waiting = store.rows("SELECT group_id, sample FROM sessions WHERE run = ? AND cause = "
                            "'pending' AND update = 2 AND group_id >= 6 ORDER BY ALL", [first])
    assert waiting, "no rollout of batch 3 finished before the stage closed"

    second = run_steps(4)  # same name, more steps: the stage resumes from its step-3 checkpoint
    _, reused = store.rows("SELECT group_id, sample FROM sessions WHERE run = ? AND cause = "
                           "'admitted' AND update = 3 AND latency IS NULL ORDER BY ALL", [second])
    assert reused == waiting  # trained, not drawn again
    _, counted = store.rows("SELECT metrics['sessions/reused'] FROM scheduler_records WHERE run = ? "
                            "AND updates = 3", [second])
    assert counted == [(float(len(waiting)),)]
    _, steps = store.rows("SELECT max(step) FROM metrics WHERE run = ? AND stage = 'grpo'", [second])
    assert steps == [(4,)]
