"""CodeReward: block extraction, the three test styles, HumanEval's canonical solutions scoring 1.0,
tricks that must earn nothing, and many threads scoring at once.
"""

import gzip
import json
import os
import threading

import pytest

from dew_lib.rewards import CodeReward
from dew_lib.rewards.code import last_python_block, parse_tests, same_lines
from dew_lib.sandbox import NamespaceRunner, ProcessRunner, SandboxFleet, SandboxLimits, SandboxUnavailable

LIMITS = SandboxLimits(wall_seconds=10, memory_bytes=512 << 20)


@pytest.fixture(scope="module")
def fleet():
    with SandboxFleet(ProcessRunner(), limits=LIMITS, workers=2) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def namespace_fleet():
    try:
        runner = NamespaceRunner()
    except SandboxUnavailable as error:
        pytest.skip(f"NamespaceRunner cannot run here: {error}")
    with SandboxFleet(runner, limits=LIMITS, workers=2) as fleet:
        yield fleet


def block(code):
    return f"Here is my answer.\n```python\n{code}\n```\nDone."


def humaneval(shared_data):
    with gzip.open(os.path.join(shared_data, "humaneval", "HumanEval.jsonl.gz"), "rt") as f:
        return [json.loads(line) for line in f]


def canonical(row):
    return block(row["prompt"] + row["canonical_solution"])


