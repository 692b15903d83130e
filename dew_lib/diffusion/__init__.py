"""Rectified-flow image generation: inputs, the process and its samplers, flow-matching training.

`InputSpec`/`Field` say which batch field is generated and which condition it; `presets.Flow()()`
builds the rectified-flow `Process`; `FlowSDE`, `CFG`, `Euler` and `sample_trajectory` sample
paths; `DiffusionObjective` pre-trains a model by flow matching; `grid_png` renders previews and
`sample_preview` draws them. Flow-GRPO: `FlowGRPOObjective` (flow_grpo.py) trained on what
`FlowRollout` (flow_rollout.py) samples and scores.
"""

from dew_lib.diffusion import presets
from dew_lib.diffusion.denoiser import Denoiser
from dew_lib.diffusion.flow_grpo import FlowGRPOObjective, FlowReward
from dew_lib.diffusion.flow_rollout import FlowRollout, FlowRolloutRecord, group_statistics
from dew_lib.diffusion.inputs import AutoEncoder, BagOfTokens, Field, Identity, InputSpec, WordTokenizer
from dew_lib.diffusion.objective import DiffusionObjective
from dew_lib.diffusion.preview import Preview, encode_png, grid_png, sample_preview
from dew_lib.diffusion.process import (
                                       CFG,
                                       Euler,
                                       FlowSDE,
                                       FlowTrajectory,
                                       Process,
                                       Solver,
                                       gaussian_log_density,
                                       sample_trajectory,
                                       sde_transition,
                                       transition_kl,
)

__all__ = ["AutoEncoder", "BagOfTokens", "CFG", "Denoiser", "DiffusionObjective", "Euler", "Field",
           "FlowGRPOObjective", "FlowReward", "FlowRollout", "FlowRolloutRecord", "FlowSDE", "FlowTrajectory",
           "Identity", "InputSpec", "Preview", "Process", "Solver",
           "WordTokenizer", "encode_png", "gaussian_log_density", "grid_png", "group_statistics",
           "presets", "sample_preview", "sample_trajectory", "sde_transition", "transition_kl"]
