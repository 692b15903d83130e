"""Roles per token from a chat template, by rendering a conversation one prefix at a time.

A template only says how a whole conversation looks, so the role of each token is found by
rendering growing prefixes: the tokens that message k adds to the render of messages[:k] are
message k's. For an assistant turn the render of messages[:k] with the generation prompt gives
the header the model is prompted with at inference (e.g. `<|im_start|>assistant\\n`); the tokens
it shares with the turn's render are labelled Role.NONE, and everything the turn adds after them,
its end-of-turn token and trailing newline included, is Role.ASSISTANT. That is exactly what the
model has to produce once prompted, and matches TRL's `{% generation %}` masks on the templates
TRL ships for training.

Every shorter render must tokenize to a prefix of the longer one. A template that rewrites
history (Qwen3's drops earlier reasoning and empty think blocks) fails this check, and the
conversation is refused with its index and the first differing token rather than trained with
wrong masks. Passing the check does not prove the masks right for every template: look at the
tokens and roles of a few conversations before a long run.

Encoding every prefix from scratch would tokenize a conversation several times over. A render
that extends the previous one as a string, at a point where the tokenizer cuts its input anyway
(an added token such as `<|im_start|>`), is encoded as the previous ids plus the ids of the new
text, which is exactly what encoding it whole gives (`Renderer.splits_at`); anything else is
encoded whole, so the prefix check always compares exact tokens.

Consecutive messages of one non-assistant role (several tool responses in a row) are rendered as
one block; a template may merge them. A boundary between two prompt roles that the template
cannot render on its own (some refuse a conversation without a user message) is skipped, and
the messages before the next boundary share the later message's role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from dew_lib.data.chat import Role
from dew_lib.data.errors import DataError
from dew_lib.data.tokenizer import Renderer

ROLES = {"system": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT, "tool": Role.TOOL}


class TemplateRewrite(DataError):
    """A chat template changed tokens of an earlier render, so prefixes cannot assign roles."""


class Conversation(NamedTuple):
    """One conversation to label. `context`: how many leading messages are the prompt of a
    prompt-completion record. A prompt with an assistant turn in it is labelled Role.NONE as a
    whole (and only its whole render must be a prefix of the completion's), so an SFT loss on
    Role.ASSISTANT trains the completion alone; a prompt of system and user messages keeps their
    roles."""

    messages: list
    tools: list | None
    where: str
    context: int = 0


def _context(conversation: Sequence) -> int:
    return conversation[3] if len(conversation) > 3 else 0


def check_messages(messages: Any, where: str) -> None:
    """Refuse what is not a conversation, before any template runs.

    A conversation is a non-empty list of mappings, each with a `role` among system, user,
    assistant and tool, starting with a system or user message. Every message has `content`: a
    string, or a list of content parts (mappings with a `type`); an assistant message may leave it
    out (or null) when it has `tool_calls`. `tool_calls` is a list of calls, each a mapping whose
    `function` (or the call itself) has a string `name` and `arguments` as a mapping or a JSON
    string. A null field counts as absent, as the templates see it.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: expected a non-empty list of messages, got {brief(messages)}")
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(f"{where}: message {k} is {brief(message)}, not a mapping with a 'role'")
        role = message.get("role")
        if role not in ROLES:
            hint = ""
            if role is None and "from" in message:
                hint = ("; this looks like ShareGPT's layout ('from'/'value'): convert each message to "
                        "{'role': ..., 'content': ...}")
            raise DataError(
                f"{where}: message {k} has unknown role {role!r}; use one of {sorted(ROLES)}{hint}"
            )
        _check_content(message, k, role, where)
        calls = message.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls, k, where)
    first = messages[0]["role"]
    if first not in ("system", "user"):
        raise DataError(
            f"{where}: the conversation starts with a {first} message; it must start with a system "
            "or user message (an assistant turn needs a prompt to answer)"
        )


_CONTENT_LOOKALIKES = ("text", "value", "message", "body", "response")


def _check_content(message: Mapping, k: int, role: str, where: str) -> None:
    content = message.get("content")
    if content is None:
        if role == "assistant" and message.get("tool_calls") is not None:
            return
        fields = sorted(name for name, value in message.items() if value is not None)
        lookalike = next((name for name in _CONTENT_LOOKALIKES if name in fields), None)
        fix = (f"rename its {lookalike!r} field to 'content'" if lookalike else
               "give every message a 'content' string (an assistant message may have 'tool_calls' "
               "instead)")
        raise DataError(f"{where}: message {k} ({role}) has no 'content' (its fields are {fields}); {fix}")
    if isinstance(content, str):
        return
    if isinstance(content, (list, tuple)):
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise DataError(
                    f"{where}: message {k} ({role}) content part {j} is {brief(part)}; a content "
                    "list holds parts such as {'type': 'text', 'text': ...}"
                )
        return
    raise DataError(
        f"{where}: message {k} ({role}) has content {brief(content)}; content must be a string "
        "or a list of content parts"
    )


