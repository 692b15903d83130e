"""sft: supervised fine-tuning on assistant answers, from a saved policy."""

from __future__ import annotations

from prefect import flow

from dew_lib.train.trackers import TrackerOptions
from tasks.manifests import DataManifest, PolicyRef, StageResult
from tasks.params import SFTParams
from tasks.train import train_stage


@flow(name="sft")
def sft(params: SFTParams, data: DataManifest, start: PolicyRef, directory: str,
        store_root: str = "runs", run: str = "sft", seed: int = 0,
        tracking: TrackerOptions | None = None) -> StageResult:
    return train_stage("sft", "sft", params, data, start, directory, store_root, run, seed, tracking=tracking)
