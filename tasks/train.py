"""The training task every stage runs: build the stage's objects, fit, save the policy.

`train_stage` hands the stage's parameters (tasks/params.py), which are the options of
dew_lib.recipes (SFTOptions, DPOOptions, GRPOOptions, with PPOOptions for a PPO stage) plus the
pipeline's own fields, and a data spec made from the run's data manifest to the recipes' builders,
which make the objective, dataset and rollout, sync or async, and the optimizer; what it adds is
the run store, the UI and the two kinds of resume.

A stage works in the directory of its inputs, `runs/<name>/<stage>/<key[:12]>/` (key: the
fingerprint of its parameters, data, starting policy, seed and, for GRPO, reward parameters, for
distill, the teacher checkpoint or served teacher; tasks/storage.py `stage_directory`), so two
kinds of resume meet here and neither crosses inputs:
  * a retry (an exception, or the process killed and the flow run again with the same inputs)
    continues from the last checkpoint in that directory: `Trainer.fit` restores it, and the
    store drops what earlier attempts recorded after that checkpoint;
  * a rerun with the same inputs skips the stage: `result.json`, written last, records the key,
    and a match returns the saved result without touching the model.
Changed inputs find a directory with neither and train from step 0, except a DPO or GRPO stage
whose inputs differ from an earlier set only in `steps`: it continues a copy of that set's
checkpoint, as one longer run would (`continue_shorter`). The log says which happened, and for
a fresh start which input group changed since the stage's previous start.

The task decides all that; `run_stage` (tasks/stage_run.py, with the stage's fingerprint)
trains, in the task's process or, with `processes > 1`, in each process of a job the task
launches and waits for (tasks/stage_job.py). Both paths run that one function; Prefect (the run
logger, artifacts, retries) stays here, so a job's processes start without importing it.

Not here: what a stage's options build (dew_lib/recipes), the image stages (tasks/flow_train.py).
"""

from __future__ import annotations

import os

from prefect import get_run_logger, task

from dew_lib.train.trackers import TrackerOptions
from tasks.lifecycle import Start, begin
from tasks.manifests import DataManifest, PolicyRef, StageResult
from tasks.params import PPOParams, RewardParams, StageParams, ToolParams
from tasks.refusals import retry_unless_refused
from tasks.stage_job import StageJob, run_job
from tasks.stage_run import SHOWN, input_labels, run_stage, stage_inputs
from tasks.ui import ProgressSink, keep_last_checkpoint, publish_stage

LINKS = ("policy", "checkpoints", "metrics.jsonl", "curves.png")  # also under runs/<name>/<stage>/


@task(retries=2, retry_delay_seconds=1, retry_condition_fn=retry_unless_refused, task_run_name="train-{stage}")
def train_stage(stage: str, kind: str, params: StageParams, data: DataManifest, start: PolicyRef,
                directory: str, store_root: str, run: str, seed: int,
                reward: RewardParams | None = None, tools: ToolParams | None = None,
                ppo: PPOParams | None = None, tracking: TrackerOptions | None = None) -> StageResult:
    """Train one stage from `start` and save its final policy under `directory`/<key[:12]>/policy
    (also reachable as `directory`/policy, through `directory`/latest, until other inputs start).

    reward: how the RL stage grades its completions (tasks/rewards.py); part of its fingerprint.
    tools: the episodes of the RL stage on a tool task (data.tool); part of its fingerprint.
    ppo: the critic's options of a PPO stage (kind "ppo"); part of its fingerprint.
    tracking: the trackers the stage also logs to (not part of its fingerprint); directories left
    empty go under the run's directory, the one above `directory`.
    With `params.processes > 1` the training runs as a job of that many processes
    (tasks/stage_job.py) that this task launches and waits for; a failed job raises, so a retry
    relaunches it and it resumes from the same checkpoints.
    """
    logger = get_run_logger()
    key, inputs = stage_inputs(kind, params, data, start, seed, reward, tools, ppo)
    # a schedule that spans the steps (SFT's warmup-cosine) cannot train on from a shorter run
    links = LINKS + ("adapter",) if params.lora.rank else LINKS
    start_at = begin(stage, kind, params, key, inputs, directory, store_root, run, links=links,
                     labels=input_labels(stage), result=StageResult, logger=logger,
                     shorter=params.schedule == "constant")
    if not isinstance(start_at, Start):
        return start_at
    if tracking is not None:
        tracking = tracking.resolved(os.path.dirname(os.path.abspath(directory)))
    directory = start_at.directory
    job = StageJob(stage=stage, kind=kind, params=params.model_dump(mode="json"), data=data, start=start,
                   directory=directory, key=key, store_root=store_root, run=run, seed=seed, reward=reward,
                   tools=tools, ppo=ppo, resumed=start_at.resumed, written=start_at.written, tracking=tracking)
    processes = getattr(params, "processes", 1)
    if processes == 1:
        result = run_stage(job, logger, publish=publish_stage)
    else:
        result = run_job(job, processes, logger, ProgressSink(stage, params.steps))
        curves = os.path.join(directory, "curves.png")
        publish_stage(stage, result.metrics, curves if os.path.exists(curves) else None)
    logger.info("%s: %s", stage, keep_last_checkpoint(os.path.join(directory, "checkpoints")))
    logger.info("%s done: %s", stage, {k: round(v, 4) for k, v in result.metrics.items() if k in SHOWN})
    return result
