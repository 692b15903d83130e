"""The pipeline on a mixture-of-experts decoder: `model.experts` makes the embedded decoder sparse,
SFT and GRPO train it through the Prefect flow, GRPO replays the routes its native server
recorded, and the run store holds each call's routes beside its ids."""

import pytest
from test_pipeline import TINY, query, tiny

from dew_lib.models import load_pretrained

pytest.importorskip("prefect")

LAYERS, EXPERTS, TOP_K = 2, 4, 2


@pytest.fixture(scope="module")
def harness(prefect_harness):
    yield


@pytest.mark.slow
def test_sft_and_grpo_train_an_moe_decoder_and_grpo_replays_its_server_s_routes(harness, tmp_path):
    from flows.pipeline import pipeline

    model = dict(TINY["model"], num_layers=LAYERS, experts=EXPERTS, experts_per_token=TOP_K, expert_features=16)
    grpo = dict(TINY["grpo"], mode="async", routing_replay="rollout")
    params = tiny(tmp_path, model=model, stages=["sft", "grpo"], grpo=grpo,
                  evaluation=dict(TINY["evaluation"], samples=0))
    outcome = pipeline(params)
    run = outcome["run"]
    stages = dict(query(tmp_path, f"SELECT stage, status FROM stages WHERE run = '{run}'"))
    assert {stages[s] for s in ("sft", "grpo", "eval-grpo")} == {"completed"}
    # Every call of the GRPO stage carries its [prompt + sampled, layers, k] routes.
    calls = query(tmp_path, f"SELECT len(prompt_ids) + len(sampled_ids), len(routed_experts), routed_shape "
                            f"FROM calls WHERE run = '{run}' AND stage = 'grpo'")
    assert calls and all(shape == [LAYERS, TOP_K] and routed == ids * LAYERS * TOP_K for ids, routed, shape in calls)
    # Both training stages report the router's load-balancing term; the policy is an MoE checkpoint.
    names = query(tmp_path, f"SELECT stage, count(*) FROM metrics WHERE run = '{run}' AND name = 'router/aux_loss' "
                            "GROUP BY stage ORDER BY stage")
    assert [stage for stage, _ in names] == ["grpo", "sft"]
    loaded = load_pretrained(outcome["policy"])
    assert (loaded.model.experts, loaded.model.experts_per_token) == (EXPERTS, TOP_K)
