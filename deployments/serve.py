"""The deployments, served from this process: the pipeline (also preset to the calculator tool
task, `tool-episodes`) and the image pipeline to start from the UI with edited parameters, and a
nightly retraining on a cron schedule. `make ui` runs this
beside a local Prefect server; on a team's server, run it (or `prefect deploy` with prefect.yaml
and a process worker) where the repository and its data are.

Prefect's runner starts each flow run as a child process of this one; such a child ends when
this process does, also when this one is killed with SIGKILL (it watches this process from the
moment it imports the flows package, tasks/lifetimes.py). SIGTERM stops the runner, which ends its
flow runs first. Started by `make ui`, this process ends with deployments/ui.py the same way.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # flows/ and tasks/ import the same way from here as from make run
    sys.path.insert(0, ROOT)

from tasks.lifetimes import children_exit_with_me, exit_with_marked_parent, quiet_prefect  # noqa: E402

quiet_prefect()  # before Prefect is imported
if __name__ == "__main__":
    exit_with_marked_parent()  # started by make ui: ends with it, at most 15 s after it
    children_exit_with_me()  # the flow runs started from here end with this process

from prefect import serve  # noqa: E402

from flows.flow_grpo import flow_grpo_pipeline  # noqa: E402
from flows.pipeline import pipeline  # noqa: E402
from flows.retrain import retrain  # noqa: E402

RETRAIN_CRON = os.environ.get("DEW_RETRAIN_CRON", "0 3 * * *")
TOOL_EPISODES = {"params": {"name": "tools", "data": {"source": "tools"}, "stages": ["sft", "grpo"]}}


def deployments():
    return [
        pipeline.to_deployment(
            name="pipeline", tags=["dew"],
            description="Data prep, SFT, DPO, GRPO and evaluation; edit any parameter in the form"),
        pipeline.to_deployment(
            name="tool-episodes", tags=["dew"], parameters=TOOL_EPISODES,
            description="The pipeline on the calculator task: SFT, then GRPO on tool episodes"),
        flow_grpo_pipeline.to_deployment(
            name="flow-grpo", tags=["dew"],
            description="Flow-matching pre-training of a small diffusion transformer, then Flow-GRPO"),
        retrain.to_deployment(
            name="retrain-nightly", cron=RETRAIN_CRON, tags=["dew"],
            description="Retrain on the current data; promote only when held-out accuracy improves"),
    ]


if __name__ == "__main__":
    serve(*deployments())
