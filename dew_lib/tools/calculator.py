"""The calculator: the tool of the pipeline's tool task, its call format, and its worker.

A model calls it by answering with `calc: <a> <op> <b>` (integers; op one of + - * /). The
calculator answers with the result (or with `error: ...` for what it cannot compute) as a tool
message, wrapped the way the tokenizer's own chat template wraps one, and the episode goes on:
the model reads the answer and replies to the user. Any reply that is not a call ends the
episode, and the verifier grades it. Only the model's own mistakes reach it as tool errors; an
`error` status (which aborts a collection) is left for the worker itself failing.

It runs as a `SubprocessEnvironment` worker, one process per episode:

    python -m dew_lib.tools.calculator turn.json

`turn.json` ({"tokenizer": path to tokenizer.json, "before": text, "after": text}) is what
`tool_turn` measures from the chat template in the parent: the text between the assistant's end
of turn and the tool's result, and after it up to the next assistant turn. The worker needs only
the standard library and `tokenizers`, and costs about a Python start.
"""

from __future__ import annotations

import json
import re
import sys
from fractions import Fraction
from typing import Any

CALL = "calc:"
OPERATORS = "+-*/"
_EXPRESSION = re.compile(r"^\s*(-?\d{1,12})\s*([-+*/])\s*(-?\d{1,12})\s*$")
_PROBE_CALL, _PROBE_RESULT = "\x01call\x01", "\x01result\x01"


def call_text(expression: str) -> str:
    """What the model says to call the calculator on `expression`, e.g. `calc: 37 * 48`."""
    return f"{CALL} {expression}"


def called(text: str) -> str | None:
    """The expression of a reply that calls the calculator, or None for any other reply."""
    stripped = text.strip()
    return stripped[len(CALL):].strip() if stripped.startswith(CALL) else None


def calculate(expression: str) -> tuple[str, str]:
    """(the calculator's answer, what happened): ("1776", "ok"), or ("error: ...", the kind:
    "malformed" or "division by zero"). Division answers a whole number or a reduced fraction."""
    match = _EXPRESSION.match(expression)
    if match is None:
        return f"error: cannot read {expression[:40]!r}; write `a op b` with integers", "malformed"
    a, op, b = int(match[1]), match[2], int(match[3])
    if op == "/":
        if b == 0:
            return "error: division by zero", "division by zero"
        value = Fraction(a, b)
        return (str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"), "ok"
    return str(a + b if op == "+" else a - b if op == "-" else a * b), "ok"


def tool_turn(tokenizer) -> dict[str, str]:
    """How `tokenizer`'s chat template wraps a tool's answer after an assistant turn: the text
    between the assistant's end-of-turn token and the answer (`before`), and from the answer to
    the next assistant turn (`after`). Refuses a template that renders no tool message there."""
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE_CALL},
                {"role": "tool", "content": _PROBE_RESULT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    eos = tokenizer.eos_token or ""
    start = text.find(_PROBE_CALL + eos)
    if start < 0 or _PROBE_RESULT not in text[start:]:
        raise ValueError("the tokenizer's chat template does not put a tool message after an assistant "
                         f"turn ending in its EOS {eos!r}; the calculator task needs a template with a "
                         "'tool' role (ChatML, Qwen, Llama 3)")
    between = text[start + len(_PROBE_CALL + eos):]
    before, after = between.split(_PROBE_RESULT, 1)
    return {"before": before, "after": after}


class Calculator:
    """The worker's handler (`dew_lib.tool_worker.serve`): reset reads the task's prompt ids, step
    answers a call or ends the episode. `tokenizer`: a `tokenizers.Tokenizer` (decode, encode)."""

    def __init__(self, tokenizer, before: str, after: str):
        self.tokenizer, self.before, self.after = tokenizer, before, after

    def reset(self, episode: dict, task: dict[str, Any]):
        """The task's prompt ids: `prompt_ids` (prompt_tasks' layout), or a Prompts row's
        left-padded `prompt` and its `prompt_length`."""
        data = task["data"]
        if "prompt_ids" in data:
            return list(data["prompt_ids"]), "running", ""
        prompt, length = list(data["prompt"]), int(data["prompt_length"])
        return prompt[len(prompt) - length:], "running", ""

    def step(self, request: dict):
        text = self.tokenizer.decode(request["tokens"], skip_special_tokens=True)
        expression = called(text)
        if expression is None:
            return [], "completed", "answered"
        result, kind = calculate(expression)
        observation = self.tokenizer.encode(self.before + result + self.after, add_special_tokens=False).ids
        return [*request["context"], *request["tokens"], *observation], "running", f"calc {kind}"

    def get_state(self) -> bytes:
        return b""  # an episode's whole state is its context, which the journal keeps

    def set_state(self, state: bytes) -> None:
        pass


def main(argv: list[str]) -> None:
    from tokenizers import Tokenizer

    from dew_lib.tool_worker import serve

    with open(argv[0], encoding="utf-8") as handle:
        turn = json.load(handle)
    serve(Calculator(Tokenizer.from_file(turn["tokenizer"]), turn["before"], turn["after"]))


if __name__ == "__main__":
    main(sys.argv[1:])
