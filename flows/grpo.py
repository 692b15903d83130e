"""grpo: GRPO with sampled completions graded by each prompt's reward, from a saved policy."""

from __future__ import annotations

from prefect import flow

from flows.params import GRPOParams, RewardParams
from tasks.manifests import DataManifest, PolicyRef, StageResult
from tasks.train import train_stage


@flow(name="grpo")
def grpo(params: GRPOParams, data: DataManifest, start: PolicyRef, directory: str,
         store_root: str = "runs", run: str = "grpo", seed: int = 0,
         reward: RewardParams = RewardParams()) -> StageResult:
    return train_stage("grpo", "grpo", params, data, start, directory, store_root, run, seed, reward)
