"""The demo task: two-number arithmetic asked and answered in a chat template.

Small enough that a tiny decoder learns it on two CPU cores in minutes, with an answer that is
checked exactly, so every stage's effect is measurable. Answers end in `\boxed{n}`, the form
`MathReward` grades, and `near_misses` gives the plausible wrong answers DPO pairs reject.
"""

from __future__ import annotations

import dataclasses
import random
import re


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str
    answer: int

    def messages(self, with_answer: bool = True) -> list[dict[str, str]]:
        turns = [{"role": "user", "content": self.question}]
        if with_answer:
            turns.append({"role": "assistant", "content": solution(self)})
        return turns


def problems(count: int, seed: int, largest: int = 99) -> list[Problem]:
    """`count` addition and subtraction problems with operands in [0, largest]."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, largest), rng.randint(0, largest)
        if rng.random() < 0.5:
            out.append(Problem(f"What is {a} + {b}?", a + b))
        else:
            a, b = max(a, b), min(a, b)
            out.append(Problem(f"What is {a} - {b}?", a - b))
    return out


def products(count: int, seed: int, low: int = 10, high: int = 99) -> list[Problem]:
    """`count` multiplication problems with operands in [low, high]: beyond what the embedded
    decoder learns to compute, and exact with a calculator (the pipeline's tool task)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(low, high), rng.randint(low, high)
        out.append(Problem(f"What is {a} * {b}?", a * b))
    return out


def expression(problem: Problem) -> str:
    """The problem's arithmetic, `a + b`."""
    return problem.question.removeprefix("What is ").removesuffix("?")


def solution(problem: Problem, answer: int | None = None) -> str:
    """The worked answer, `a + b = \boxed{c}` (with `answer` in place of the right one if given)."""
    return f"{expression(problem)} = \\boxed{{{problem.answer if answer is None else answer}}}"


def near_misses(problem: Problem, rng: random.Random, count: int = 1) -> list[int]:
    """Wrong answers a model that half-learned the task gives: off by one or ten, digits swapped."""
    a = problem.answer
    swapped = int(str(abs(a))[::-1]) * (1 if a >= 0 else -1)
    options = sorted({a + 1, a - 1, a + 10, a - 10, swapped} - {a})
    options = [o for o in options if o >= 0] or [a + 1]
    return rng.sample(options, min(count, len(options)))


_INTEGER = re.compile(r"-?\d+")


def graded(reply: str, answer: int) -> bool:
    """True when the last integer in `reply` equals `answer`."""
    found = _INTEGER.findall(reply)
    return bool(found) and int(found[-1]) == answer
