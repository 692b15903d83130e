"""The grpo flow in asynchronous mode: the scheduler on the native server trains the stage and
records every scheduler record and session, with its cause, in the run store."""

import pytest

pytest.importorskip("prefect")

from pydantic import ValidationError  # noqa: E402

from dew_lib.store import Store  # noqa: E402
from flows.params import GRPOParams, PipelineParams  # noqa: E402
from test_pipeline import TINY  # noqa: E402


def test_async_settings_are_checked_like_the_scheduler_checks_them():
    with pytest.raises(ValidationError, match=r"max_lag=1 is below ahead \+ sync_every - 1 = 2"):
        GRPOParams(mode="async", ahead=2)
    assert GRPOParams(mode="async", ahead=2, max_lag=2).mode == "async"
    assert GRPOParams(ahead=2).mode == "sync"  # the sync path ignores the async settings


@pytest.mark.slow
def test_the_grpo_flow_trains_asynchronously_and_records_why_each_session_trained_or_not(
        prefect_harness, tmp_path):
    from flows.pipeline import pipeline

    grpo = {**TINY["grpo"], "steps": 3, "mode": "async", "slots": 8}
    params = PipelineParams(root=str(tmp_path), **{**TINY, "grpo": grpo, "stages": ("grpo",)})
    outcome = pipeline(params)
    run = outcome["run"]
    store = Store(str(tmp_path))
    _, records = store.rows(f"SELECT updates, groups, lag FROM scheduler_records WHERE run = '{run}' "
                            "ORDER BY updates")
    assert records == [(0, 2, 0), (1, 2, 1), (2, 2, 1)]  # one batch ahead: later batches lag 1
    _, trained = store.rows(f"SELECT update, count(*) FROM sessions WHERE run = '{run}' AND "
                            "cause = 'admitted' GROUP BY update ORDER BY update")
    assert trained == [(0, 8), (1, 8), (2, 8)]  # 2 prompts x 4 samples per update
    _, causes = store.rows(f"SELECT DISTINCT cause FROM sessions WHERE run = '{run}'")
    assert {"admitted", "pending"} <= {c for (c,) in causes}
    _, steps = store.rows(f"SELECT max(step) FROM metrics WHERE run = '{run}' AND stage = 'grpo'")
    assert steps == [(3,)]
