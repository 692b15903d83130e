"""GRPO on tool episodes in a process of its own, for tests/test_episode_recovery.py to kill.

usage: python episode_worker.py POLICY RUN STEPS

Trains from the pickled params POLICY for STEPS steps on two host devices (the caller sets
XLA_FLAGS=--xla_force_host_platform_device_count=2): Trainer + GRPOObjective + EpisodeRollout
with an EpisodeJournal in RUN/journal over SubprocessEnvironment workers running
tests/tool_workers/journal_square.py, one step call at a time (workers=1, so when a call hangs
every earlier call of the round has committed and no later one has started), checkpointing
every step in RUN/checkpoints. A rerun with the same RUN resumes from the last checkpoint and
the journal. $AUDIT and $SLEEP are handed to the tool workers (see the worker's docstring).

Writes RUN/collections.jsonl, a line per finished collection (its step, how many turns it
sampled from the policy, and every episode's actions and likelihoods), and RUN/params.pkl, the
final parameters.
"""

import itertools
import json
import os
import pickle
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew_lib import Dataset, Trainer, models  # noqa: E402
from dew_lib.inference import TextGeneration  # noqa: E402
from dew_lib.objectives import GRPOObjective  # noqa: E402
from dew_lib.rollouts import EpisodeJournal, EpisodeRollout, SubprocessEnvironment  # noqa: E402
from dew_lib.sampling import Sampling  # noqa: E402
from dew_lib.sandbox import SandboxLimits  # noqa: E402

# The model and protocol of tests/test_tool_episodes.py (not imported: that module needs pytest).
P, R, T, EOS = 12, 3, 3, 1
MODEL = models.build("causal_transformer", vocab_size=16, emb_features=32, num_layers=2, num_heads=4,
                     mlp_features=64, max_seq_len=16)
WORKER = os.path.join(HERE, "tool_workers", "journal_square.py")


def verify(task, episode):
    """1 for the answer the tool gives on the task's number, else 0."""
    right = (int(task.id) ** 2 + episode.identity.seed) % 10
    return float(episode.detail.startswith(f"answered {right} "))


class Counting:
    """TextGeneration that counts the turns it samples."""

    def __init__(self):
        self.inner, self.calls = TextGeneration(MODEL), 0

    def bind(self, snapshot):
        bound = self.inner.bind(snapshot)

        def sample(*args, **kwargs):
            self.calls += 1
            return bound(*args, **kwargs)

        sample.binding = bound.binding
        return sample


class Logged(EpisodeRollout):
    """EpisodeRollout that appends each finished collection to RUN/collections.jsonl."""

    def __init__(self, path, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.path = path

    def collect(self, snapshot, batch, key, *, step=0, policy_step=0):
        before = self.policy.calls
        results = super().collect(snapshot, batch, key, step=step, policy_step=policy_step)
        episodes = [[r.episode.identity.task, r.episode.identity.sample, r.episode.status.value, r.episode.detail,
                     [[t.action.tokens.tolist(), t.action.raw_log_probs.tolist(),
                       t.action.behavior_log_probs.tolist()] for t in r.episode.transitions]] for r in results]
        with open(self.path, "a") as out:
            out.write(json.dumps({"step": step, "policy_calls": self.policy.calls - before,
                                  "episodes": episodes}) + "\n")
        return results


def main(policy_path: str, run: str, steps: int) -> None:
    assert jax.local_device_count() == 2, "set XLA_FLAGS=--xla_force_host_platform_device_count=2"
    with open(policy_path, "rb") as f:
        policy = pickle.load(f)
    workers = SubprocessEnvironment((sys.executable, WORKER), SandboxLimits(wall_seconds=300),
                                    env={name: os.environ[name] for name in ("AUDIT", "SLEEP") if name in os.environ})
    with EpisodeJournal(os.path.join(run, "journal")) as journal:
        rollout = Logged(os.path.join(run, "collections.jsonl"), Counting(), workers, verify, max_prompt_tokens=P,
                         max_new_tokens=R, max_turns=T, groups=4, sampling=Sampling(temperature=1.0, eos_id=EOS),
                         workers=1, journal=journal)
        def batches(part):
            return ({"task_id": np.array([i % 10, (i + 3) % 10], np.int32)} for i in itertools.count())

        trainer = Trainer(GRPOObjective(MODEL, seq_len=P + R - 1, pretrained=policy), optax.adam(5e-4),
                          key=jax.random.key(0), rollout=rollout)
        state = trainer.fit(Dataset(train=batches, batch=2), steps=steps, log_every=1,
                            directory=os.path.join(run, "checkpoints"), checkpoint_every=1, sinks=[])
    with open(os.path.join(run, "params.pkl"), "wb") as f:
        pickle.dump(jax.device_get(state.params), f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
