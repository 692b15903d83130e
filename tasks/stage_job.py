"""A text stage (SFT, DPO, the RL stage in any mode, distillation) as a multi-process JAX job: the
job file, launching it from the training task, and the entry point each process runs.

`train_stage` (tasks/train.py) with `processes > 1` writes a `StageJob` to `job.json` in the
stage's directory and runs `python -m tasks.stage_job <job.json>` as that many processes through
`dew_lib.train.launch.launch`, then waits. Every process joins the job (`distributed.initialize`,
first), reads its own share of each batch and runs the same stage body as the in-process path
(`tasks.stage_run.run_stage`). Process 0 owns the stage's record in the run store, its policy,
metrics.jsonl, curves.png and result.json; the others only train. The job's output, each line
prefixed `[i] `, is appended to `job.log` in the stage's directory and logged through the task's
logger, and process 0's metric lines move the task's progress artifact. A failed process ends the
job, and the task raises with the end of the log, so its retries relaunch the job, which resumes
from the checkpoints the processes wrote together in the same directory.

A sync RL stage (GRPO or PPO, on prompts or tool episodes) and the distill stage record their
sessions through `GatheredWriter`: each step, every process's prompts and sessions (with their
episodes) are gathered (pickled, all-gathered: each process holds every process's rows for a
moment), and process 0 records them all, so the store holds every session of the global batch, as
one process drawing it would record them. (Their rollouts draw the job's whole batch on every
process and keep their own rows: SampledRollout, DistillRollout.)

Not here: the stage body (tasks/stage_run.py), joining and launching a job (dew_lib/train), what an
asynchronous stage records through (tasks/job_records.py).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from dew_lib.train import distributed
from dew_lib.train.launch import launch
from dew_lib.train.trackers import TrackerOptions
from tasks.manifests import DataManifest, PolicyRef, StageResult
from tasks.params import DistillParams, DPOParams, GRPOParams, PPOParams, RewardParams, SFTParams, ToolParams
from tasks.storage import read_json, write_json

ENTRY = ("-m", "tasks.stage_job")  # what each process runs after the interpreter; then the job file
TAIL_LINES = 40  # of the job's output, in the error of a failed job
PARAMS = {"sft": SFTParams, "dpo": DPOParams, "grpo": GRPOParams, "ppo": GRPOParams, "distill": DistillParams}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds tasks/ and dew_lib/


class StageJob(BaseModel):
    """Everything the stage body needs, as the job file holds it.

    params: the stage's parameters (`PARAMS[kind]`) as JSON. directory: the stage's keyed
    directory (runs/<name>/<stage>/<key[:12]>). key: its fingerprint. resumed: the checkpoint step
    it continues from (None: step 0), found in `directory`/checkpoints; written: where that
    checkpoint was first written (another input set's directory when only steps changed).
    tracking: the trackers process 0 also logs to, their directories resolved.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: str
    kind: Literal["sft", "dpo", "grpo", "ppo", "distill"]
    params: dict[str, Any]
    data: DataManifest
    start: PolicyRef
    directory: str
    key: str
    store_root: str
    run: str
    seed: int
    reward: RewardParams | None = None
    tools: ToolParams | None = None
    ppo: PPOParams | None = None
    resumed: int | None = None
    written: str | None = None
    tracking: TrackerOptions | None = None

    def stage_params(self) -> SFTParams | DPOParams | GRPOParams | DistillParams:
        return PARAMS[self.kind].model_validate(self.params)


# ----- the parent: launch and wait --------------------------------------------------------------

class _Output:
    """Where the job's prefixed lines go: appended to job.log, logged through the task's logger,
    and process 0's metric windows (`[0] <stage> step N: ...`) move the progress artifact."""

    def __init__(self, path: str, logger, stage: str, progress=None):
        self.file = open(path, "a", encoding="utf-8")
        self.logger, self.progress = logger, progress
        self.window = re.compile(rf"^\[0\] {re.escape(stage)} step (\d+): ")
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.partial = ""

    def write(self, text: str) -> None:
        self.file.write(text)
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.tail.append(line)
            self.logger.info("%s", line)
            found = self.window.match(line)
            if found and self.progress is not None:
                try:
                    self.progress.write(int(found[1]), {})
                except Exception as error:  # noqa: BLE001 - the relay must go on, or the job blocks on its pipe
                    self.logger.warning("the progress artifact stops moving: %s", error)
                    self.progress = None

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        if self.partial:
            self.write("\n")
        self.file.close()


def run_job(job: StageJob, processes: int, logger, progress=None) -> StageResult:
    """Run `job` as `processes` processes and wait; process 0's result. A failed job raises a
    RuntimeError with the end of its output (the whole of it is in `job.directory`/job.log)."""
    path = os.path.join(job.directory, "job.json")
    write_json(path, job.model_dump(mode="json"))
    log_path = os.path.join(job.directory, "job.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    logger.info("%s trains as a job of %d processes (%s); their output also goes to %s", job.stage,
                processes, " ".join(["python", *ENTRY, path]), log_path)
    out = _Output(log_path, logger, job.stage, progress)
    try:
        out.file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: {processes} processes, "
                       f"{'resuming at step ' + str(job.resumed) if job.resumed is not None else 'from step 0'}\n")
        code = launch([sys.executable, *ENTRY, path], processes, env=env, out=out)
    finally:
        out.close()
    if code != 0:
        tail = "\n".join(out.tail)
        raise RuntimeError(f"{job.stage}: the job of {processes} processes failed (exit code {code}); a retry "
                           f"resumes from the last checkpoint it wrote, if any. The end of its output "
                           f"({log_path}):\n{tail}")
    done = read_json(os.path.join(job.directory, "result.json"))
    if done is None or done.get("fingerprint") != job.key:
        raise RuntimeError(f"{job.stage}: the job of {processes} processes exited 0 but process 0 wrote no "
                           f"result.json for these inputs in {job.directory}; see {log_path}")
    return StageResult(**done["result"])


