"""How a batch becomes `Task`s: `task_ids` for integer task-id rows, `prompt_tasks` for `Prompts`
batches. Either is `RolloutScheduler(tasks=...)`; `SampledRollout` names its sessions' tasks with
`prompt_tasks` too, so both GRPO paths give a prompt the same task id (the run store's
`sessions.task` and `prompts.task`)."""

from __future__ import annotations

import hashlib

import numpy as np

from dew_lib.data.dataset import Batch
from dew_lib.data.prompts import METADATA, text_field
from dew_lib.records.sessions import Task


def task_ids(batch: Batch) -> list[Task]:
    """One task per integer task_id row, named by its decimal id."""
    if "task_id" not in batch:
        raise KeyError(f"task_ids reads an integer 'task_id' field, and the batch has "
                       f"{sorted(batch)}; pass RolloutScheduler(tasks=...) for other layouts "
                       "(prompt_tasks reads Prompts batches)")
    ids = np.asarray(batch["task_id"])
    if ids.ndim != 1 or ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"batch field 'task_id' must be a 1-D integer array, got {ids.dtype} "
                         f"{ids.shape}")
    return [Task(str(int(i)), {"task_id": int(i)}) for i in ids]


def prompt_tasks(batch: Batch) -> list[Task]:
    """One task per row of a `Prompts` batch, its data what `PromptSource` reads.

    data: `prompt_ids` (the row without its left padding) and the reward fields `data_source`,
    `ground_truth` and `extra_info` as strings. The id is the row's integer `task_id` when the
    batch has one, else the first 16 hex digits of a SHA-256 of the prompt ids and ground truth,
    so the same prompt is the same task in every epoch and after a resume.
    """
    for name in ("prompt", "prompt_length"):
        if name not in batch:
            raise KeyError(f"prompt_tasks reads Prompts batches ('prompt', 'prompt_length' and the "
                           f"reward fields); the batch has {sorted(batch)}")
    prompt = np.asarray(batch["prompt"], np.int32)
    lengths = np.asarray(batch["prompt_length"], np.int32)
    width = prompt.shape[1]
    fields = {name: text_field(batch[name]) if name in batch else [""] * len(prompt)
              for name in METADATA}
    ids = np.asarray(batch["task_id"]) if "task_id" in batch else None
    tasks = []
    for row in range(len(prompt)):
        ids_row = prompt[row, width - int(lengths[row]):]
        if ids is not None:
            name = str(int(ids[row]))
        else:
            digest = hashlib.sha256(ids_row.tobytes() + b"\0" + fields["ground_truth"][row].encode())
            name = digest.hexdigest()[:16]
        tasks.append(Task(name, {"prompt_ids": ids_row,
                                 **{field: fields[field][row] for field in METADATA}}))
    return tasks
