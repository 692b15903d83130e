"""Run the pipeline flow in its own process (for kill and resume tests).

usage: python pipeline_worker.py PARAMS_JSON [--kill-at STAGE:STEP]

With --kill-at, the process SIGKILLs itself when STAGE logs STEP, as a crash would, leaving
whatever checkpoints and store rows were written by then. Prints the outcome as JSON last.
"""

import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    from tasks import lifetimes

    lifetimes.temporary_prefect_server()  # as `python -m flows` does: it dies with this process
    from flows.pipeline import pipeline
    from tasks import ui
    from tasks.params import PipelineParams

    params = PipelineParams(**json.loads(sys.argv[1]))
    if len(sys.argv) > 3 and sys.argv[2] == "--kill-at":
        stage, step = sys.argv[3].split(":")
        original = ui.Deadline.write

        def write(self, at, metrics):
            original(self, at, metrics)
            if self.stage == stage and at >= int(step):
                os.kill(os.getpid(), signal.SIGKILL)

        ui.Deadline.write = write
    outcome = pipeline(params)
    print(json.dumps(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main())
