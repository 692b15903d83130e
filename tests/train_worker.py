"""A training run in its own process, for tests that kill it or give it 8 host devices.

python tests/train_worker.py OUT.npz [--directory D] [--steps N] [--batch B] [--pause S]
Writes the final state's leaves to OUT.npz; prints one line per finished step.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from conftest import tiny_model  # noqa: E402

from dew_lib import Dataset, LMObjective, Trainer  # noqa: E402


def batches(batch, seed=7):
    rng = np.random.default_rng(seed)
    while True:
        text = rng.integers(1, 32, size=(batch, 9)).astype(np.int32)
        real = rng.integers(2, 10, size=batch)
        segments = (np.arange(9)[None] < real[:, None]).astype(np.int32)
        yield {"text": text * segments, "text_segment_ids": segments}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--directory")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.0)
    args = parser.parse_args()

    def slow(state, batch, key):  # gives a test time to kill the process between steps
        time.sleep(args.pause)
        return batch

    trainer = Trainer(LMObjective(tiny_model(), seq_len=8, ema_decay=0.9), optax.adam(1e-2),
                      key=jax.random.key(0), accumulate=args.accumulate,
                      rollout=slow if args.pause else None)
    state = trainer.fit(Dataset(train=lambda p: batches(args.batch), batch=args.batch),
                        steps=args.steps, log_every=1, directory=args.directory,
                        checkpoint_every=1 if args.directory else None)
    leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))}
    np.savez(args.out, **leaves)
    print("devices", jax.device_count(), "done", int(state.step), flush=True)


if __name__ == "__main__":
    main()
