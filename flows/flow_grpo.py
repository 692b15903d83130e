"""flow_grpo: Flow-GRPO from a pre-trained diffusion transformer against a named reward, and
`flow_grpo_pipeline`, which prepares the images, pre-trains and then runs Flow-GRPO.

    python -m flows.flow_grpo [--name flow] [--root runs] [--seed 0]

runs the pipeline on the embedded defaults: 8x8 coloured shapes, 800 flow-matching steps, then
40 Flow-GRPO updates that make the samples redder. A rerun with the same name and inputs reuses
every finished stage; a failed stage is retried by Prefect and continues from its checkpoint,
and a rerun with the same name and parameters, after a kill or a finish, is the same run in the
store (its next attempt). A run refused before it trains prints why once and exits with status 1.
"""

from __future__ import annotations

import os
import sys
import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from dew_lib.train.trackers import TrackerOptions
from flows.flow_pretrain import flow_pretrain
from tasks import lifetimes
from tasks.flow_train import grpo_stage
from tasks.images import dit_ref, prepare_images
from tasks.manifests import DiTRef, ImageStageResult
from tasks.params import FlowGRPOParams, FlowPipelineParams, command_line
from tasks.records import pipeline_run
from tasks.refusals import refusal_exit
from tasks.ui import artifact_key


@flow(name="flow_grpo")
def flow_grpo(params: FlowGRPOParams, start: DiTRef, directory: str = "runs/flow/flow_grpo",
              store_root: str = "runs", run: str = "flow_grpo", seed: int = 0,
              tracking: TrackerOptions | None = None) -> ImageStageResult:
    return grpo_stage("flow_grpo", params, start, directory, store_root, run, seed, tracking)


@flow(name="flow_grpo_pipeline")
def flow_grpo_pipeline(params: FlowPipelineParams = FlowPipelineParams()) -> dict:
    logger = get_run_logger()
    started = time.perf_counter()
    directory = os.path.abspath(os.path.join(params.root, params.name))
    store_root = os.path.abspath(params.root)
    results: list[ImageStageResult] = []
    with pipeline_run(store_root, directory, params.name, params.model_dump(mode="json")) as (run, continued):
        if continued:
            logger.info("continuing run %s (same name and parameters) as its next attempt", run)
        start = None if params.model.pretrained is None else dit_ref(params.model.pretrained)
        if "flow_pretrain" in params.stages:
            data = prepare_images(params.data, os.path.join(directory, "data"), params.seed)
            results.append(flow_pretrain(params.pretrain, data, params.model,
                                         os.path.join(directory, "flow_pretrain"), store_root, run,
                                         params.seed, params.tracking))
            start = results[-1].model
        if "flow_grpo" in params.stages:
            results.append(flow_grpo(params.grpo, start, os.path.join(directory, "flow_grpo"),
                                     store_root, run, params.seed, params.tracking))
    seconds = time.perf_counter() - started
    table = [_row(r) for r in results]
    create_table_artifact(table, key=artifact_key(run, "stages"),
                          description="what each image stage ended at")
    summary = _summary(table, results, store_root, seconds)
    create_markdown_artifact(summary, key=artifact_key(run, "summary"),
                             description="what the Flow-GRPO pipeline produced")
    logger.info("\n%s", summary)
    return {"run": run, "model": results[-1].model.path, "seconds": seconds,
            "metrics": {r.stage: r.metrics for r in results},
            "previews": {r.stage: r.previews for r in results}}


def _row(result: ImageStageResult) -> dict:
    def pick(name):
        return None if name not in result.metrics else round(result.metrics[name], 4)
    return {"stage": result.stage, "loss": pick("loss"), "reward": pick("reward"),
            "preview_reward_start": pick("preview_reward_start"),
            "preview_reward_final": pick("preview_reward_final"), "reused": result.cached}


def _summary(table, results, store_root: str, seconds: float) -> str:
    def show(v):
        return "" if v is None else f"{v:.4f}"
    lines = ["| stage | loss | rollout reward | preview reward (start -> end) | reused |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['stage']} | {show(r['loss'])} | {show(r['reward'])} | "
              + (f"{show(r['preview_reward_start'])} -> {show(r['preview_reward_final'])}"
                 if r["preview_reward_start"] is not None else "")
              + f" | {'yes' if r['reused'] else ''} |" for r in table]
    lines += ["", f"Final model (config.json + model.safetensors): `{results[-1].model.path}`",
              f"Previews: `{os.path.dirname(results[-1].previews[-1])}`" if results[-1].previews else "",
              f"Run store: `{os.path.join(store_root, 'dew.duckdb')}` (samples: "
              "`dew sql \"SELECT update, avg(reward) FROM samples GROUP BY update ORDER BY update\"`)",
              f"Wall time: {seconds:.0f} s"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the pipeline with its defaults, `--name`, `--seed` and `--root` overridable; without a
    configured Prefect API, on a temporary server that dies with this process."""
    if not {"-h", "--help"} & set(argv):
        lifetimes.temporary_prefect_server()
    def run() -> None:
        outcome = flow_grpo_pipeline(command_line(argv, FlowPipelineParams(), prog="python -m flows.flow_grpo",
                                                  description=__doc__.split("\n")[0]))
        print({k: outcome[k] for k in ("run", "model", "seconds")})

    return refusal_exit("python -m flows.flow_grpo", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
