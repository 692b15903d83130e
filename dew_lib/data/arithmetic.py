"""The demo task: two-number arithmetic asked and answered in a chat template.

Small enough that a tiny decoder learns it on two CPU cores in minutes, with an answer that
is checked exactly (the last integer in the reply), so every stage's effect is measurable.
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


def solution(problem: Problem) -> str:
    expression = problem.question.removeprefix("What is ").removesuffix("?")
    return f"{expression} = {problem.answer}"


_INTEGER = re.compile(r"-?\d+")


def graded(reply: str, answer: int) -> bool:
    """True when the last integer in `reply` equals `answer`."""
    found = _INTEGER.findall(reply)
    return bool(found) and int(found[-1]) == answer
