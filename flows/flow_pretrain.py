"""flow_pretrain: flow-matching pre-training of a small diffusion transformer on images."""

from __future__ import annotations

from prefect import flow

from dew_lib.train.trackers import TrackerOptions
from tasks.flow_train import pretrain_stage
from tasks.manifests import ImageManifest, ImageStageResult
from tasks.params import DiTParams, FlowPretrainParams


@flow(name="flow_pretrain")
def flow_pretrain(params: FlowPretrainParams, data: ImageManifest, model: DiTParams = DiTParams(),
                  directory: str = "runs/flow/flow_pretrain", store_root: str = "runs",
                  run: str = "flow_pretrain", seed: int = 0,
                  tracking: TrackerOptions | None = None) -> ImageStageResult:
    return pretrain_stage("flow_pretrain", params, data, model, directory, store_root, run, seed, tracking)
