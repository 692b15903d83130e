"""The reward of every row, picked by its `data_source`, for GRPO rollouts and evaluation alike.

| data_source | reward |
| --- | --- |
| `arithmetic`, `calculator`, `gsm8k`, `openai/gsm8k`, `math`, or none (`""`) | MathReward |
| `code`, `mbpp`, `humaneval` | CodeReward on a SandboxFleet (RewardParams.runner) |

Any other data_source is refused with the list above; add a line to SOURCES to grade it. The
sandbox starts on the first code row, with the runner RewardParams names and nothing else: a
machine without bubblewrap gets an error naming the fix, never a quieter runner in its place.
`TaskReward.last_runs()` gives the programs the latest call on the calling thread ran (none for
math), and `verdicts` turns them into the run store's Verdict rows.

Not here: the rewards themselves (dew_lib.rewards), the sandbox (dew_lib.sandbox), writing the
store (the tasks that score).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Sequence
from typing import Any

from dew_lib.rewards import CodeReward, MathReward, ProgramRun
from dew_lib.sandbox import (
    ContainerRunner,
    NamespaceRunner,
    ProcessRunner,
    SandboxFleet,
    SandboxLimits,
    SandboxUnavailable,
)
from dew_lib.store import Verdict
from tasks.params import RewardParams

SOURCES: dict[str, str] = {
    "": "math", "arithmetic": "math", "calculator": "math", "gsm8k": "math", "openai/gsm8k": "math", "math": "math",
    "code": "code", "mbpp": "code", "humaneval": "code",
}
DETAIL_CHARS = 1000  # output kept per verdict row: the tail, where the error usually is


def reward_kind(data_source: str) -> str:
    """'math' or 'code' for a data_source, or ValueError listing the known ones."""
    kind = SOURCES.get(str(data_source))
    if kind is None:
        known = ", ".join(repr(name) for name in SOURCES)
        raise ValueError(f"no reward is registered for data_source {data_source!r}; known: {known}. "
                         "Set the rows' data_source to one of them, or add it to tasks.rewards.SOURCES")
    return kind


def make_runner(params: RewardParams):
    """The sandbox runner RewardParams.runner names; SandboxUnavailable says how to get it."""
    try:
        if params.runner == "namespace":
            return NamespaceRunner()
        if params.runner == "container":
            return ContainerRunner(params.image)
        return ProcessRunner()
    except SandboxUnavailable as error:
        fix = {"namespace": "install bubblewrap (Debian: apt-get install bubblewrap; `make test` "
                            "does it as root) on the machine that runs the flow",
               "container": "start a Docker engine the flow's user can reach"}[params.runner]
        raise SandboxUnavailable(
            f"RewardParams.runner={params.runner!r} cannot run code here: {error}. To fix it, "
            f"{fix}, or choose another runner: 'container' (Docker) or 'process' (rlimits only, "
            "no isolation: for code you trust)") from error


class TaskReward:
    """`reward(data_source, completion, ground_truth, extra_info) -> float` over SOURCES.

    Safe on many threads at once. Close it (or use `with`) to stop the sandbox's threads.
    """

    def __init__(self, params: RewardParams = RewardParams()):
        self.params = params
        self.math = MathReward()
        self._code: CodeReward | None = None
        self._fleet: SandboxFleet | None = None
        self._lock = threading.Lock()
        self._local = threading.local()

    def code(self) -> CodeReward:
        """The code reward, its sandbox started on first use."""
        with self._lock:
            if self._code is None:
                limits = SandboxLimits(wall_seconds=self.params.wall_seconds,
                                       memory_bytes=self.params.memory_mb << 20)
                self._fleet = SandboxFleet(make_runner(self.params), limits=limits,
                                           workers=self.params.workers)
                self._code = CodeReward(self._fleet, all_or_nothing=self.params.all_or_nothing)
            return self._code

    def __call__(self, data_source: Any, completion: str, ground_truth: Any, extra_info: Any = None) -> float:
        self._local.runs = ()
        if reward_kind(data_source) == "math":
            return self.math(data_source, completion, ground_truth, extra_info)
        code = self.code()
        score = code(data_source, completion, ground_truth, extra_info)
        self._local.runs = code.last_runs()
        return score

    def last_runs(self) -> tuple[ProgramRun, ...]:
        """The programs the latest call on this thread ran (none for a math row)."""
        return getattr(self._local, "runs", ())

    @property
    def workers(self) -> int:
        return self.params.workers or os.cpu_count() or 1

    def close(self) -> None:
        with self._lock:
            if self._fleet is not None:
                self._fleet.close()

    def __enter__(self) -> TaskReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verdicts(runs: Sequence[ProgramRun]) -> list[Verdict]:
    """The run store's rows for the programs of one scored completion."""
    return [Verdict(program=index, name=run.name, status=run.outcome.verdict.value,
                    passed=run.passed == run.total, score=run.score, seconds=run.outcome.seconds,
                    exit_code=run.outcome.exit_code, detail=output_tail(run))
            for index, run in enumerate(runs)]


def output_tail(run: ProgramRun, limit: int = DETAIL_CHARS) -> str:
    """How the program ended, then the end of its stderr and stdout: at most `limit` characters
    when `limit` leaves room for the first line."""
    outcome = run.outcome
    head = f"{outcome.detail}; passed {run.passed} of {run.total}"
    streams = [(name, text) for name, text in (("stderr", outcome.stderr), ("stdout", outcome.stdout))
               if text.strip()]
    room = limit - len(head) - sum(len(f"\n{name}: ...") for name, _ in streams)
    budget = max(room, 0) // max(len(streams), 1)
    parts = [head]
    for name, text in streams:
        cut = len(text) > budget
        parts.append(f"{name}: {'...' if cut else ''}{text[len(text) - budget:] if cut else text}")
    return "\n".join(parts)


def score_all(reward: TaskReward, rows: Sequence[dict], answers: Sequence[str]
              ) -> tuple[list[float], list[tuple[ProgramRun, ...]]]:
    """Score answers to evaluation rows on `reward.workers` threads: scores and programs, in order."""
    def one(pair):
        row, answer = pair
        score = reward(row.get("data_source", ""), answer, str(row["ground_truth"]),
                       str(row.get("extra_info", "")))
        return score, reward.last_runs()

    with concurrent.futures.ThreadPoolExecutor(max(1, min(reward.workers, len(rows)))) as pool:
        done = list(pool.map(one, zip(rows, answers, strict=True)))
    return [s for s, _ in done], [r for _, r in done]
