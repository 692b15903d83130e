"""An asynchronous GRPO run in its own process, recording to a run store, for the SIGKILL test.

python tests/scheduler_worker.py DIRECTORY --run N [--steps S] [--hang-at K]

The source answers at once and deterministically; its sampled ids carry the run number, so the
test can tell a session drawn by the first process from one drawn by the second. Every
submission is appended to DIRECTORY/draws.jsonl. With --hang-at K the process records step K's
rollouts, writes DIRECTORY/hanging and waits to be killed. On start it reuses, as a resumed
pipeline stage does, the sessions the store holds from before its checkpoint's step.
"""

import argparse
import json
import os
import sys
import threading
from concurrent.futures import Future

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from conftest import tiny_model  # noqa: E402

from dew_lib import Dataset, Trainer  # noqa: E402
from dew_lib.objectives import GRPOObjective  # noqa: E402
from dew_lib.records import Call, Session  # noqa: E402
from dew_lib.rollouts import RolloutScheduler  # noqa: E402
from dew_lib.store import Store  # noqa: E402
from dew_lib.train.checkpoint import Checkpoints  # noqa: E402

TASKS, GROUPS, EOS = 2, 2, 2


class InstantSource:
    """Completes every rollout at submission; also the weights publisher."""

    def __init__(self, run: int, log_path: str):
        self.run, self.version, self.log = run, 0, open(log_path, "a", encoding="utf-8")

    def load(self, variables, version):
        self.version = version

    def submit(self, task, *, group, sample, attempt, seed):
        self.log.write(json.dumps({"run": self.run, "task": task.id, "group": group, "sample": sample,
                                   "attempt": attempt}) + "\n")
        self.log.flush()
        call = Call(prompt_ids=[1, 3 + int(task.id) % 5], sampled_ids=[10 + self.run, 4 + sample, EOS],
                    behavior_log_probs=[-1.0, -1.5, -0.5], version=self.version)
        future = Future()
        future.set_result(Session(task=task.id, calls=(call,), reward=float(sample % 2)))
        return future

    def cancel(self, future):
        pass


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--run", type=int, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hang-at", type=int, default=-1)
    args = parser.parse_args()

    store = Store(os.path.join(args.directory, "project"))
    checkpoints = os.path.join(args.directory, "checkpoints")
    resumed = None
    if os.path.isdir(checkpoints):
        existing = Checkpoints(checkpoints)
        resumed = existing.latest()
        existing.close()
    objective = GRPOObjective(tiny_model(), seq_len=7, behavior_importance=2.0)
    source = InstantSource(args.run, os.path.join(args.directory, "draws.jsonl"))
    with store.writer("run") as run_writer, run_writer.stage("grpo", kind="grpo") as stage:
        scheduler = RolloutScheduler(
            objective, source, source, width=8, rows=TASKS * GROUPS, groups=GROUPS,
            log=stage.record,
            session_log=lambda log: stage.sessions(log.sessions, update=log.update, causes=log.causes,
                                                   latencies=log.latencies, trained=log.trained))
        if resumed is not None:  # read what the killed run finished before dropping its later rows
            reused = scheduler.reuse(store.resumable_sessions("run", "grpo", updates=resumed,
                                                              max_lag=scheduler.max_lag))
            print(f"offered {reused}", flush=True)
            stage.discard_after(resumed)

        def rollout(state, batch, key):
            packed = scheduler(state, batch, key)
            step = int(state.step)
            print(f"step {step} reused {scheduler.last_record.metrics['sessions/reused']:.0f}", flush=True)
            if step == args.hang_at:
                stage.flush()
                with open(os.path.join(args.directory, "hanging"), "w") as marker:
                    marker.write(str(step))
                threading.Event().wait()  # until SIGKILL
            return packed

        ids = np.arange(10_000, dtype=np.int64).reshape(-1, TASKS)
        data = Dataset(train=lambda partition: ({"task_id": row} for row in ids), batch=TASKS)
        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), rollout=rollout)
        trainer.fit(scheduler.tasks(data), steps=args.steps, log_every=1, directory=checkpoints,
                    checkpoint_every=1, sinks=[stage.sink()])
        scheduler.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
