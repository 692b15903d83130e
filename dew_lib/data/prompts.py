"""Prompts: prompt ids and reward metadata for GRPO, from Parquet or JSON records (verl's layout too).

Each record has a `prompt` (token ids, a string, or a list of chat messages) and optional reward
fields `data_source`, `ground_truth` and `extra_info`. verl's parquet is read as it is: its
`reward_model.ground_truth` is the ground truth, `tools_kwargs` stays inside `extra_info` (a
top-level `tools_kwargs` column is moved there), and `ability` and `agent_name` are read and
dropped. Missing reward fields become empty strings; values that are not strings travel as JSON
text. `load(batch=B)` returns batches of

    prompt         [B, P] int32   left-padded with pad_id; a longer prompt keeps its end
    prompt_length  [B]    int32   real tokens at the end of each row
    data_source, ground_truth, extra_info
                   [B, W] int32   UTF-8 bytes, zero-padded on the right; W is the longest value
                                  of that field in the data, so every batch has one shape
    task_id        [B]    int32   with `row_ids=True` only: the record's row in its file
                                  (validation rows: in theirs), the id EpisodeRollout names
                                  the task by
    completion     [B, C] int32   with `completion` set only: each record's completion ids,
                                  right-padded with pad_id; a longer one keeps its start
    completion_length [B] int32   its real ids at the start of each row (at least 1)

with P = max_prompt_len and C = max_completion_len. `text_field` turns a metadata array back into
strings. Strings are tokenized with the tokenizer's special tokens (e.g. BOS); messages through
the chat template with the generation prompt. Token-id prompts never load a tokenizer.

Completions (`completion`: the field holding them) are what DistillRollout trains on in the steps
where the student does not sample (docs/distill.md). A completion is token ids, taken as they
are, or a string, tokenized without special tokens and followed by `completion_eos` (the id the
student stops at, e.g. the tokenizer's eos: what SFT trains after an assistant turn's content in
ChatML templates), so it ends as a sampled completion does. A string is cut after its eos is
added, so a cut completion has none. `last_turns` makes such records from conversations: the
messages before each one's last assistant turn are the prompt, that turn's text the completion.
Token-id completions, like token-id prompts, never load a tokenizer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.data.dataset import Batch, Dataset
from dew_lib.data.encoders import PromptEncoder
from dew_lib.data.loader import Pipeline, as_dataset, check_batch_size, check_sources
from dew_lib.data.loading import Loading
from dew_lib.data.readers import (
    DataError,
    HFOptions,
    PathLike,
    Rows,
    json_text,
    open_source,
    require_columns,
    token_ids,
)
from dew_lib.data.template import Conversation, check_messages
from dew_lib.data.tokenizer import TokenizerSpec, resolve_template
from dew_lib.options import integer

METADATA = ("data_source", "ground_truth", "extra_info")


def text_field(values: np.ndarray) -> list[str]:
    """The strings of a `[B, W]` UTF-8 metadata array (trailing zero bytes removed)."""
    return [bytes(np.asarray(row, np.uint8)).rstrip(b"\0").decode("utf-8") for row in np.asarray(values)]


def prompt_kind(value: Any, where: str) -> str:
    """'ids', 'text' or 'messages'; anything else is refused."""
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: the prompt is an empty string")
        return "text"
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if not value:
            raise DataError(f"{where}: the prompt is an empty list")
        if all(isinstance(item, Mapping) for item in value):
            return "messages"
        if all(isinstance(item, (int, float, np.integer, np.floating)) for item in value):
            return "ids"  # token_ids refuses the non-integers with their position
    raise DataError(
        f"{where}: the prompt is neither token ids, a string nor a list of messages "
        f"(got {type(value).__name__} {repr(value)[:60]}); give one of those three"
    )


def completion_kind(value: Any, column: str, where: str) -> str:
    """'ids' or 'text'; anything else (an empty id list included) is refused."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(item, (int, float, np.integer, np.floating))
                                                for item in value):
        if not value:
            raise DataError(f"{where}: the completion ({column!r}) is an empty list of ids; give at least one")
        return "ids"  # token_ids refuses the non-integers with their position
    raise DataError(f"{where}: the completion ({column!r}) is neither token ids nor a string (got "
                    f"{type(value).__name__} {repr(value)[:60]}); give one of those two")


