"""CodeReward: run the last fenced python block of a completion against tests in a SandboxFleet.

The reward has verl's `compute_score` signature, `reward(data_source, completion, ground_truth,
extra_info) -> float`, and is safe to call from many threads at once. The ground truth (a JSON
string, or the already-parsed value) picks the test style by its shape:

- `[{"stdin": ..., "stdout": ...}, ...]`: the block is a program, run once per case with that
  stdin; reward: the fraction of cases that exit 0 with stdout equal line by line.
- `{"test": ..., "entry_point": ...}` (a HumanEval row): the block defines the function and the
  row's `check(candidate)` is called on it; reward 1.0 or 0.0 (one check).
- `{"test_list": [...], "test_setup_code": ...}` (an MBPP row) or a list of assert strings: the
  block defines the functions and each assert runs after it; reward: the fraction that pass.

Whole dataset rows work as ground truth (extra keys are ignored), so HumanEval's and MBPP's
JSON lines can be passed as they are. "Line by line" means both outputs split into lines, each
line's trailing whitespace dropped, and trailing empty lines dropped. all_or_nothing=True turns
any fraction below 1 into 0.

Assert-style tests run in one process with the completion: the block is executed as module
`solution` (so its `if __name__ == "__main__":` part does not run), then the setup code, then
each test, and a test counts only if the harness reports it with a random token the completion
never sees on stdin or in its files, so exiting early (`sys.exit(0)`, `os._exit(0)`) or printing
"passed" earns nothing. Code that digs the token out of the harness's frames, or returns objects
whose `==` is always true, can still pass: the sandbox contains such code, the reward cannot
make assert-style tests adversarially sound.

No closed ```python (or ```py, ```python3) block: reward 0.0, nothing runs. A malformed ground
truth raises ValueError; a sandbox failure raises; a program that fails is just a lower reward.

What ran: `reward.last_runs()` returns the programs of the latest call made on the calling
thread, as `ProgramRun`s (name, the sandbox's Outcome, cases or tests passed of total), so a
caller that records rewards can store each program's verdict beside the score. The return type
of the call stays a float, and threads never see each other's runs.

Not here: math answers (MathReward), the sandbox itself (dew_lib.sandbox).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import threading
from collections.abc import Sequence
from typing import Any

from dew_lib.sandbox import Outcome, Program, Verdict

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)\n?[ \t]*```", re.DOTALL | re.IGNORECASE)

# The harness for assert-style tests. It reads its token before the completion runs and reports
# each passing test on a duplicate of stdout that it took before the completion could touch it.
HARNESS = '''\
import json, os, sys


def main():
    token = sys.stdin.readline().strip()
    report = os.dup(1)
    with open("tests.json") as f:
        spec = json.load(f)
    namespace = {"__name__": "solution"}
    try:
        with open("solution.py") as f:
            source = f.read()
        exec(compile(source, "solution.py", "exec"), namespace)
        if spec["setup"]:
            exec(compile(spec["setup"], "setup.py", "exec"), namespace)
    except BaseException as error:
        print(f"solution failed: {type(error).__name__}: {error}", file=sys.stderr)
        return
    for index, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"test_{index}.py", "exec"), namespace)
        except BaseException as error:
            print(f"test {index} failed: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        os.write(report, f"\\n{token} {index}\\n".encode())


main()
'''


@dataclasses.dataclass(frozen=True)
class ProgramRun:
    """One program CodeReward ran for a completion.

    name: "case <i>" for the i-th stdin/stdout case, "tests" for the one run of assert-style tests.
    outcome: the sandbox's Outcome; for assert-style tests the harness's report lines are taken
        out of its stdout, so it holds what the completion printed.
    passed, total: the cases (0 or 1 of 1) or asserts (k of n) this program passed.
    """

    name: str
    outcome: Outcome
    passed: int
    total: int

    @property
    def score(self) -> float:
        return self.passed / self.total


@dataclasses.dataclass(frozen=True)
class _Cases:
    """stdin/stdout cases."""

    cases: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class _Asserts:
    """Test snippets run after the solution and the setup code."""

    tests: tuple[str, ...]
    setup: str = ""


def last_python_block(completion: str) -> str | None:
    """The body of the last closed ```python block in `completion`, or None."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else None


def parse_tests(ground_truth: Any) -> _Cases | _Asserts:
    """Tell the test style apart by the ground truth's shape (see the module docstring)."""
    value = ground_truth
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"CodeReward ground_truth must be JSON (a list of {{'stdin', 'stdout'}} cases, "
                             f"a HumanEval or MBPP row, or a list of asserts); got {_short(ground_truth)}: "
                             f"{error}") from None
    if isinstance(value, dict):
        if "test" in value and "entry_point" in value:
            test, entry = value["test"], value["entry_point"]
            if not isinstance(test, str) or not isinstance(entry, str) or not entry.isidentifier():
                raise ValueError(f"CodeReward ground_truth 'test' must be code and 'entry_point' a function "
                                 f"name; got {_short(value)}")
            return _Asserts((f"{test}\n\ncheck({entry})\n",))
        if "test_list" in value:
            tests, setup = value["test_list"], value.get("test_setup_code") or ""
            if not _strings(tests) or not isinstance(setup, str):
                raise ValueError(f"CodeReward ground_truth 'test_list' must be a non-empty list of assert "
                                 f"strings and 'test_setup_code' a string; got {_short(value)}")
            return _Asserts(tuple(tests), setup)
        raise ValueError(f"CodeReward ground_truth object needs 'test' and 'entry_point' (HumanEval) or "
                         f"'test_list' (MBPP); got keys {sorted(value)}")
    if isinstance(value, list) and value:
        if _strings(value):
            return _Asserts(tuple(value))
        if all(isinstance(c, dict) and isinstance(c.get("stdin"), str) and isinstance(c.get("stdout"), str)
               for c in value):
            return _Cases(tuple((c["stdin"], c["stdout"]) for c in value))
    raise ValueError(f"CodeReward ground_truth must be a non-empty list of {{'stdin': str, 'stdout': str}} "
                     f"cases or of assert strings, or a HumanEval/MBPP row; got {_short(ground_truth)}")


def same_lines(actual: str, expected: str) -> bool:
    """Whether two outputs agree line by line, ignoring trailing spaces and trailing blank lines."""
    return _lines(actual) == _lines(expected)


class CodeReward:
    """Score a completion's last python block by running it in `fleet` (see the module docstring).

    fleet: a SandboxFleet (its runner and limits apply to every run).
    all_or_nothing: 1.0 only when every case passes, else 0.0.
    python: the interpreter's name or path inside the sandbox (default "python3" on its PATH).
    """

    def __init__(self, fleet, all_or_nothing: bool = False, *, python: str = "python3"):
        if not callable(getattr(fleet, "submit", None)):
            raise ValueError(f"CodeReward.fleet must be a SandboxFleet, got {fleet!r}")
        if not isinstance(all_or_nothing, bool):
            raise ValueError(f"CodeReward.all_or_nothing must be True or False, got {all_or_nothing!r}")
        if not isinstance(python, str) or not python:
            raise ValueError(f"CodeReward.python must name an interpreter, got {python!r}")
        self.fleet = fleet
        self.all_or_nothing = all_or_nothing
        self.python = python
        self._local = threading.local()

    def __call__(self, data_source: Any, completion: str, ground_truth: Any, extra_info: Any = None) -> float:
        self._local.runs = ()  # a call that raises or runs nothing leaves no stale runs behind
        tests = parse_tests(ground_truth)
        code = last_python_block(completion)
        if code is None:
            return 0.0
        if isinstance(tests, _Cases):
            runs = self._cases(code, tests.cases)
        else:
            runs = [self._asserts(code, tests)]
        self._local.runs = tuple(runs)
        passed, total = sum(r.passed for r in runs), sum(r.total for r in runs)
        if self.all_or_nothing:
            return float(passed == total)
        return passed / total

    def last_runs(self) -> tuple[ProgramRun, ...]:
        """The programs the latest call on this thread ran, in order (empty before any call, when
        the completion had no python block, or when the call raised)."""
        return getattr(self._local, "runs", ())

    def _cases(self, code: str, cases: Sequence[tuple[str, str]]) -> list[ProgramRun]:
        futures = [(self.fleet.submit(Program(files={"main.py": code}, argv=(self.python, "main.py"),
                                              stdin=stdin)), expected) for stdin, expected in cases]
        runs = []
        for index, (future, expected) in enumerate(futures):
            outcome = future.result()
            runs.append(ProgramRun(f"case {index}", outcome, int(_passed(outcome, expected)), 1))
        return runs

    def _asserts(self, code: str, tests: _Asserts) -> ProgramRun:
        token = secrets.token_hex(16)
        files = {"main.py": HARNESS, "solution.py": code,
                 "tests.json": json.dumps({"setup": tests.setup, "tests": list(tests.tests)})}
        outcome = self.fleet.submit(Program(files=files, argv=(self.python, "main.py"),
                                            stdin=token + "\n")).result()
        reported = set()
        for line in outcome.stdout.splitlines():
            head, _, index = line.partition(" ")
            if head == token and index.isdigit():
                reported.add(int(index))
        printed = re.sub(rf"\n?{token} \d+\n", "", outcome.stdout)
        passed = len(reported & set(range(len(tests.tests))))
        return ProgramRun("tests", dataclasses.replace(outcome, stdout=printed), passed, len(tests.tests))

    def __repr__(self):
        return f"CodeReward({self.fleet!r}, all_or_nothing={self.all_or_nothing})"


def _passed(outcome, expected: str) -> bool:
    return outcome.verdict is Verdict.COMPLETED and same_lines(outcome.stdout, expected)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, str) for t in value)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
