"""The record shapes the loaders read directly, and the column names they read them from.

Users hold SFT and DPO data in a few common shapes, most of them TRL's. The loaders take them as
they are, so nobody writes a conversion script first:

    conversational        {"messages": [{"role": ..., "content": ...}, ...]}       ChatMessages
    prompt-completion     {"prompt": "2+2?", "completion": "4"}                    ChatMessages
                          {"prompt": [messages], "completion": [messages]}
    question/answer       {"question": ..., "answer": ...} with
                          columns={"prompt": "question", "completion": "answer"}   ChatMessages
    preference (text)     {"prompt": "2+2?", "chosen": "4", "rejected": "5"}        PreferencePairs
                          {"prompt": [messages], "chosen": [messages], "rejected": [messages]}

A plain string is one message: the user's as a prompt, the assistant's as a completion, chosen or
rejected answer. Everything goes through the tokenizer's chat template; in a prompt-completion
record the prompt is context and only the completion is trained, and in a preference record the
masks start where the prompt (rendered with the generation prompt) ends.

`columns` maps the names Dew reads to the columns of a file, e.g. `{"prompt": "question"}`.

Not here: TRL's plain-text "language modeling" rows (`{"text": ...}`), preference rows with an
implicit prompt (the prompt repeated inside chosen and rejected, as hh-rlhf stores them: give the
prompt in its own column), ShareGPT's `from`/`value` messages, and tokenizing plain strings
without a chat template (TRL's "standard" prompt-completion tokenization).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dew_lib.data.errors import DataError
from dew_lib.data.template import brief, check_messages

CHAT_COLUMNS = ("prompt", "completion", "tools")
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected", "chosen_mask", "rejected_mask", "tools")


def check_columns(owner: str, columns: Mapping[str, str] | None, allowed: Sequence[str]) -> dict[str, str]:
    """The full name -> column mapping: `columns` validated, every other name mapped to itself."""
    names = {name: name for name in allowed}
    if columns is None:
        return names
    if not isinstance(columns, Mapping):
        raise TypeError(f"{owner}.columns must be a mapping such as {{'prompt': 'question'}}, got "
                        f"{type(columns).__name__}")
    for name, column in columns.items():
        if name not in names:
            raise ValueError(f"{owner}.columns has the key {name!r}; the names it can map are "
                             f"{list(allowed)} (each to the column of your data that holds it)")
        if not isinstance(column, str) or not column:
            raise ValueError(f"{owner}.columns[{name!r}] must be a column name, got {column!r}")
        names[name] = column
    return names


def parse_json_field(value: Any, name: str, where: str) -> Any:
    """A field that may be stored as JSON text (columnar files): parsed; anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: field {name!r} is a string but not valid JSON ({error.msg})") from None
    return value


def tools_field(value: Any, column: str, where: str) -> list | None:
    """Tool schemas: a list, a JSON string of one, or nothing."""
    tools = parse_json_field(value, column, where)
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: field {column!r} must be a list of tool schemas, got {type(tools).__name__}")
    return tools or None


def as_messages(value: Any, role: str, column: str, where: str) -> list[dict]:
    """A field that is either one plain string (one `role` message) or a list of messages."""
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: field {column!r} is an empty string")
        return [{"role": role, "content": value}]
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
        return [dict(m) for m in value]
    raise DataError(
        f"{where}: field {column!r} is {brief(value)}; give a string or a list of messages "
        "({'role': ..., 'content': ...})"
    )


def is_text(value: Any) -> bool:
    """Whether a chosen/rejected value is text or messages (else it should be token ids)."""
    return isinstance(value, str) or (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) for m in value)
    )


def prompt_and_completion(record: Mapping, names: Mapping[str, str], where: str) -> tuple[list, int]:
    """(messages, context) of a prompt-completion record: prompt messages then completion ones.

    The completion must start with an assistant message, so the boundary is a generation prompt.
    """
    values = {}
    for name in ("prompt", "completion"):
        value = record.get(names[name])
        if value is None:
            raise DataError(f"{where}: missing column {names[name]!r} (the {name}); every prompt-completion "
                            "record needs both, or set ChatMessages(columns=...) to the fields that hold them")
        values[name] = value
    prompt = as_messages(values["prompt"], "user", names["prompt"], where)
    completion = as_messages(values["completion"], "assistant", names["completion"], where)
    if completion[0].get("role") != "assistant":
        raise DataError(
            f"{where}: the completion ({names['completion']!r}) starts with a "
            f"{completion[0].get('role')!r} message; it must start with the assistant's answer "
            "(move earlier messages into the prompt)"
        )
    messages = prompt + completion
    check_messages(messages, where)
    return messages, len(prompt)


def preference_messages(record: Mapping, names: Mapping[str, str], where: str) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) message lists of a text or conversational preference record."""
    value = record.get(names["prompt"])
    if value is None:
        raise DataError(
            f"{where}: missing column {names['prompt']!r}; a text preference pair needs its prompt in "
            "its own field (chosen and rejected hold only the answers). For data whose answers "
            "repeat the prompt, give token ids with chosen_mask and rejected_mask instead"
        )
    prompt = as_messages(value, "user", names["prompt"], where)
    out = [prompt]
    for side in ("chosen", "rejected"):
        answer = as_messages(record.get(names[side]), "assistant", names[side], where)
        if answer[0].get("role") != "assistant":
            raise DataError(f"{where}: field {names[side]!r} starts with a {answer[0].get('role')!r} "
                            "message; an answer starts with the assistant's message")
        check_messages(prompt + answer, where)
        out.append(answer)
    return out[0], out[1], out[2]


__all__ = ["CHAT_COLUMNS", "PREFERENCE_COLUMNS", "as_messages", "check_columns", "is_text",
           "parse_json_field", "preference_messages", "prompt_and_completion", "tools_field"]
