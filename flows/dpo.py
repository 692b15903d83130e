"""dpo: direct preference optimization against the starting policy, from a saved policy."""

from __future__ import annotations

from prefect import flow

from flows.params import DPOParams
from tasks.manifests import DataManifest, PolicyRef, StageResult
from tasks.train import train_stage


@flow(name="dpo")
def dpo(params: DPOParams, data: DataManifest, start: PolicyRef, directory: str,
        store_root: str = "runs", run: str = "dpo", seed: int = 0) -> StageResult:
    return train_stage("dpo", "dpo", params, data, start, directory, store_root, run, seed)
