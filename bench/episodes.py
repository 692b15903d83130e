"""What the episode journal costs per turn: EpisodeRollout collections with and without it.

    .venv/bin/python bench/episodes.py [--tasks 4] [--groups 8] [--rounds 12] [--directory DIR]

A cohort of `tasks x groups` square-tool episodes (tests/tool_workers/journal_square.py, one
SubprocessEnvironment worker process per episode) sampled by the tiny decoder of
tests/test_tool_episodes.py, taught the tool's protocol first (a short SFT), so most episodes call
the tool and then answer. Rounds alternate a collection with an `EpisodeJournal` and one without
(the same key, so the same turns; each side goes first every other round); each side's time is
the median over rounds, divided by the turns a collection takes. A turn's time includes its
share of starting the worker processes, resetting them, sampling and the tool's answer. With the
journal a collection also hashes the policy once, commits each round's draws, asks every
answered worker for `get_state()` and commits the answer with its snapshot (SQLite WAL,
synchronous=FULL, in --directory, default the system temporary directory). "commits" and
"get_state" add up those calls' time over all threads, much of it in parallel with other slots'
tool calls, so they are not on top of a turn. Target: the journal under 5% of a turn. The
machine's other load moves single rounds a lot; compare the shares, and run it twice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from bench.common import report, show_cpu  # noqa: E402
from dew_lib import Dataset, Trainer, models  # noqa: E402
from dew_lib.inference import TextGeneration  # noqa: E402
from dew_lib.objectives import LMObjective  # noqa: E402
from dew_lib.rollouts import EpisodeJournal, EpisodeRollout, SubprocessEnvironment  # noqa: E402
from dew_lib.sampling import Sampling  # noqa: E402
from dew_lib.sandbox import SandboxLimits  # noqa: E402

PAD, EOS, CALL, ANSWER, RESULT, QUERY = 0, 1, 2, 3, 4, 15
WORKER = ROOT / "tests" / "tool_workers" / "journal_square.py"
MODEL = models.build("causal_transformer", vocab_size=16, emb_features=32, num_layers=2, num_heads=4,
                     mlp_features=64, max_seq_len=16)


def protocol_policy(steps: int) -> dict:
    """The decoder after SFT on `QUERY d CALL d EOS RESULT r ANSWER r EOS` and on guesses
    `QUERY d ANSWER g EOS` (tests/test_tool_episodes.py's `trained_policy`)."""
    digit = lambda d: 5 + d  # noqa: E731
    called = [[QUERY, digit(d), CALL, digit(d), EOS, RESULT, digit(r), ANSWER, digit(r), EOS]
              for d in range(10) for r in range(10)]
    guessed = [[QUERY, digit(d), ANSWER, digit(g), EOS] for d in range(10) for g in range(10)]
    texts = np.array([row + [PAD] * (13 - len(row)) for row in called + guessed], np.int32)
    rng = np.random.default_rng(0)
    data = Dataset(train=lambda part: iter(lambda: {"text": texts[rng.choice(len(texts), 16)]}, None), batch=16)
    return Trainer(LMObjective(MODEL, seq_len=12, ema_decay=None), optax.adam(3e-3),
                   key=jax.random.key(0)).fit(data, steps=steps, sinks=[]).params


class Timed:
    """Adds up the seconds spent in the journal's commits and in the workers' get_state."""

    def __init__(self):
        self.commits = self.snapshots = 0.0

    def journal(self, directory: str) -> EpisodeJournal:
        journal, timed = EpisodeJournal(directory), self
        opened = journal.open_collection

        def open_collection(identity):
            log = opened(identity)
            for name in ("pending", "completed", "finished"):
                setattr(log, name, timed.clock("commits", getattr(log, name)))
            return log

        journal.open_collection = open_collection
        return journal

    def environments(self, factory):
        def make(task, identity):
            environment = factory(task, identity)
            environment.get_state = self.clock("snapshots", environment.get_state)
            return environment
        return make

    def clock(self, field: str, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--workers", type=int, default=8, help="EpisodeRollout threads for tool calls")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--directory", default=None, help="where the journal goes (default: a temporary directory)")
    args = parser.parse_args()
    show_cpu()
    policy = protocol_policy(args.sft_steps)
    timed = Timed()
    factory = timed.environments(SubprocessEnvironment((sys.executable, str(WORKER)), SandboxLimits(wall_seconds=120)))
    batch = {"task_id": np.arange(args.tasks, dtype=np.int32)}
    with tempfile.TemporaryDirectory(dir=args.directory) as directory, timed.journal(directory) as journal:
        def rollout(journal):
            return EpisodeRollout(TextGeneration(MODEL), factory, lambda task, episode: 0.0, max_prompt_tokens=12,
                                  max_new_tokens=3, max_turns=3, groups=args.groups, workers=args.workers,
                                  sampling=Sampling(temperature=1.0, eos_id=EOS), journal=journal)

        plain, journaled = rollout(None), rollout(journal)
        step = iter(range(1 << 30))

        def collect(collector) -> tuple[float, int]:
            start = time.perf_counter()
            results = collector.collect(policy, batch, jax.random.key(1), step=next(step))
            return time.perf_counter() - start, sum(len(r.episode.transitions) for r in results)

        collect(plain), collect(journaled)  # compile, warm the page cache
        timed.commits = timed.snapshots = 0.0
        with_journal, without = [], []
        for n in range(args.rounds):  # each side goes first every other round: no order bias
            if n % 2:
                without.append(collect(plain))
            with_journal.append(collect(journaled))
            if not n % 2:
                without.append(collect(plain))
    turns = with_journal[0][1]
    assert all(n == turns for _, n in with_journal + without), "the same key must give the same turns"
    on, off = (statistics.median(s for s, _ in side) * 1e3 / turns for side in (with_journal, without))
    per_round = [(a / b - 1) * 100 for (a, _), (b, _) in zip(with_journal, without, strict=True)]
    answered = args.rounds * turns
    report(f"journal overhead: {args.tasks} tasks x {args.groups} samples, {turns} turns per collection, "
           f"median of {args.rounds} alternating rounds", [
               ("without journal", f"{off:8.2f} ms per turn"),
               ("with journal", f"{on:8.2f} ms per turn"),
               ("overhead", f"{on - off:8.2f} ms per turn = {(on / off - 1) * 100:5.1f}% of a turn "
                            f"(rounds: {' '.join(f'{p:.1f}' for p in per_round)})"),
               ("  commits", f"{timed.commits * 1e3 / answered:8.2f} ms per turn (draws, answers, finish)"),
               ("  get_state", f"{timed.snapshots * 1e3 / answered:8.2f} ms per turn (worker round trips)"),
           ])
    print("\n" + json.dumps({"turns": turns, "ms_per_turn_with": on, "ms_per_turn_without": off,
                             "overhead": on / off - 1}))


if __name__ == "__main__":
    main()
