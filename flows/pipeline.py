"""pipeline: data, then SFT, DPO and GRPO (or distill), each evaluated on held-out prompts; `make run`.

Each stage starts from the previous stage's final policy (DPO and GRPO freeze it as their
reference; distill learns from the frozen `distill.teacher`). Each stage works in the directory
of its inputs, runs/<name>/<stage>/<key[:12]>/ (tasks/storage.py): a rerun with the same name
and inputs reuses every finished stage, a failed or killed stage continues from its last
checkpoint there, and a stage whose inputs changed (its parameters, the data, the policy it
starts from, the seed) trains from step 0, and so does every stage after it. A rerun with the
same name, parameters and data files as the last run under that name is that run in the store,
finished or not: its next attempt (tasks/records.py).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.data_prep import data_prep
from flows.distill import distill
from flows.dpo import dpo
from flows.evaluate import evaluate
from flows.grpo import grpo, ppo
from flows.sft import sft
from tasks.initial_policy import initial_policy
from tasks.lengths import check_lengths
from tasks.params import DataParams, PipelineParams, command_line
from tasks.records import pipeline_run
from tasks.refusals import refusal_exit
from tasks.ui import artifact_key

STAGES = {"sft": sft, "dpo": dpo, "grpo": grpo, "ppo": ppo, "distill": distill}


@flow(name="pipeline")
def pipeline(params: PipelineParams = PipelineParams()) -> dict:
    logger = get_run_logger()
    started = time.perf_counter()
    directory = os.path.abspath(os.path.join(params.root, params.name))
    store_root = os.path.abspath(params.root)
    with pipeline_run(store_root, directory, params.name, params.model_dump(mode="json"),
                      inputs=data_files(params.data)) as (run, continued):
        if continued:
            logger.info("continuing run %s (same name, parameters and data files) as its next attempt: "
                        "its finished stages are reused, an interrupted one resumes", run)
        table, policy = _stages(params, directory, store_root, run)
    seconds = time.perf_counter() - started
    create_table_artifact(table, key=artifact_key(run, "accuracy"),
                          description="held-out accuracy after each stage")
    last = os.path.join(directory, params.stage_name(params.stages[-1])) if params.stages else None
    summary = _summary(table, policy.path, last, store_root, directory, seconds, run)
    create_markdown_artifact(summary, key=artifact_key(run, "summary"),
                             description="what the pipeline produced")
    logger.info("\n%s", summary)
    return {"run": run, "accuracy": {r["stage"]: r["accuracy"] for r in table},
            "sampled_accuracy": {r["stage"]: r["sampled_accuracy"] for r in table},
            "reused": {r["stage"]: r["reused"] for r in table}, "policy": policy.path,
            "seconds": seconds}


def data_files(data: DataParams) -> dict[str, list]:
    """Size and modification time of each file the data parameters name: with the parameters,
    what makes a rerun the same run, as they key the prepared data (tasks/data.py)."""
    fields = ("chat_path", "pairs_path", "prompts_path", "eval_path", "code_path")
    paths = {field: getattr(data, field) for field in fields}
    return {field: [os.path.getsize(path), os.path.getmtime(path)] for field, path in paths.items()
            if path and os.path.isfile(path)}


def _stages(params: PipelineParams, directory: str, store_root: str, run: str):
    """Every stage and its evaluation: the closing table's rows and the final policy."""
    data = data_prep(params.data, os.path.join(directory, "data"), params.seed)
    check_lengths(data, params)  # logs what each length cuts; refuses before anything trains
    policy = initial_policy(params.model, data, os.path.join(directory, "init"), params.seed)
    graded = {"reward": params.reward, "tools": params.tools}
    tracked = {**graded, "tracking": params.tracking}
    start = evaluate("start", policy, data, params.evaluation, directory, store_root, run, **tracked)
    table = [_row("start", start, start.cached)]  # its only work is the evaluation
    for stage in params.stages:
        name, options = params.stage_name(stage), getattr(params, stage)  # the RL stage: grpo's options
        rl = {**graded, **({"critic": params.ppo} if name == "ppo" else {})} if stage == "grpo" else {}
        result = STAGES[name](options, data, policy, os.path.join(directory, name), store_root, run, params.seed,
                              tracking=params.tracking, **rl)
        policy = result.policy
        steps = options.steps if result.steps is None else result.steps
        accuracy = evaluate(name, policy, data, params.evaluation, directory, store_root, run, steps, **tracked)
        table.append(_row(name, accuracy, result.cached))  # the stage reused, not its evaluation
    return table, policy


def _row(stage: str, result, reused: bool) -> dict:
    """A closing table row; `reused` is true only when the stage's inputs matched a finished
    result (the log says why each other stage trained, resumed or started from scratch)."""
    sampled = None if result.sampled_accuracy is None else round(result.sampled_accuracy, 4)
    return {"stage": stage, "accuracy": round(result.accuracy, 4), "sampled_accuracy": sampled,
            "answered": result.answered, "reused": bool(reused)}


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}%"


def shown_path(path: str) -> str:
    """`path` as a shell in this working directory reaches it: relative under it, else absolute."""
    relative = os.path.relpath(path)
    return shlex.quote(os.path.abspath(path) if relative.split(os.sep)[0] == os.pardir else relative)


def dew_command() -> str:
    """The `dew` of this environment as a shell here runs it (`.venv/bin/dew` after `make run`):
    the plain name only when PATH finds that very file."""
    script = os.path.join(os.path.dirname(sys.executable), "dew")
    if not os.path.exists(script):
        return f"{shown_path(sys.executable)} -m dew_lib.cli"
    found = shutil.which("dew")
    return "dew" if found and os.path.samefile(found, script) else shown_path(script)


def store_commands(store_root: str, run: str) -> list[str]:
    """Commands that list the run store's runs and query this run's stages, ready to paste."""
    dew, root = dew_command(), shown_path(store_root)
    query = f"SELECT stage, kind, status, attempt FROM stages WHERE run = '{run}' ORDER BY started_at"
    return [f"{dew} runs --store {root}", f'{dew} sql --store {root} "{query}"']  # a run id needs no quoting


def _summary(table, policy: str, last: str | None, store_root: str, directory: str,
             seconds: float, run: str) -> str:
    lines = ["| stage | held-out accuracy, greedy | sampled (mean of the drawn answers) | reused |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['stage']} | {_percent(r['accuracy'])} | {_percent(r['sampled_accuracy'])} | "
              f"{'yes' if r['reused'] else ''} |" for r in table]
    lines += ["", f"Final policy (Hugging Face format): `{policy}`"
              + (f", also `{last}/policy` until that stage runs with other inputs" if last else ""),
              f"Each stage's files: `{directory}/<stage>/latest/` (its last inputs; older input sets "
              f"beside it, see docs/pipeline.md)",
              f"Curves: `{directory}/<stage>/curves.png`", f"Wall time: {seconds:.0f} s",
              f"Run store: `{store_root}` (this run: `{run}`); list its runs, and query it (read-only):",
              *[f"- `{command}`" for command in store_commands(store_root, run)]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the pipeline with its defaults, `--name`, `--seed` and `--root` overridable; a run
    refused before it trains (tasks/refusals.py) prints why once and exits with status 1."""
    return refusal_exit("python -m flows", lambda: pipeline(command_line(
        argv, PipelineParams(), prog="python -m flows", description=__doc__.split("\n")[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