def last_turns(conversations: Sequence[Conversation], *, prompt: str = "prompt",
               completion: str = "completion") -> list[dict]:
    """Records for `Prompts(records=..., column=prompt, completion=completion)` from checked
    conversations (e.g. `ChatMessages.conversations()`): each one's messages before its last
    assistant message are the prompt (rendered with the generation prompt), that message's text
    the completion, and its tools stay with it. Messages after that last assistant message are
    dropped. An assistant message that calls tools, or whose content is not text, is refused: the
    completion would not be what the template renders for it."""
    out = []
    for messages, tools, where, *_ in conversations:
        last = max((k for k, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None:
            raise DataError(f"{where}: the conversation has no assistant message to take the completion from")
        turn = messages[last]
        content = turn.get("content")
        if turn.get("tool_calls") or not isinstance(content, str):
            why = "calls tools" if turn.get("tool_calls") else f"has content {repr(content)[:40]}"
            raise DataError(f"{where}: its last assistant message (message {last}) {why}; the completion is "
                            "that message's text alone, so end each conversation with a plain text answer")
        record = {prompt: list(messages[:last]), completion: content}
        if tools:
            record["tools"] = tools
        out.append(record)
    return out


def _metadata(record: Mapping[str, Any], where: str) -> tuple[bytes, bytes, bytes]:
    truth = record.get("ground_truth")
    reward_model = record.get("reward_model")
    if truth is None and isinstance(reward_model, Mapping):
        truth = reward_model.get("ground_truth")  # verl: reward_model.ground_truth
    extra = record.get("extra_info")
    tools_kwargs = record.get("tools_kwargs")
    if tools_kwargs is not None:
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise DataError(f"{where}: has tools_kwargs but its extra_info is not a mapping to keep them in")
        extra = {**extra, "tools_kwargs": extra.get("tools_kwargs", tools_kwargs)}
    # `ability` and `agent_name` (verl) are read with the record and dropped here.
    source, truth_text, extra_text = (json_text(value).encode("utf-8")
                                      for value in (record.get("data_source"), truth, extra))
    return source, truth_text, extra_text


@dataclasses.dataclass(frozen=True)
class PromptLayout:
    """One prompt per batch row."""

    max_len: int
    pad_id: int
    widths: tuple[int, int, int]  # bytes of data_source, ground_truth, extra_info
    row_ids: bool = False  # add task_id: each record's row
    completion_len: int | None = None  # C: add completion and completion_length
    width = 1  # one slot per row
    fixed_length = 1

    def length(self, item) -> int:
        return 1

    def build(self, rows: int, placed) -> Batch:
        prompt = np.full((rows, self.max_len), self.pad_id, np.int32)
        length = np.zeros(rows, np.int32)
        fields = [np.zeros((rows, w), np.int32) for w in self.widths]
        task = np.zeros(rows, np.int32)
        completion = np.full((rows, self.completion_len or 0), self.pad_id, np.int32)
        completion_length = np.zeros(rows, np.int32)
        for row, _, (ids, (*metadata, index), answer) in placed:
            prompt[row, self.max_len - ids.size:] = ids
            length[row], task[row] = ids.size, index
            for array, value in zip(fields, metadata, strict=True):
                array[row, :len(value)] = np.frombuffer(value, np.uint8)
            if answer is not None:
                completion[row, :answer.size], completion_length[row] = answer, answer.size
        ids = {"task_id": task} if self.row_ids else {}
        if self.completion_len is not None:
            ids.update(completion=completion, completion_length=completion_length)
        return {"prompt": prompt, "prompt_length": length, **dict(zip(METADATA, fields, strict=True)), **ids}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompts:
    """Prompts for GRPO; see the module docstring for the record and batch layout.

    records: a tuple of JSON strings (or mappings); or path: .parquet / .jsonl (list or glob) or a
      Hugging Face dataset read with split and options. Exactly one.
    max_prompt_len: P. tokenizer: needed only for string and message prompts (a local directory
      or a cached Hub name), with chat_template / template_kwargs as in ChatMessages.
    column: the field holding the prompt. pad_id: the id written on left padding.
    val_records / val_path: prompts for validation (at most one). loading: as in ChatMessages.
    row_ids: add each record's row as `task_id`, for tool episodes (EpisodeRollout's task rows).
    completion: the field holding each record's completion (token ids or a string), for
      DistillRollout's steps on the data; None (default): no completions. Every record needs one.
    max_completion_len: C, the completion ids kept (the start); required with `completion`.
    completion_eos: the id that ends each string completion (the tokenizer's eos id, e.g.
      `tokenizer.eos_token_id`); required when a completion is a string, unused for ids.
    """

    records: Sequence[str | Mapping] | None = None
    path: PathLike | Sequence[PathLike] | None = None
    max_prompt_len: int
    tokenizer: str | os.PathLike | None = None
    column: str = "prompt"
    split: str | None = None
    options: HFOptions | None = None
    chat_template: str | os.PathLike | None = None
    template_kwargs: Mapping[str, Any] | None = None
    pad_id: int = 0
    val_records: Sequence[str | Mapping] | None = None
    val_path: PathLike | Sequence[PathLike] | None = None
    loading: Loading = Loading()
    row_ids: bool = False
    completion: str | None = None
    max_completion_len: int | None = None
    completion_eos: int | None = None

    def __post_init__(self):
        check_sources("Prompts", self.records, self.path, self.val_records, self.val_path)
        object.__setattr__(self, "max_prompt_len", integer("Prompts.max_prompt_len", self.max_prompt_len))
        object.__setattr__(self, "pad_id", integer("Prompts.pad_id", self.pad_id, at_least=0))
        if self.completion is None:
            given = [f"{name}={getattr(self, name)}" for name in ("max_completion_len", "completion_eos")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"Prompts.{given[0]} is set and completion is empty: set completion to the "
                                 "field that holds each record's completion, or leave both out")
        else:
            if not isinstance(self.completion, str) or not self.completion:
                raise ValueError(f"Prompts.completion must be a column name, got {self.completion!r}")
            if self.max_completion_len is None:
                raise ValueError(f"Prompts.completion={self.completion!r} needs max_completion_len: the "
                                 "completion ids each row keeps (e.g. the distillation's max_new_tokens)")
            object.__setattr__(self, "max_completion_len",
                               integer("Prompts.max_completion_len", self.max_completion_len))
            object.__setattr__(self, "completion_eos",
                               integer("Prompts.completion_eos", self.completion_eos, optional=True, at_least=0))
        if not isinstance(self.loading, Loading):
            raise TypeError(f"Prompts.loading must be a Loading, got {type(self.loading).__name__}")

    def spec(self) -> TokenizerSpec | None:
        if self.tokenizer is None:
            return None
        return TokenizerSpec(name=os.fspath(self.tokenizer), chat_template=resolve_template(self.chat_template),
                             template_kwargs=tuple(sorted((self.template_kwargs or {}).items())))

    def prompts(self, records=None, path=None) -> list[tuple]:
        """(kind, prompt, tools, where, (*metadata, row index), completion) of every record,
        validated; completion: None without `self.completion`, else int32 ids or a string."""
        rows: Rows = open_source(records, path, split=self.split, options=self.options,
                                 threads=self.loading.threads, owner="Prompts")
        require_columns(rows, [self.column] + ([self.completion] if self.completion else []), "Prompts")
        records_ = rows.get(range(len(rows)))
        out = []
        for index, record in enumerate(records_):
            where = f"prompt {index} ({rows.where(index)})"
            if record.get(self.column) is None:
                raise DataError(f"{where}: missing column {self.column!r}; set Prompts(column=...) to the "
                                "field that holds the prompt")
            prompt = record[self.column]
            kind = prompt_kind(prompt, where)
            tools = record.get("tools")
            if kind == "ids":
                prompt = token_ids(prompt, self.column, where)
            elif kind == "messages":
                check_messages(prompt, where)
                prompt = list(prompt)
            completion = self._completion(record, where)
            out.append((kind, prompt, tools, where, (*_metadata(record, where), index), completion))
        needs = next((item for item in out if item[0] != "ids"), None)
        if needs is not None and self.tokenizer is None:
            raise DataError(
                f"{needs[3]}: the prompt is {'a string' if needs[0] == 'text' else 'a list of messages'}, "
                "which needs a tokenizer; pass Prompts(tokenizer=...) or give token ids"
            )
        text = next((item for item in out if isinstance(item[5], str)), None)
        if text is not None and self.tokenizer is None:
            raise DataError(f"{text[3]}: the completion ({self.completion!r}) is a string, which needs a "
                            "tokenizer; pass Prompts(tokenizer=...) or give token ids")
        return out

    def _completion(self, record: Mapping[str, Any], where: str) -> np.ndarray | str | None:
        """The record's completion: int32 ids, or a string the encoder tokenizes; None when unset."""
        if self.completion is None:
            return None
        value = record.get(self.completion)
        if value is None:
            raise DataError(f"{where}: missing column {self.completion!r}, the completion every record needs "
                            "with Prompts(completion=...); give each record one, or set completion to the "
                            "field that holds it")
        if completion_kind(value, self.completion, where) == "ids":
            return token_ids(value, self.completion, where)
        if self.completion_eos is None:
            raise DataError(f"{where}: the completion ({self.completion!r}) is a string, tokenized without "
                            "special tokens and ended by Prompts.completion_eos, which is empty: pass the id "
                            "the student stops at (e.g. completion_eos=tokenizer.eos_token_id), or give ids")
        return value

    def load(self, batch: int) -> Dataset:
        """Validate every prompt and return a Dataset of `[batch, max_prompt_len]` prompt batches."""
        batch = check_batch_size("Prompts", batch)
        train_items = self.prompts(self.records, self.path)
        val_items = None
        if self.val_records is not None or self.val_path is not None:
            val_items = self.prompts(self.val_records, self.val_path)
        items = train_items + (val_items or [])
        source, truth, extra = (max(len(item[4][f]) for item in items) for f in range(len(METADATA)))
        widths = (source, truth, extra)  # bytes of each METADATA field
        spec = self.spec()
        if spec is not None and any(item[0] == "messages" for item in items):
            spec.renderer()  # fails here, not in a worker, when the template is missing
        encoder = PromptEncoder(spec=spec, max_len=self.max_prompt_len, completion_len=self.max_completion_len,
                                completion_eos=self.completion_eos)
        layout = PromptLayout(self.max_prompt_len, self.pad_id, widths, bool(self.row_ids), self.max_completion_len)
        tokenized = any(i[0] != "ids" or isinstance(i[5], str) for i in items)
        loading = self.loading if spec is not None and tokenized else dataclasses.replace(self.loading, workers=0)
        train = Pipeline(train_items, encoder, layout, loading)
        val = None if val_items is None else Pipeline(val_items, encoder, layout, loading, share=train)
        train.pool()  # start the workers now: they load while the caller builds the model
        return as_dataset(train, val, batch)


__all__ = ["METADATA", "PromptLayout", "Prompts", "completion_kind", "last_turns", "prompt_kind", "text_field"]
