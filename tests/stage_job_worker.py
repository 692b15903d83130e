"""One process of a stage's job (tasks/stage_job.py) that can crash once, for
tests/test_stage_processes.py, which puts it in place of `python -m tasks.stage_job`.

usage: python stage_job_worker.py JOB_FILE

With DEW_TEST_CRASH=MARKER:PROCESS:STEP set, process PROCESS of the job SIGKILLs itself, as a
crash would, when it reads the batch of STEP (1-based, so STEP - 1 steps are done), unless MARKER
exists; it creates MARKER first, so the job the task's retry launches runs through.
"""

import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class CrashingStream:
    """A training stream that kills this process before it hands out the batch of `step`."""

    def __init__(self, inner, position: int, step: int, marker: str):
        self.inner, self.next_step, self.step, self.marker = inner, position + 1, step, marker

    def __iter__(self):
        return self

    def __next__(self):
        if self.next_step == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        self.next_step += 1
        return next(self.inner)

    def __getattr__(self, name):  # state() and seek(), for checkpoints
        return getattr(self.inner, name)


def install_crash() -> None:
    spec = os.environ.get("DEW_TEST_CRASH")
    if not spec:
        return
    marker, process, step = spec.rsplit(":", 2)
    if os.environ.get("DEW_PROCESS_ID") != process:
        return
    from dew_lib.data.dataset import Dataset  # imports only: nothing computes before initialize()

    original = Dataset.stream

    def stream(self, partition, position=0, state=None):
        return CrashingStream(original(self, partition, position, state), position, int(step), marker)

    Dataset.stream = stream


if __name__ == "__main__":
    install_crash()
    from tasks.stage_job import main

    sys.exit(main(sys.argv[1:]))
