"""The `prompts` table: each task's prompt, once per stage, so SQL can read what a task asked.

Sessions name their task (`sessions.task`); a GRPO stage records the prompt behind each task id
the first time its sessions are written (`StageWriter.prompts`, called by both GRPO paths just
before `StageWriter.sessions`), under the same `update`, so a retry replaces or discards the two
together. A writer records a task once in its lifetime; a later lifetime (a retry, a resumed
process) may record it again, and the `prompts` view keeps one row per run, stage and task (the
first by update, `schema.Table.unique`). Join with `USING (run, stage, task)`.

What `StageWriter.prompts` takes, per task: a `Prompt`, or a `dew_lib.records.sessions.Task`
whose data holds `prompt_ids` and the reward fields `data_source`, `ground_truth` and
`extra_info` (what `dew_lib.rollouts.prompt_tasks` builds, and `SampledRollout.last_tasks`
holds), optionally `prompt` text. The text is `decode(prompt_ids)` when the caller gives a
decode and the prompt has no text of its own (decoded on the caller's thread, only for tasks
this writer has not recorded yet).

Not here: the writer's thread and retries (writer.py), the view's query (snapshot.py).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from dew_lib.records.ids import token_ids
from dew_lib.records.sessions import Task
from dew_lib.store import rows

FIELDS = ("data_source", "ground_truth", "extra_info")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompt:
    """The prompt of one task. prompt: its text (None: not known); prompt_ids: its token ids
    without padding (None: not known); the reward fields as the reward read them."""

    task: str
    prompt: str | None = None
    prompt_ids: Sequence[int] | np.ndarray | None = None
    data_source: str = ""
    ground_truth: str = ""
    extra_info: str = ""


def as_prompt(item: Any) -> Prompt:
    """A Prompt from a Prompt or a Task (see the module docstring), checked."""
    if isinstance(item, Task):
        data = item.data
        item = Prompt(task=item.id, prompt=data.get("prompt"), prompt_ids=data.get("prompt_ids"),
                      **{f: data.get(f, "") for f in FIELDS})
    elif not isinstance(item, Prompt):
        raise TypeError(f"prompts takes Prompt or Task records, got {type(item).__name__}")
    if not isinstance(item.task, (str, int)) or isinstance(item.task, bool) or item.task == "":
        raise ValueError(f"a prompt's task must be a nonempty string (sessions.task), got {item.task!r}")
    item = dataclasses.replace(item, task=str(item.task))
    if item.prompt is not None and not isinstance(item.prompt, str):
        raise TypeError(f"the prompt of task {item.task!r} must be text or None, got "
                        f"{type(item.prompt).__name__}")
    ids = item.prompt_ids
    if ids is not None:
        ids = token_ids(ids, f"the prompt_ids of task {item.task!r}")
    fields = {f: "" if getattr(item, f) is None else str(getattr(item, f)) for f in FIELDS}
    return dataclasses.replace(item, prompt_ids=ids, **fields)


def new_prompts(items: Iterable[Any], seen: set[str],
                decode: Callable[[Sequence[int]], str] | None = None) -> list[Prompt]:
    """The prompts of tasks not in `seen` (the first of each), decoded where they lack text.
    Runs on the caller's thread: a bad record or a failing decode raises here, not on the
    writer's thread."""
    if decode is not None and not callable(decode):
        raise TypeError(f"prompts' decode must be callable as decode(ids) -> str, got "
                        f"{type(decode).__name__}")
    out: list[Prompt] = []
    fresh: set[str] = set()
    for item in items:
        task = str(item.id if isinstance(item, Task) else getattr(item, "task", None))
        if task in seen or task in fresh:
            continue
        prompt = as_prompt(item)
        if prompt.prompt is None and decode is not None and prompt.prompt_ids is not None:
            text = decode(prompt.prompt_ids)
            if not isinstance(text, str):
                raise TypeError(f"decode returned {type(text).__name__} for the prompt of task "
                                f"{prompt.task!r}; it must return text")
            prompt = dataclasses.replace(prompt, prompt=text)
        out.append(prompt)
        fresh.add(prompt.task)
    return out


def prompts_table(prompts: Sequence[Prompt], *, run: str, stage: str, update: int,
                  when: datetime.datetime) -> pa.Table:
    n = len(prompts)
    ids = [p.prompt_ids for p in prompts]
    return rows._table("prompts", {
        "run": [run] * n, "stage": [stage] * n, "update": [update] * n,
        "task": [p.task for p in prompts], "prompt": [p.prompt for p in prompts],
        "prompt_ids": rows._list(ids, np.int32, pa.int32()),
        "prompt_tokens": [None if i is None else int(i.size) for i in ids],
        **{f: [getattr(p, f) for p in prompts] for f in FIELDS},
        "written_at": rows._stamps(when, n)})


__all__ = ["Prompt", "as_prompt", "new_prompts", "prompts_table"]
