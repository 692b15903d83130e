"""The generated arithmetic task: a careless teacher's SFT answers, and keys that stay put."""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tasks.data import GENERATOR_VERSION, _generator_params, generate_arithmetic  # noqa: E402
from tasks.manifests import fingerprint  # noqa: E402
from tasks.params import DataParams  # noqa: E402

QUESTION = re.compile(r"What is (\d+) ([+-]) (\d+)\?")


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def _taught_answers(path: str) -> list[tuple[int, int]]:
    """(true answer, taught answer) of every SFT conversation."""
    out = []
    for row in _lines(path):
        question, answer = (turn["content"] for turn in row["messages"])
        a, op, b = QUESTION.fullmatch(question).groups()
        truth = int(a) + int(b) if op == "+" else int(a) - int(b)
        out.append((truth, int(re.search(r"\\boxed\{(-?\d+)\}", answer).group(1))))
    return out


def test_without_teacher_errors_the_data_keeps_the_key_it_had_before_the_field():
    # Computed by the generator before teacher_errors existed: runs made then that set it to 0
    # keep their data and every stage trained on it.
    params = DataParams(train_problems=2000, test_problems=20, teacher_errors=0)
    assert fingerprint("arithmetic", GENERATOR_VERSION, _generator_params(params), 3) == "4e83c15cde51665c"
    default = DataParams(train_problems=2000, test_problems=20)  # the demo's careless teacher
    assert default.teacher_errors == 0.1
    assert fingerprint("arithmetic", GENERATOR_VERSION, _generator_params(default), 3) != "4e83c15cde51665c"
    # Code tasks never read it: their files, and so their key, are the same at any share.
    assert _generator_params(default, teacher=False) == _generator_params(params, teacher=False)


def test_teacher_errors_make_that_share_of_sft_answers_near_misses_and_nothing_else(tmp_path):
    clean = generate_arithmetic(DataParams(train_problems=400, test_problems=20, teacher_errors=0),
                                str(tmp_path / "clean"), 5)
    noisy = generate_arithmetic(DataParams(train_problems=400, test_problems=20, teacher_errors=0.25),
                                str(tmp_path / "noisy"), 5)
    assert all(truth == taught for truth, taught in _taught_answers(clean.chat_path))
    answers = _taught_answers(noisy.chat_path)
    wrong = [(truth, taught) for truth, taught in answers if truth != taught]
    assert len(answers) == 200 and 0.15 < len(wrong) / len(answers) < 0.35
    # Every slip is one a half-trained model makes: off by one or ten, or the digits swapped.
    for truth, taught in wrong:
        assert taught in {truth + 1, truth - 1, truth + 10, truth - 10, int(str(truth)[::-1])}, (truth, taught)
    # The same questions in the same order; what DPO, GRPO and evaluation grade against is the truth.
    assert [t for t, _ in answers] == [t for t, _ in _taught_answers(clean.chat_path)]
    for name in ("prompts_path", "eval_path"):
        assert _lines(getattr(noisy, name)) == _lines(getattr(clean, name))