def _check_tool_calls(calls: Any, k: int, where: str) -> None:
    if not isinstance(calls, (list, tuple)):
        raise DataError(f"{where}: message {k} has tool_calls {brief(calls)}; expected a list of calls")
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise DataError(
                f"{where}: message {k} tool call {j} is {brief(call)}; a call is "
                "{'type': 'function', 'function': {'name': ..., 'arguments': ...}}"
            )
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, (Mapping, str)):
            raise DataError(
                f"{where}: message {k} tool call {j} ({function['name']}) has arguments "
                f"{brief(arguments)}; give a mapping or a JSON string"
            )


def brief(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def check_boundaries(renderer: Renderer) -> None:
    """Refuse a template that renders an assistant message exactly like a user message."""
    def render(second_role):
        return renderer.render([{"role": "user", "content": "Hello"},
                                {"role": second_role, "content": "Hi there"}])

    answer = render("assistant")
    try:
        same = answer == render("user")
    except Exception:  # the template refuses two user turns in a row: it tells roles apart
        same = False
    if same or "Hi there" not in answer:
        name = getattr(renderer.tokenizer, "name_or_path", "the tokenizer")
        raise DataError(
            f"the chat template of {name} has no assistant boundaries: it renders an assistant "
            "message like a user message (or not at all), so assistant tokens cannot be told "
            "apart; pass chat_template= with a template that marks assistant turns"
        )


def _blocks(messages: Sequence[Mapping], context: int = 0) -> list[tuple[int, int, str]]:
    """(start, end, role) runs: each assistant message alone, other roles grouped while equal.

    A context prompt (`messages[:context]`) that holds an assistant turn is one block of role
    "context": only its render as a whole has to be a prefix of the completion's.
    """
    blocks, i = [], 0
    if context and any(m["role"] == "assistant" for m in messages[:context]):
        blocks, i = [(0, context, "context")], context
    while i < len(messages):
        role, j = messages[i]["role"], i + 1
        if role != "assistant":
            while j < len(messages) and messages[j]["role"] == role:
                j += 1
        blocks.append((i, j, role))
        i = j
    return blocks


def _first_difference(short: Sequence[int], long: Sequence[int]) -> int:
    for j, (a, b) in enumerate(zip(short, long)):
        if a != b:
            return j
    return min(len(short), len(long))


def _rewrite(renderer: Renderer, where: str, what: str, short: list[int], long: list[int]) -> TemplateRewrite:
    j = _first_difference(short, long)
    piece = renderer.tokenizer.convert_ids_to_tokens

    def show(ids):
        return f"{ids[j]} ({piece(ids[j])!r})" if j < len(ids) else "the end of the render"

    return TemplateRewrite(
        f"{where}: the chat template rewrites earlier tokens {what}: token {j} is {show(short)} in "
        f"the shorter render but {show(long)} in the longer one, so roles cannot come from "
        "prefixes. Run `python tools/audit_template.py template --tokenizer ...` to see which "
        "turns this template keeps append-only; use a training template that keeps history "
        "(for Qwen3, one that always writes the think block) or split the conversation there"
    )


def _requests(messages: Sequence[Mapping], context: int = 0) -> list[tuple[int, int, str, int | None, int, bool]]:
    """Per block: (start, end, role, header prefix length or None, full prefix length, soft)."""
    blocks = _blocks(messages, context)
    out = []
    for b, (start, end, role) in enumerate(blocks):
        following = blocks[b + 1][2] if b + 1 < len(blocks) else "assistant"
        soft = role != "assistant" and following != "assistant"
        out.append((start, end, role, start if role == "assistant" else None, end, soft))
    return out


def _assemble(renderer: Renderer, plan, ids: Sequence[list[int]], where: str) -> tuple[np.ndarray, np.ndarray]:
    """Roles from the tokenized renders; plan rows are (start, end, role, header, full) indices."""
    roles: list[int] = []
    previous: list[int] = []
    for start, end, role, header, full in plan:
        if full is None:  # a skipped boundary: this block's tokens go to the next block's role
            continue
        tokens = ids[full]
        if tokens[:len(previous)] != previous:
            added = f"message {start} ({role}) is" if end == start + 1 else f"messages {start}..{end - 1} ({role}) are"
            raise _rewrite(renderer, where, f"when {added} added", previous, tokens)
        if role == "assistant":
            prompt = ids[header]
            if prompt[:len(previous)] != previous:
                raise _rewrite(renderer, where, f"when the generation prompt follows message {start - 1}",
                               previous, prompt)
            shared = len(previous) + _first_difference(prompt[len(previous):], tokens[len(previous):])
            if shared == len(tokens):
                raise DataError(
                    f"{where}: message {start} (assistant) adds no tokens after the generation "
                    "prompt; the template drops assistant turns, so there is nothing to learn from"
                )
            roles.extend([Role.NONE] * (shared - len(previous)))
            roles.extend([Role.ASSISTANT] * (len(tokens) - shared))
        else:
            roles.extend([ROLES.get(role, Role.NONE)] * (len(tokens) - len(previous)))  # context: NONE
        previous = tokens
    return np.asarray(previous, np.int32), np.asarray(roles, np.int8)


def label(renderer: Renderer, messages: Sequence[Mapping], tools: Sequence | None,
          where: str, context: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and roles (int8) of one conversation; see the module docstring.

    context: the number of leading prompt messages (see Conversation).
    """
    texts: list[str] = []

    def render(count, generation=False, soft=False):
        try:
            texts.append(renderer.render(messages[:count], tools, generation))
            return len(texts) - 1
        except Exception as error:
            if soft:
                return None
            raise DataError(
                f"{where}: the chat template failed on messages[:{count}]"
                f"{' with the generation prompt' if generation else ''}: {type(error).__name__}: {error}"
            ) from None

    plan: list[tuple[int, int, str, int | None, int | None]] = []  # as _assemble reads it
    bases: list[int | None] = []  # the render each one extends, as encode_extending reads it
    previous: int | None = None
    for start, end, role, header, full, soft in _requests(messages, context):
        if header is not None:
            header = render(header, generation=True)
            if header is not None:
                bases.append(previous)
        full = render(full, soft=soft)
        if full is not None:
            bases.append(previous)
            previous = full
        plan.append((start, end, role, header, full))
    return _assemble(renderer, plan, renderer.encode_extending(texts, bases), where)


def label_many(renderer: Renderer, conversations: Sequence[tuple]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`label` for Conversation tuples (messages, tools, where[, context]), rendering and encoding
    them together.

    Conversations without tool schemas share two batched renders and one tokenizer call, which
    saves the per-call overhead of transformers; anything that fails there is redone one at a
    time so that errors and skipped boundaries come out exactly as `label` gives them.
    """
    out: list = [None] * len(conversations)
    batched = [i for i, conversation in enumerate(conversations) if not conversation[1]]
    requests: list[tuple[Sequence[Mapping], bool]] = []  # (prefix, with generation prompt)
    bases: list[int | None] = []  # the render each one extends: the previous full render
    plans = {}
    for i in batched:
        messages = conversations[i][0]
        plan, previous = [], None
        for start, end, role, header, full, _ in _requests(messages, _context(conversations[i])):
            if header is not None:
                requests.append((messages[:header], True))
                bases.append(previous)
                header = len(requests) - 1
            requests.append((messages[:full], False))
            bases.append(previous)
            previous = len(requests) - 1
            plan.append((start, end, role, header, previous))
        plans[i] = plan
    try:
        plain = [k for k, (_, generation) in enumerate(requests) if not generation]
        prompted = [k for k, (_, generation) in enumerate(requests) if generation]
        texts = [""] * len(requests)
        for indices, generation in ((plain, False), (prompted, True)):
            for k, text in zip(indices, renderer.render_many([requests[k][0] for k in indices], generation),
                               strict=True):
                texts[k] = text
    except Exception:  # a template that refuses some prefix: label one by one below
        batched = []
    if batched:
        ids = renderer.encode_extending(texts, bases)
        for i in batched:
            out[i] = _assemble(renderer, plans[i], ids, conversations[i][2])
    for i, conversation in enumerate(conversations):
        if out[i] is None:
            out[i] = label(renderer, conversation[0], conversation[1], conversation[2], _context(conversation))
    return out


__all__ = ["ROLES", "Conversation", "TemplateRewrite", "brief", "check_boundaries", "check_messages", "label",
           "label_many"]