CASES = json.dumps([{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5\n", "stdout": "10"},
                    {"stdin": "-1 1\n", "stdout": "0\n"}])


def test_last_python_block():
    text = "```python\nfirst()\n```\nthen\n```py\nsecond()\n```\n```text\nnot code\n```\n```python\nunclosed()"
    assert last_python_block(text) == "second()"
    assert last_python_block("```Python3\nx = 1\n```") == "x = 1"
    assert last_python_block("no code here") is None
    assert last_python_block("```\nplain fence\n```") is None


def test_same_lines_ignores_trailing_space_and_blank_lines():
    assert same_lines("a \nb\n\n", "a\nb")
    assert not same_lines("a\nb", "a\n\nb")
    assert not same_lines("a", " a")


def test_stdin_stdout_cases_score_the_fraction_that_match(fleet):
    reward = CodeReward(fleet)
    right = block("a, b = map(int, input().split())\nprint(a + b)   ")
    assert reward("code", right, CASES, None) == 1.0
    wrong_on_negatives = block("a, b = map(int, input().split())\nprint(abs(a) + b)")
    assert reward("code", wrong_on_negatives, CASES, None) == pytest.approx(2 / 3)
    assert CodeReward(fleet, all_or_nothing=True)("code", wrong_on_negatives, CASES, None) == 0.0
    crashes_after_printing = block("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)")
    assert reward("code", crashes_after_printing, CASES, None) == 0.0
    assert reward("code", "print(3) without a fence", CASES, None) == 0.0


def test_parsed_ground_truth_works_too(fleet):
    cases = json.loads(CASES)
    assert CodeReward(fleet)("code", block("print(sum(map(int, input().split())))"), cases, {}) == 1.0


def test_humaneval_canonical_solutions_score_one(fleet, shared_data):
    rows = humaneval(shared_data)[:6]
    reward = CodeReward(fleet)
    assert [reward("humaneval", canonical(r), r, None) for r in rows] == [1.0] * 6
    # The ground truth can also be the row's two fields as JSON.
    gt = json.dumps({"test": rows[0]["test"], "entry_point": rows[0]["entry_point"]})
    assert reward("humaneval", canonical(rows[0]), gt, None) == 1.0


def test_humaneval_through_the_namespace_runner(namespace_fleet, shared_data):
    rows = humaneval(shared_data)[:3]
    reward = CodeReward(namespace_fleet)
    assert [reward("humaneval", canonical(r), r, None) for r in rows] == [1.0] * 3
    broken = block(rows[0]["prompt"] + "    return not any(numbers)\n")
    assert reward("humaneval", broken, rows[0], None) == 0.0


def test_humaneval_broken_solutions_score_less(fleet, shared_data):
    row = humaneval(shared_data)[2]  # truncate_number(3.5) == 0.5
    reward = CodeReward(fleet)
    assert reward("humaneval", canonical(row), row, None) == 1.0
    assert reward("humaneval", block(row["prompt"] + "    return number\n"), row, None) == 0.0
    assert reward("humaneval", block("def truncate_number(x):\n    return x % 1.0\n"), row, None) == 1.0
    with SandboxFleet(ProcessRunner(), limits=SandboxLimits(wall_seconds=1)) as quick:
        hangs = block("def truncate_number(x):\n    while True: pass\n")
        assert CodeReward(quick)("humaneval", hangs, row, None) == 0.0


def test_mbpp_rows_score_the_fraction_of_asserts(fleet, shared_data):
    with open(os.path.join(shared_data, "mbpp", "mbpp.jsonl")) as f:
        rows = [json.loads(line) for line in f][:4]
    reward = CodeReward(fleet)
    assert [reward("mbpp", block(r["code"]), json.dumps(r), None) for r in rows] == [1.0] * 4
    tests = ["assert square(1) == 1", "assert square(2) == 4", "assert square(3) == 9"]
    two_of_three = block("def square(x):\n    return 0 if x == 3 else x * x")
    assert reward("mbpp", two_of_three, {"test_list": tests, "test_setup_code": ""}, None) == pytest.approx(2 / 3)
    assert reward("mbpp", two_of_three, json.dumps(tests), None) == pytest.approx(2 / 3)
    assert CodeReward(fleet, all_or_nothing=True)("mbpp", two_of_three, tests, None) == 0.0


def test_mbpp_setup_code_runs_after_the_solution(fleet):
    truth = {"test_setup_code": "box = Box(3)", "test_list": ["assert box.twice() == 6"]}
    solution = block("class Box:\n    def __init__(self, v): self.v = v\n    def twice(self): return 2 * self.v")
    assert CodeReward(fleet)("mbpp", solution, truth, None) == 1.0


@pytest.mark.parametrize("trick", [
    "import sys\nsys.exit(0)",
    "import os\nos._exit(0)",
    "print('0'); print('1'); print('2')",
    "import builtins\nbuiltins.print = lambda *a, **k: None\ndef square(x): return -1",
    "if __name__ == '__main__':\n    raise SystemExit(0)\ndef square(x): return -1",
])
def test_tricks_that_skip_the_tests_earn_nothing(fleet, trick):
    tests = ["assert square(2) == 4", "assert square(3) == 9", "assert square(4) == 16"]
    assert CodeReward(fleet)("mbpp", block(trick), tests, None) == 0.0


def test_main_block_of_the_solution_does_not_run(fleet):
    solution = block("def square(x): return x * x\nif __name__ == '__main__':\n    input()\n    raise SystemExit(1)")
    assert CodeReward(fleet)("mbpp", solution, ["assert square(2) == 4"], None) == 1.0


@pytest.mark.parametrize("truth, message", [
    ("not json", "must be JSON"),
    ("[]", "non-empty list"),
    ('[{"stdin": "1"}]', "non-empty list of {'stdin': str, 'stdout': str}"),
    ('{"question": "?"}', "needs 'test' and 'entry_point' \\(HumanEval\\) or 'test_list' \\(MBPP\\)"),
    ('{"test": "def check(c): pass", "entry_point": "not a name"}', "'entry_point' a function name"),
    ('{"test_list": []}', "'test_list' must be a non-empty list"),
])
def test_malformed_ground_truth_is_refused(fleet, truth, message):
    with pytest.raises(ValueError, match=message):
        CodeReward(fleet)("code", block("print(1)"), truth, None)


def test_bad_arguments_are_refused(fleet):
    with pytest.raises(ValueError, match="fleet must be a SandboxFleet"):
        CodeReward(ProcessRunner())
    with pytest.raises(ValueError, match="all_or_nothing must be True or False, got 1"):
        CodeReward(fleet, all_or_nothing=1)


def test_many_threads_score_at_once_without_mixing_results(fleet):
    reward = CodeReward(fleet)
    scores, errors = {}, []

    def score(i):
        try:
            # Thread i's program is right on the first i % 4 of its 3 cases, or all when 3 or more.
            cases = [{"stdin": f"{k}\n", "stdout": f"{k * i}\n"} for k in range(3)]
            code = block(f"k = int(input())\nprint(k * {i} if k < {i % 4} else -1)")
            scores[i] = reward("code", code, json.dumps(cases), None)
        except Exception as error:  # surfaced by the assert below
            errors.append(error)

    threads = [threading.Thread(target=score, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert scores == {i: min(i % 4, 3) / 3 for i in range(12)}


@pytest.mark.slow
def test_all_humaneval_canonical_solutions_score_one(shared_data):
    rows = humaneval(shared_data)
    results = {}
    with SandboxFleet(ProcessRunner(), limits=LIMITS, workers=4) as fleet:
        reward = CodeReward(fleet)

        def score(chunk):
            for row in chunk:
                results[row["task_id"]] = reward("humaneval", canonical(row), row, None)

        threads = [threading.Thread(target=score, args=(rows[i::8],)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 164
    assert [k for k, v in results.items() if v != 1.0] == []


def test_parse_tests_tells_the_styles_apart():
    assert type(parse_tests('[{"stdin": "", "stdout": ""}]')).__name__ == "_Cases"
    assert parse_tests('["assert f() == 1"]').tests == ("assert f() == 1",)
    humaneval = parse_tests({"test": "def check(c): pass", "entry_point": "f"})
    assert humaneval.tests == ("def check(c): pass\n\ncheck(f)\n",)
    assert parse_tests({"test_list": ["assert g()"], "test_setup_code": "x = 1"}).setup == "x = 1"
