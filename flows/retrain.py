"""retrain: the pipeline on the current data, promoting its policy only when it scores better.

The promoted policy is re-evaluated on today's held-out prompts before the comparison, so a
change in the data cannot make an old score look better or worse than it is. The decision and
both scores land in the run store as the `promotion` stage.
"""

from __future__ import annotations

import os
import shutil

from prefect import flow, get_run_logger
from pydantic import Field

from flows.evaluate import evaluate
from flows.pipeline import pipeline
from tasks.manifests import DataManifest, PolicyRef
from tasks.params import Params, PipelineParams
from tasks.policy import checkpoint_fingerprint
from tasks.records import open_stage
from tasks.storage import read_json, write_json


class RetrainParams(Params):
    pipeline: PipelineParams = PipelineParams(name="retrain")
    promoted: str = Field("runs/promoted", description="where the promoted policy and its record live")


def promote(policy: str, promoted: str, accuracy: float, run: str) -> str:
    """Copy `policy` into `promoted`/policy atomically and record why."""
    target = os.path.join(promoted, "policy")
    staging = target + ".incoming"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(policy, staging)
    if os.path.isdir(target):
        shutil.rmtree(target + ".previous", ignore_errors=True)
        os.replace(target, target + ".previous")
    os.replace(staging, target)
    write_json(os.path.join(promoted, "promoted.json"),
               {"accuracy": accuracy, "run": run, "source": os.path.abspath(policy)})
    return target


@flow(name="retrain")
def retrain(params: RetrainParams = RetrainParams()) -> dict:
    logger = get_run_logger()
    outcome = pipeline(params.pipeline)
    run, new = outcome["run"], outcome["accuracy"][params.pipeline.stages[-1]]
    store_root = os.path.abspath(params.pipeline.root)
    target = os.path.join(params.promoted, "policy")
    current = None
    if os.path.isdir(target):
        data = DataManifest(**read_json(os.path.join(params.pipeline.root, params.pipeline.name,
                                                     "data", "manifest.json")))
        current = evaluate("promoted", PolicyRef(path=target, fingerprint=checkpoint_fingerprint(target)),
                           data, params.pipeline.evaluation,
                           os.path.join(params.pipeline.root, params.pipeline.name), store_root,
                           run, reward=params.pipeline.reward, tools=params.pipeline.tools,
                           tracking=params.pipeline.tracking).accuracy
    promoted = current is None or new > current
    if promoted:
        promote(outcome["policy"], params.promoted, new, run)
    with open_stage(store_root, run, "promotion", "promotion") as writer:
        writer.finish("completed", {"new_accuracy": new, "promoted": float(promoted),
                                    **({} if current is None else {"promoted_accuracy": current})})
    logger.info("new policy %.1f%% vs promoted %s: %s", 100 * new,
                "none" if current is None else f"{100 * current:.1f}%",
                "promoted" if promoted else "kept the promoted one")
    return {"run": run, "new_accuracy": new, "promoted_accuracy": current, "promoted": promoted}
