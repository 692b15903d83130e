"""tools/audit_template.py reproduces the spec's Qwen3 findings."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import SHARED_DATA

QWEN3 = os.path.join(SHARED_DATA, "tokenizers", "qwen3")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "audit_template.py"
FIXTURE = Path(__file__).parent / "fixtures" / "chat" / "trl_qwen3.json"

pytestmark = pytest.mark.skipif(not os.path.isdir(QWEN3), reason="shared data not found")


def load_tool():
    spec = importlib.util.spec_from_file_location("audit_template", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def statuses(tool, argv, capsys) -> dict[str, str]:
    assert tool.main(["template", "--tokenizer", QWEN3, "--json", *argv]) == 0
    return {r["case"]: r["status"] for r in json.loads(capsys.readouterr().out)}


def test_qwen3_keeps_only_reasoning_turns_with_tool_role_observations(capsys):
    found = statuses(load_tool(), [], capsys)
    assert found == {
        # a turn without reasoning is written with an empty think block that history drops
        "plain turn, then user": "splits",
        "tool call, then tool-role response": "splits",
        "tool call, then user-role response": "splits",
        # user-role observations drop the reasoning from history
        "reasoning turn, then user": "splits",
        "reasoning + tool call, then user-role response": "splits",
        # only a reasoning turn followed by a tool-role observation merges (Qwen3 also counts a
        # user message wrapped in <tool_response> tags as one)
        "reasoning + tool call, then tool-role response": "merges",
        "reasoning + tool call, then user-role <tool_response>": "merges",
        # in that setting, arguments sent as a JSON string merge; compact JSON re-serialized splits
        "reasoning + tool call, arguments as a JSON string": "merges",
        "reasoning + tool call, compact JSON re-sent parsed": "splits",
    }


def test_trls_training_template_merges_every_kind_of_turn(tmp_path, capsys):
    template = tmp_path / "qwen3_training.jinja"
    template.write_text(json.loads(FIXTURE.read_text())["chat_template"])
    found = statuses(load_tool(), ["--chat-template", str(template)], capsys)
    assert {case for case, status in found.items() if status != "merges"} == {
        "reasoning + tool call, compact JSON re-sent parsed"}
    tool = load_tool()
    assert tool.main(["template", "--tokenizer", QWEN3, "--strict"]) == 1
    assert "splits" in capsys.readouterr().out
