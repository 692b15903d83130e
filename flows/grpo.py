"""grpo and ppo: the RL stage, from a saved policy, with sampled completions graded by each
prompt's reward.

`params.mode="sync"` draws each batch on the trainer's device before its update (SampledRollout);
`"async"` draws the next batches on the native rollout server while the trainer updates
(dew_lib/recipes/scheduled.py, docs/rl.md "Asynchronous GRPO"); dew_lib.recipes builds either.
On a tool task (`data.tool`, data.source="tools") each prompt is a tool episode shaped by `tools`
(dew_lib/recipes/episodes.py, docs/episodes.md). `ppo` trains the same policy side (`params`)
with a critic and GAE in place of the group baseline, as a stage of its own (sync only).
"""

from __future__ import annotations

from prefect import flow

from dew_lib.train.trackers import TrackerOptions
from tasks.manifests import DataManifest, PolicyRef, StageResult
from tasks.params import GRPOParams, PPOParams, RewardParams, ToolParams
from tasks.train import train_stage


@flow(name="grpo")
def grpo(params: GRPOParams, data: DataManifest, start: PolicyRef, directory: str,
         store_root: str = "runs", run: str = "grpo", seed: int = 0,
         reward: RewardParams = RewardParams(), tools: ToolParams = ToolParams(),
         tracking: TrackerOptions | None = None) -> StageResult:
    return train_stage("grpo", "grpo", params, data, start, directory, store_root, run, seed, reward, tools,
                       tracking=tracking)


@flow(name="ppo")
def ppo(params: GRPOParams, data: DataManifest, start: PolicyRef, directory: str,
        store_root: str = "runs", run: str = "ppo", seed: int = 0,
        reward: RewardParams = RewardParams(), tools: ToolParams = ToolParams(),
        critic: PPOParams = PPOParams(), tracking: TrackerOptions | None = None) -> StageResult:
    return train_stage("ppo", "ppo", params, data, start, directory, store_root, run, seed, reward, tools, critic,
                       tracking=tracking)
