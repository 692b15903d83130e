"""evaluate: held-out accuracy of a saved policy, every answer recorded in the store."""

from __future__ import annotations

from prefect import flow

from dew_lib.train.trackers import TrackerOptions
from tasks.evaluate import evaluate_policy
from tasks.manifests import DataManifest, EvalResult, PolicyRef
from tasks.params import EvalParams, RewardParams, ToolParams


@flow(name="evaluate")
def evaluate(stage: str, policy: PolicyRef, data: DataManifest, params: EvalParams = EvalParams(),
             directory: str = "runs/demo", store_root: str = "runs", run: str = "evaluate",
             step: int = 0, reward: RewardParams = RewardParams(),
             tools: ToolParams = ToolParams(), tracking: TrackerOptions = TrackerOptions()) -> EvalResult:
    return evaluate_policy(stage, policy, data, params, directory, store_root, run, step, reward, tools, tracking)
