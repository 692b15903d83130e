"""Every Python example in README.md and docs/*.md runs as written.

Each Markdown file is one test: its fenced ```python blocks run in order in one namespace (a later
block may use what an earlier one defined), from a scratch directory that looks like the
repository root (its top-level entries are linked there), so an example reads shipped files such
as `tests/fixtures/hf/qwen3` by the path a reader would type and writes `runs/...` into the
scratch directory, never into the checkout. Code is compiled under the Markdown file's name with
its own line numbers, so a failure's traceback points at the doc line.

A block that is deliberately not runnable starts with the line `# not run: <why>`; it shows in the
rendered doc, and every such block must be listed in NOT_RUN below, so skipping stays visible and
rare. New docs are picked up by the glob; nothing here needs editing when a doc is added.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("**/*.md")])
NOT_RUN_MARK = "# not run:"
# (file relative to the repository root, the reason as written after the mark). Keep this short.
NOT_RUN: set[tuple[str, str]] = set()

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of every fenced block whose language is python."""
    blocks, lines = [], path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match["fence"], match["info"].strip().split()
        start, i = i + 1, i + 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and not lines[i].strip().strip(fence[0])):
            i += 1
        if info and info[0].lower() in ("python", "py", "python3"):
            blocks.append((start + 1, "\n".join(lines[start:i])))
        i += 1
    return blocks


def not_run_reason(code: str) -> str | None:
    first = code.lstrip("\n").split("\n", 1)[0].strip()
    return first[len(NOT_RUN_MARK):].strip() if first.startswith(NOT_RUN_MARK) else None


def scratch_root(tmp_path: Path) -> Path:
    """A directory whose top-level entries (except runs/) link to the checkout's."""
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", ".git", ".pytest_cache"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def test_the_fence_reader_finds_blocks_and_their_lines(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("text\n```python\na = 1\n```\n\n```sh\nls\n```\n````py\nb = '```'\n````\n",
                   encoding="utf-8")
    assert python_blocks(doc) == [(3, "a = 1"), (10, "b = '```'")]


@pytest.mark.slow  # a doc's examples compile and train tiny models: seconds to a minute each
@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_doc_examples_run_as_written(doc, tmp_path, monkeypatch):
    name = str(doc.relative_to(ROOT))
    blocks = python_blocks(doc)
    skipped = {(name, reason) for _, code in blocks if (reason := not_run_reason(code)) is not None}
    assert skipped <= NOT_RUN, (
        f"{name} has blocks marked '{NOT_RUN_MARK}' that are not listed in NOT_RUN: {skipped - NOT_RUN}")
    monkeypatch.chdir(scratch_root(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace = {"__name__": "__doc_example__"}
    for line, code in blocks:
        if not_run_reason(code) is not None:
            continue
        compiled = compile("\n" * (line - 1) + code, name, "exec")  # tracebacks give doc lines
        failure = None
        try:
            exec(compiled, namespace)
        except BaseException as error:  # noqa: BLE001 - reported with the doc's file and line
            failure = "".join(traceback.format_exception(error))
        if failure is not None:
            pytest.fail(f"{name}:{line}: the example starting here failed:\n{failure}", pytrace=False)
    assert os.getcwd() == str(tmp_path)


def test_every_not_run_entry_is_still_in_its_doc():
    marked = {(str(d.relative_to(ROOT)), not_run_reason(code)) for d in DOCS for _, code in python_blocks(d)}
    assert NOT_RUN <= marked, f"NOT_RUN lists blocks no doc has any more: {NOT_RUN - marked}"

