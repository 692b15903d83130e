"""The image pipeline's parameters (flow-matching pre-training and Flow-GRPO on rectified-flow
image models), as pydantic models the Prefect UI renders as forms; tasks/params.py re-exports them."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dew_lib.recipes.options import FlowGRPOOptions, FlowPretrainOptions
from dew_lib.train.trackers import TrackerOptions
from tasks.params_base import Params, StageParams, _existing


class ImageDataParams(Params):
    source: Literal["shapes", "folder", "npz"] = Field(
        "shapes", description="'shapes' generates coloured 8x8 squares and crosses from the seed; "
        "'folder' reads PNG/JPEG files from `path`; 'npz' reads an array of uint8 [N, H, W, C] images")
    count: int = Field(512, ge=8, description="shapes: images generated")
    path: str | None = Field(None, description="folder: a directory of .png/.jpg files; npz: an .npz "
                             "file whose 'images' array (or only array) is uint8 [N, H, W, 1 or 3]")
    size: int = Field(8, ge=2, description="folder: side every image is resized to (pixels)")
    channels: Literal[1, 3] = Field(3, description="folder: 3 reads RGB, 1 reads grayscale")

    _exists = field_validator("path")(_existing)


class DiTParams(Params):
    pretrained: str | None = Field(None, description="a SimpleDiT directory written by flow_pretrain "
                                   "(config.json + model.safetensors); empty: a fresh model as below")
    patch_size: int = Field(2, ge=1, description="side of the square patches (divides the image side)")
    emb_features: int = Field(32, ge=4, description="width (a multiple of num_heads and of 4)")
    num_layers: int = Field(2, ge=1, description="transformer blocks")
    num_heads: int = Field(4, ge=1, description="attention heads")
    mlp_ratio: float = Field(2.0, gt=0, description="MLP width as a multiple of the width")

    @field_validator("pretrained")
    @classmethod
    def _saved(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isfile(os.path.join(value, "model.safetensors")):
            raise ValueError(f"{value!r} is not a SimpleDiT directory written by flow_pretrain "
                             "(no model.safetensors)")
        return value


class FlowPretrainParams(FlowPretrainOptions, StageParams):
    preview_rows: int = Field(16, ge=1, description="samples in each preview grid (the same noise every time)")


class FlowGRPOParams(FlowGRPOOptions, StageParams):
    reward: Literal["redness", "greenness", "blueness", "brightness"] = Field(
        "redness", description="what the samples are scored on: how red (green, blue) the lit pixels "
        "are, or the mean brightness")
    preview_rows: int = Field(16, ge=1, description="samples in each preview grid (the same noise every time)")
    store_images: bool = Field(True, description="store every rollout sample as a PNG in the "
                               "run store's samples table")


class FlowPipelineParams(Params):
    name: str = Field("flow", pattern=r"^[A-Za-z0-9_.-]+$",
                      description="run directory name under `root`; a rerun with the same name "
                      "and inputs skips the stages that already finished")
    root: str = Field("runs", description="project directory: runs and the store (dew.duckdb) live here")
    seed: int = Field(0, description="seeds data generation, initialization, noise and rollouts")
    data: ImageDataParams = ImageDataParams()
    model: DiTParams = DiTParams()
    pretrain: FlowPretrainParams = FlowPretrainParams()
    grpo: FlowGRPOParams = FlowGRPOParams()
    stages: tuple[Literal["flow_pretrain", "flow_grpo"], ...] = Field(
        ("flow_pretrain", "flow_grpo"), description="stages to run, in order (flow_grpo alone "
        "starts from model.pretrained)")
    tracking: TrackerOptions = Field(default_factory=TrackerOptions, description="TensorBoard, MLflow and "
                                     "W&B runs of every training stage, beside the run store (docs/trackers.md)")

    @model_validator(mode="after")
    def _chain(self) -> FlowPipelineParams:
        if self.stages not in (("flow_pretrain",), ("flow_grpo",), ("flow_pretrain", "flow_grpo")):
            raise ValueError(f"stages must be ('flow_pretrain',), ('flow_grpo',) or ('flow_pretrain', "
                             f"'flow_grpo'), got {self.stages}")
        if self.stages == ("flow_grpo",) and self.model.pretrained is None:
            raise ValueError("stages=('flow_grpo',) starts from a pre-trained model: set "
                             "model.pretrained to a directory flow_pretrain wrote, or add 'flow_pretrain'")
        return self
