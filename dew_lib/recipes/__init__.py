"""Stage builders and ready-made recipes: the one place a stage's options become objects.

options.py declares every stage's options once (pydantic models the pipeline's forms are made of;
the distill stage's are in options_distill.py) and builds the optimizer; build.py maps SFT, DPO,
GRPO (sync or async) and distill options to an objective, its data and its rollout (a distill
teacher loaded in process or served by an engine); flow.py does the same for flow-matching
pre-training and Flow-GRPO; scheduled.py is asynchronous GRPO's rollout, drawn on the native
server or on a remote engine (remote.py); episodes.py is GRPO on tool episodes; recorded.py writes
what a sync rollout drew to the run store; chain.py chains SFT, DPO and GRPO stages on one
decoder. The pipeline's tasks (tasks/train.py, tasks/flow_train.py) and the Recipe chain both
build here.

Not here: Prefect, reading files into data specs, Trainer.fit's loop.
"""

from dew_lib.recipes.build import Built, build_distill, build_dpo, build_grpo, build_sft
from dew_lib.recipes.chain import Recipe, Stage
from dew_lib.recipes.episodes import OneTurn, build_episode_grpo
from dew_lib.recipes.flow import build_flow_grpo, build_flow_pretrain, image_batches
from dew_lib.recipes.options import (
    DPOOptions,
    EpisodeOptions,
    FlowGRPOOptions,
    FlowPretrainOptions,
    GRPOOptions,
    LoRAOptions,
    Options,
    PPOOptions,
    SFTOptions,
    TrainOptions,
    optimizer,
)
from dew_lib.recipes.options_distill import DistillOptions
from dew_lib.recipes.recorded import RecordedRollout, episode_sessions, sampled_sessions
from dew_lib.recipes.remote import RemoteEngine, remote_server
from dew_lib.recipes.scheduled import ScheduledRollout

__all__ = ["Built", "DPOOptions", "DistillOptions", "EpisodeOptions", "FlowGRPOOptions", "FlowPretrainOptions",
           "GRPOOptions", "LoRAOptions", "OneTurn", "Options", "PPOOptions", "Recipe", "RecordedRollout",
           "RemoteEngine", "SFTOptions", "ScheduledRollout", "Stage", "TrainOptions", "build_distill", "build_dpo",
           "build_episode_grpo", "build_flow_grpo", "build_flow_pretrain", "build_grpo", "build_sft",
           "episode_sessions", "image_batches", "optimizer", "remote_server", "sampled_sessions"]
