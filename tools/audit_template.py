"""Audit a chat template: which kinds of turns keep the token history append-only.

    python tools/audit_template.py template --tokenizer DIR [--chat-template FILE]
                                            [--template-kwargs JSON] [--json] [--strict]

For each kind of turn (plain, reasoning, tool call, reasoning with a tool call; followed by a user
message, or by a tool response sent as the tool role, as a plain user message or as a user message
wrapped in <tool_response> tags; tool-call arguments sent as a JSON string or re-sent as parsed
JSON) it renders the prompt a model would be given, takes the sampled turn to be what the
template writes for a final assistant turn, and asks whether the next prompt, after the
observation, still starts with prompt + sampled turn:

    merges         the next call extends the previous one (one chain, one packed sequence)
    splits         the template rewrote history (the first differing token is shown)
    prompt differs the generation prompt is not even a prefix of the final turn's render

A turn that splits cannot be trained from prefix renders (ChatMessages refuses it) and, in RL,
makes each call its own chain. The `sessions traces.jsonl` mode (calls per chain measured on
recorded sessions) belongs to a later issue and is not implemented here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dew_lib.data.tokenizer import Renderer, load_tokenizer, resolve_template  # noqa: E402

TOOL = {
    "type": "function",
    "function": {
        "name": "square",
        "description": "Square an integer.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}
QUESTION = [{"role": "user", "content": "What is 3 squared, plus one?"}]


def _call(arguments) -> list[dict]:
    return [{"type": "function", "function": {"name": "square", "arguments": arguments}}]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    sampled: dict  # the assistant turn as the model wrote it
    history: dict  # the same turn as the harness sends it back
    observation: list[dict]
    tools: bool = False


def cases() -> list[Case]:
    plain = {"role": "assistant", "content": "Let me think. 3 squared is 9."}
    reasoning = {"role": "assistant", "reasoning_content": "3*3 = 9.", "content": "3 squared is 9."}
    call = {"role": "assistant", "content": "", "tool_calls": _call({"x": 3})}
    reasoned_call = {"role": "assistant", "reasoning_content": "I should use the tool.", "content": "",
                     "tool_calls": _call({"x": 3})}
    string_call = {**reasoned_call, "tool_calls": _call('{"x": 3}')}
    compact_call = {**reasoned_call, "tool_calls": _call('{"x":3}')}
    user = [{"role": "user", "content": "Now add one."}]
    tool = [{"role": "tool", "name": "square", "content": "9"}]
    as_user = [{"role": "user", "content": "9"}]
    # Qwen-style templates treat a user message wrapped in <tool_response> tags as a tool response.
    wrapped = [{"role": "user", "content": "<tool_response>\n9\n</tool_response>"}]
    return [
        Case("plain turn, then user", plain, plain, user),
        Case("reasoning turn, then user", reasoning, reasoning, user),
        Case("tool call, then tool-role response", call, call, tool, tools=True),
        Case("tool call, then user-role response", call, call, as_user, tools=True),
        Case("reasoning + tool call, then tool-role response", reasoned_call, reasoned_call, tool, tools=True),
        Case("reasoning + tool call, then user-role response", reasoned_call, reasoned_call, as_user, tools=True),
        Case("reasoning + tool call, then user-role <tool_response>", reasoned_call, reasoned_call, wrapped,
             tools=True),
        Case("reasoning + tool call, arguments as a JSON string", string_call, string_call, tool, tools=True),
        Case("reasoning + tool call, compact JSON re-sent parsed", compact_call, reasoned_call, tool, tools=True),
    ]


def _difference(a: list[int], b: list[int]) -> int:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return min(len(a), len(b))


def audit_case(renderer: Renderer, case: Case) -> dict:
    tools = [TOOL] if case.tools else None
    prompt_text = renderer.render(QUESTION, tools, generation=True)
    final_text = renderer.render(QUESTION + [case.sampled], tools)
    next_text = renderer.render(QUESTION + [case.history] + case.observation, tools, generation=True)
    prompt, final, following = renderer.encode([prompt_text, final_text, next_text])
    piece = renderer.tokenizer.convert_ids_to_tokens
    result = {"case": case.name}
    if final[:len(prompt)] != prompt:
        j = _difference(prompt, final)
        result.update(status="prompt differs", token=j,
                      detail=f"prompt has {piece(prompt[j]) if j < len(prompt) else 'its end'!r}, final turn "
                             f"has {piece(final[j]) if j < len(final) else 'its end'!r}")
        return result
    if following[:len(final)] == final:
        result.update(status="merges", token=None, detail="")
        return result
    j = _difference(final, following)
    result.update(status="splits", token=j,
                  detail=f"sampled chain has {piece(final[j])!r} at token {j}, the next prompt has "
                         f"{piece(following[j]) if j < len(following) else 'its end'!r}")
    return result


def audit(renderer: Renderer) -> list[dict]:
    return [audit_case(renderer, case) for case in cases()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    template = commands.add_parser("template", help="audit one tokenizer's chat template")
    template.add_argument("--tokenizer", required=True, help="tokenizer directory (or a cached Hub name)")
    template.add_argument("--chat-template", help="template text file to audit instead of the tokenizer's")
    template.add_argument("--template-kwargs", default="{}",
                          help='JSON template variables, e.g. {"enable_thinking": false}')
    template.add_argument("--json", action="store_true", help="print JSON instead of a table")
    template.add_argument("--strict", action="store_true", help="exit 1 when any kind of turn does not merge")
    args = parser.parse_args(argv)
    renderer = Renderer(load_tokenizer(args.tokenizer), resolve_template(args.chat_template),
                        json.loads(args.template_kwargs))
    results = audit(renderer)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        width = max(len(r["case"]) for r in results)
        source = f" (template {args.chat_template})" if args.chat_template else ""
        print(f"chat template of {args.tokenizer}{source}")
        for r in results:
            print(f"  {r['case']:<{width}}  {r['status']:<14} {r['detail']}")
    return 1 if args.strict and any(r["status"] != "merges" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
