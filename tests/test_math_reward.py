"""MathReward: exact-rational answers, refusals, bounded work on hostile input, threads, GSM8K."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pytest
from conftest import SHARED_DATA

from dew_lib.rewards import MathReward
from dew_lib.rewards.math import MAX_ANSWER_CHARS, MAX_DEPTH, MAX_DIGITS, MAX_EXPONENT

reward = MathReward()
TIME_LIMIT = 0.5  # seconds per call on hostile input; a bounded reader takes about a millisecond


def score(completion, ground_truth):
    return reward("math", completion, ground_truth, None)


@pytest.mark.parametrize("answer, reference", [
    ("0.5", "1/2"),
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{1}{2}", "1/2"),
    ("\\tfrac12", "0.5"),
    (".5", "0.5"),
    ("-\\frac{3}{4}", "\\frac{-3}{4}"),
    ("- 0.75", "-3/4"),
    ("\\frac{\\frac{1}{2}}{3}", "1/6"),
    ("+7", "7"),
    ("18.0", "18"),
    ("18.00", "18"),
    ("18.", "18"),
    ("1,234", "1234"),
    ("1,234,567.5", "1234567.5"),
    ("1{,}234", "1234"),
    ("1\\,234", "1234"),
    ("1e3", "1000"),
    ("2.5 \\times 10^{3}", "2500"),
    ("4 \\cdot 10^{-2}", "1/25"),
    ("50\\%", "50%"),
    ("50 \\%", "50%"),
    ("5 \\text{ cm}", "5cm"),
    ("5\\,\\mathrm{cm}", "5 cm"),
    ("90^\\circ", "90°"),
    ("90^{\\circ}", "90\\circ"),
    ("x = 5", "5"),
    ("{5}", "5"),
    ("\\$18", "18"),
    ("$\\frac{7}{2}$", "3.5"),
    ("\\pi/2", "\\pi / 2"),  # not a number: equal text (spaces aside) agrees
    ("B", "B"),
])
def test_equivalent_answers_score_one(answer, reference):
    assert score(f"Work... so the answer is \\boxed{{{answer}}}.", reference) == 1.0


@pytest.mark.parametrize("answer, reference", [
    ("0.33", "1/3"),              # exact, not approximate
    ("0.3333333333", "1/3"),
    ("50\\%", "0.5"),             # a percent sign on one side only
    ("50", "50%"),
    ("5 cm", "5 m"),              # different units
    ("18 dollars", "18"),         # a unit on one side only
    ("1,23", "123"),              # not a thousands separator
    ("1,2345", "12345"),
    ("1/0", "0"),
    ("2", "3"),
    ("\\frac{1}{2}x", "1/2"),
    ("x+1", "1+x"),               # no symbolic equivalence
    ("1e101", "1"),               # an exponent beyond MAX_EXPONENT reads as nothing
])
def test_different_answers_score_zero(answer, reference):
    assert score(f"\\boxed{{{answer}}}", reference) == 0.0


def test_gsm8k_form_and_currency():
    assert score("16 - 3 - 4 = 9 eggs, 9 * 2 = 18\n#### 18", "18") == 1.0
    assert score("#### $18", "18") == 1.0       # verl's strict GSM8K scorer refuses this
    assert score("#### 18.00", "18") == 1.0     # and this
    assert score("#### 1,000\nthanks", "1000") == 1.0
    assert score("#### 17", "18") == 0.0


def test_the_last_box_counts_and_boxes_win_over_hashes():
    assert score("\\boxed{1} no, wait: \\boxed{2}", "2") == 1.0
    assert score("\\boxed{1} no, wait: \\boxed{2}", "1") == 0.0
    assert score("#### 5\n\\boxed{6}", "6") == 1.0
    assert score("\\boxed{6}\n#### 5", "6") == 1.0
    assert score("\\boxed{6}\n#### 5", "5") == 0.0
    assert score("#### 3\n#### 4", "4") == 1.0
    # a malformed last box scores 0; the earlier box is not consulted
    assert score("\\boxed{7} then \\boxed{7", "7") == 0.0
    assert score("\\boxed 8$ done", "8") == 1.0


@pytest.mark.parametrize("completion", ["", "The answer is 5.", "\\boxed{}", "####", "####   \n5",
                                        "\\boxedfoo{5}", "\\boxed{\\text{5}"])
def test_completions_without_a_readable_answer_score_zero(completion):
    assert score(completion, "5") == 0.0


@pytest.mark.parametrize("ground_truth", [
    "18", " 18 ", "\\boxed{18}", "Janet sells 9 eggs at $2 each.\n#### 18", 18, np.int64(18),
    18.0, Fraction(36, 2),
])
def test_reference_forms(ground_truth):
    assert score("\\boxed{18}", ground_truth) == 1.0
    assert score("\\boxed{19}", ground_truth) == 0.0


def test_float_references_read_through_their_shortest_decimal():
    assert score("\\boxed{0.1}", 0.1) == 1.0
    assert score("\\boxed{1/10}", 0.1) == 1.0


@pytest.mark.parametrize("ground_truth, error, match", [
    ("", ValueError, "holds no answer"),
    ("\\boxed{5", ValueError, "cannot be read"),
    ("1" * (MAX_ANSWER_CHARS + 1), ValueError, "longer than"),
    ("1" * (MAX_DIGITS + 1), ValueError, "digits"),
    (f"1e{MAX_EXPONENT + 1}", ValueError, "exponent"),
    ("\\frac{" * (MAX_DEPTH + 1) + "1" + "}{2}" * (MAX_DEPTH + 1), ValueError, "nested deeper"),
    (float("nan"), ValueError, "finite"),
    (None, TypeError, "NoneType"),
    (True, TypeError, "bool"),
])
def test_unusable_references_raise_naming_the_value(ground_truth, error, match):
    with pytest.raises(error, match=match):
        score("\\boxed{1}", ground_truth)


def test_a_completion_that_is_not_a_string_raises():
    with pytest.raises(TypeError, match="completion must be a str"):
        reward("math", b"\\boxed{1}", "1", None)


def test_limits_hold_at_their_edges():
    digits = "9" * MAX_DIGITS
    assert score(f"\\boxed{{{digits}}}", digits) == 1.0
    assert score(f"\\boxed{{{digits}9}}", "1") == 0.0
    assert score(f"\\boxed{{1e{MAX_EXPONENT}}}", 10 ** MAX_EXPONENT) == 1.0
    assert score(f"\\boxed{{1e-{MAX_EXPONENT}}}", Fraction(1, 10 ** MAX_EXPONENT)) == 1.0
    nested = "\\frac{" * (MAX_DEPTH - 1) + "1" + "}{2}" * (MAX_DEPTH - 1)
    assert score(f"\\boxed{{{nested}}}", f"1/{2 ** (MAX_DEPTH - 1)}") == 1.0


HOSTILE = {
    "100k digits boxed": "\\boxed{" + "9" * 100_000 + "}",
    "100k digits after ####": "#### " + "9" * 100_000,
    "100k digits, no marker": "9" * 100_000,
    "100k open braces": "\\boxed{" + "{" * 100_000,
    "100k nested braces": "\\boxed{" + "{" * 100_000 + "}" * 100_000 + "}",
    "5k nested fractions": "\\boxed{" + "\\frac{" * 5_000 + "1}{2}" * 5_000 + "}",
    "100k boxes": "\\boxed{" * 100_000,
    "huge exponent": "\\boxed{1e" + "9" * 100_000 + "}",
    "huge power of ten": "\\boxed{1\\times 10^{" + "9" * 100_000 + "}}",
    "100k thousands groups": "#### 1" + ",000" * 100_000,
    "100k backslashes": "\\boxed{" + "\\" * 100_000 + "}",
    "10 MB of text then an answer": "x" * 10_000_000 + "\\boxed{5}",
    "nested text wrappers": "\\boxed{" + "\\text{" * 10_000 + "5" + "}" * 10_001,
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_completions_return_quickly(name):
    completion = HOSTILE[name]
    start = time.perf_counter()
    value = score(completion, "5")
    elapsed = time.perf_counter() - start
    assert elapsed < TIME_LIMIT, f"{name}: {elapsed:.3f} s"
    assert value == (1.0 if name == "10 MB of text then an answer" else 0.0)


def test_hostile_references_raise_quickly():
    for ground_truth in ("9" * 100_000, "\\boxed{" + "{" * 100_000, "1e" + "9" * 100_000):
        start = time.perf_counter()
        with pytest.raises(ValueError):
            score("\\boxed{5}", ground_truth)
        assert time.perf_counter() - start < TIME_LIMIT


def test_many_threads_at_once_agree_with_one_thread():
    work = [(f"\\boxed{{{n}/{n + 1}}}", f"{n / (n + 1)!r}" if n % 4 == 0 else f"{n}/{n + 1}")
            for n in range(1, 200)]
    work += [(completion, "5") for completion in HOSTILE.values() if len(completion) < 1_000_000]
    work *= 4
    expected = [score(completion, reference) for completion, reference in work]
    with ThreadPoolExecutor(max_workers=16) as pool:
        got = list(pool.map(lambda item: score(*item), work))
    assert got == expected
    assert sum(expected) > 0 and min(expected) == 0.0


GSM8K = os.path.join(SHARED_DATA, "gsm8k", "test.jsonl")


@pytest.mark.skipif(not os.path.exists(GSM8K), reason="shared GSM8K data not found")
def test_gsm8k_answers_score_one_against_their_own_ground_truth():
    with open(GSM8K) as handle:
        rows = [json.loads(next(handle)) for _ in range(200)]
    for row in rows:
        solution = row["answer"]
        truth = solution.rsplit("####", 1)[1].strip()
        assert score(solution, truth) == 1.0, solution
        assert score(f"So the answer is \\boxed{{{truth}}}.", solution) == 1.0, solution
        assert score(solution, f"{Fraction(truth.replace(',', '')) + 1}") == 0.0, solution