# ----- inside the job ---------------------------------------------------------------------------

def _joined(values: Sequence[Any], counts: Sequence[int]) -> Any:
    """Each process's per-session argument -> the argument for all their sessions: None when
    none gave one, the shared value when all gave the same single one, else one per session."""
    if all(v is None for v in values):
        return None
    if not any(isinstance(v, (list, tuple)) for v in values) and all(v == values[0] for v in values):
        return values[0]
    out: list = []
    for value, count in zip(values, counts, strict=True):
        out.extend(value if isinstance(value, (list, tuple)) else [value] * count)
    return out


class GatheredWriter:
    """What a sync RL or distill stage's rollout records through in a job: every process calls
    `prompts` and `sessions` with its own rows, in the same order (RecordedRollout does, once a
    step), and process 0 writes every process's rows, in process order, to the stage's writer.

    writer: the stage's StageWriter on process 0, None on the others.
    """

    def __init__(self, writer):
        self.writer = writer

    def prompts(self, prompts, *, update: int, decode=None) -> int:
        every = distributed.every_process(list(prompts))
        if self.writer is None:
            return 0
        return self.writer.prompts([p for part in every for p in part], update=update, decode=decode)

    def sessions(self, sessions, *, update: int, latencies=None, causes=None, trained=None,
                 truncation: str = "mask", verdicts=None, episodes=None) -> None:
        given = (latencies, causes, trained, verdicts, episodes)
        parts = distributed.every_process(
            (list(sessions), *(list(x) if isinstance(x, (list, tuple)) else x for x in given)))
        if self.writer is None:
            return
        counts = [len(part[0]) for part in parts]
        latencies, causes, trained, verdicts, episodes = (_joined([part[i] for part in parts], counts)
                                                          for i in range(1, 6))
        self.writer.sessions([s for part in parts for s in part[0]], update=update, latencies=latencies,
                             causes=causes, trained=trained, truncation=truncation, verdicts=verdicts,
                             episodes=episodes)


class JobEnded(RuntimeError):
    """dew launch ended this process (SIGTERM): another process of the job failed, or the job was
    stopped. Raised so process 0 records its stage as failed before it exits."""


def _ended(signal_number, _frame):
    if sys.exc_info()[1] is not None:
        return  # already failing (a collective saw the other process die): let the store record why
    raise JobEnded(f"ended by signal {signal.Signals(signal_number).name}: another process of the job "
                   "failed, or the job was stopped")


def _logger(primary: bool) -> logging.Logger:
    """Plain lines on stdout, which the launcher prefixes and the task logs; only process 0 says
    what the stage does (the others warn)."""
    logger = logging.getLogger("tasks.stage_job")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO if primary else logging.WARNING)
    return logger


def main(argv: list[str]) -> int:
    """One process of the job: `python -m tasks.stage_job JOB_FILE`."""
    distributed.initialize()  # first: nothing may have computed with JAX before it
    signal.signal(signal.SIGTERM, _ended)
    from tasks.stage_run import run_stage

    if len(argv) != 1:
        print("usage: python -m tasks.stage_job JOB_FILE (tasks/train.py writes it)", file=sys.stderr)
        return 2
    job = StageJob.model_validate(read_json(argv[0]))
    primary = distributed.is_primary()
    logger = _logger(primary)
    try:
        run_stage(job, logger, progress=False)
    except BaseException:  # the store has recorded the failure; run_stage closed what it opened
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # Not through interpreter exit: JAX's shutdown waits there for every process of the job,
        # and the one that failed first may be dead, so this one would wait until it is killed.
        os._exit(1)
    return 0


if __name__ == "__main__":
    from tasks.stage_job import main as job_main  # the module under its package name, not __main__

    sys.exit(job_main(sys.argv[1:]))
