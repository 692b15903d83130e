"""ChatMessages: conversations with a chat template's role per token, packed for SFT.

Reads one conversation per record from Parquet, JSON lines or a Hugging Face dataset: the
`column` field (default `messages`), or verl's `prompt` field when the record has no such column,
plus an optional `tools` field of tool schemas (a list, or a JSON string of one). Roles come from
the tokenizer's chat template (template.py); `load(batch=B)` packs whole conversations first-fit
into `[B, L + 1]` rows:

    text              token ids, `pad_id` where nothing is packed
    text_roles        Role per token (int8), Role.NONE on padding
    text_segment_ids  1, 2, ... for the conversations of a row, 0 on padding
    text_positions    position within its conversation, 0 on padding

These feed `LMObjective(model, L, loss_role=Role.ASSISTANT)` directly. A conversation longer than
L + 1 tokens is cut to its first L + 1 (`overflow="truncate"`) or refused (`overflow="raise"`).

Not here: multimodal content (image or audio parts are passed to the template as they are, and
their placeholder ids would be trained without the media), splitting long conversations across
rows.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.data.dataset import Batch, Dataset
from dew_lib.data.encoders import ChatEncoder
from dew_lib.data.loader import Pipeline, as_dataset, check_batch_size
from dew_lib.data.loading import Loading
from dew_lib.data.readers import DataError, HFOptions, PathLike, read_rows, require_columns
from dew_lib.data.template import check_boundaries, check_messages, label
from dew_lib.data.tokenizer import Renderer, TokenizerSpec, resolve_template

OVERFLOW = ("truncate", "raise")


@dataclasses.dataclass(frozen=True)
class ChatLayout:
    """Packs conversations into rows; each keeps its own segment id and positions."""

    width: int
    pad_id: int
    fixed_length = None

    def length(self, item) -> int:
        return int(item[0].size)

    def build(self, rows: int, placed: list[tuple[int, int, Any]]) -> Batch:
        text = np.full((rows, self.width), self.pad_id, np.int32)
        roles = np.zeros((rows, self.width), np.int8)
        segments = np.zeros((rows, self.width), np.int32)
        positions = np.zeros((rows, self.width), np.int32)
        count = np.zeros(rows, np.int32)
        for row, offset, (ids, labels) in placed:
            end = offset + ids.size
            count[row] += 1
            text[row, offset:end] = ids
            roles[row, offset:end] = labels
            segments[row, offset:end] = count[row]
            positions[row, offset:end] = np.arange(ids.size, dtype=np.int32)
        return {"text": text, "text_roles": roles, "text_segment_ids": segments,
                "text_positions": positions}


def _parse_json_field(value: Any, name: str, where: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: field {name!r} is a string but not valid JSON ({error.msg})") from None
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatMessages:
    """Conversations for SFT; see the module docstring for the batch layout.

    path: a .parquet / .jsonl / .json file (or a list or glob of them), or a Hugging Face
      dataset id or directory, read with `split` and `options`.
    tokenizer: a local tokenizer directory or a Hub name already in the local cache.
    seq_len: L, the number of predictions per row; rows hold L + 1 tokens.
    column: the field holding each conversation; verl's `prompt` is used when it is absent.
    val_path, val_split: validation conversations (default split: `split`).
    chat_template: template text or a .jinja path to use instead of the tokenizer's own.
    template_kwargs: extra variables for the template, e.g. {"enable_thinking": False}.
    overflow: "truncate" (cut long conversations to L + 1 tokens) or "raise".
    pad_id: the id written on padding (never trained on: its segment id is 0).
    loading: workers, threads, prefetch and shuffle seed.
    """

    path: PathLike | Sequence[PathLike]
    tokenizer: str | os.PathLike
    seq_len: int
    column: str = "messages"
    split: str | None = None
    options: HFOptions | None = None
    val_path: PathLike | Sequence[PathLike] | None = None
    val_split: str | None = None
    chat_template: str | os.PathLike | None = None
    template_kwargs: Mapping[str, Any] | None = None
    overflow: str = "truncate"
    pad_id: int = 0
    loading: Loading = Loading()

    def __post_init__(self):
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"ChatMessages.seq_len must be a positive integer, got {self.seq_len!r}")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"ChatMessages.overflow must be one of {OVERFLOW}, got {self.overflow!r}")
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int) or self.pad_id < 0:
            raise ValueError(f"ChatMessages.pad_id must be a non-negative integer, got {self.pad_id!r}")
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"ChatMessages.column must be a column name, got {self.column!r}")
        if self.options is not None and not isinstance(self.options, HFOptions):
            raise TypeError(f"ChatMessages.options must be an HFOptions, got {type(self.options).__name__}")
        if not isinstance(self.loading, Loading):
            raise TypeError(f"ChatMessages.loading must be a Loading, got {type(self.loading).__name__}")
        if self.template_kwargs is not None and not isinstance(self.template_kwargs, Mapping):
            raise TypeError("ChatMessages.template_kwargs must be a mapping of template variables")

    # ----- pieces ---------------------------------------------------------------------------------

    def spec(self) -> TokenizerSpec:
        return TokenizerSpec(
            name=os.fspath(self.tokenizer),
            chat_template=resolve_template(self.chat_template),
            template_kwargs=tuple(sorted((self.template_kwargs or {}).items())),
        )

    def renderer(self) -> Renderer:
        """The renderer this loader uses, after checking that its template marks assistant turns."""
        renderer = self.spec().renderer()
        check_boundaries(renderer)
        return renderer

    def conversations(self, path=None, split=None) -> list[tuple[list, list | None, str]]:
        """(messages, tools, where) of every record of `path` (default: the training path)."""
        rows = read_rows(self.path if path is None else path, split=split or self.split,
                         options=self.options, threads=self.loading.threads)
        column = self.column
        if column not in rows.columns and "prompt" in rows.columns:
            column = "prompt"
        require_columns(rows, [column], "ChatMessages conversations")
        messages_column = rows.column(column)
        tools_column = rows.column("tools") if "tools" in rows.columns else [None] * len(rows)
        out = []
        for index, (messages, tools) in enumerate(zip(messages_column, tools_column, strict=True)):
            where = f"conversation {index} ({rows.where(index)})"
            if messages is None:
                raise DataError(
                    f"{where}: missing column {self.column!r} (and no verl 'prompt' column); set "
                    "ChatMessages(column=...) to the field that holds the messages"
                )
            messages = _parse_json_field(messages, column, where)
            check_messages(messages, where)
            tools = _parse_json_field(tools, "tools", where)
            if tools is not None and not isinstance(tools, list):
                raise DataError(f"{where}: field 'tools' must be a list of tool schemas, got {type(tools).__name__}")
            out.append((list(messages), tools or None, where))
        return out

    def tokenize(self, messages: Sequence[Mapping], tools: Sequence | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Ids and roles of one conversation, to look at before a real run."""
        check_messages(messages, "conversation")
        return label(self.renderer(), list(messages), tools, "conversation")

    # ----- the Dataset ----------------------------------------------------------------------------

    def load(self, batch: int) -> Dataset:
        """Read, validate and return a Dataset of packed `[batch, seq_len + 1]` rows."""
        check_batch_size("ChatMessages", batch)
        self.renderer()  # fails now, not in a worker, when the tokenizer or template is unusable
        width = self.seq_len + 1
        encoder = ChatEncoder(spec=self.spec(), width=width, overflow=self.overflow)
        layout = ChatLayout(width, self.pad_id)
        train = Pipeline(self.conversations(), encoder, layout, self.loading)
        val = None
        if self.val_path is not None:
            val = Pipeline(self.conversations(self.val_path, self.val_split), encoder, layout,
                           self.loading, share=train)
        train.pool()  # start the workers now: they load while the caller builds the model
        return as_dataset(train, val, batch)


__all__ = ["ChatLayout", "ChatMessages"]
