"""ChatMessages: conversations with a chat template's role per token, packed for SFT.

Reads one conversation per record from Parquet, JSON lines or a Hugging Face dataset, in one of
three shapes (formats.py): the `column` field of messages (default `messages`); a prompt and a
completion (`prompt`/`completion`, strings or message lists, or the columns `columns` names, such
as GSM8K's question and answer), where only the completion is trained; or verl's `prompt` field
of messages. An optional `tools` field holds tool schemas (a list, or a JSON string of one).
`load()` checks every record's shape and messages; the chat template runs when the stream reaches
a record. Roles come from the template (template.py); `load(batch=B)` packs whole conversations
first-fit into `[B, L + 1]` rows:

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
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.data import formats
from dew_lib.data.dataset import Batch, Dataset
from dew_lib.data.encoders import ChatEncoder
from dew_lib.data.loader import Pipeline, as_dataset, check_batch_size
from dew_lib.data.loading import Loading
from dew_lib.data.readers import DataError, HFOptions, PathLike, Rows, read_rows
from dew_lib.data.template import Conversation, check_boundaries, check_messages, label
from dew_lib.data.tokenizer import Renderer, TokenizerSpec, resolve_template
from dew_lib.options import choice, integer

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatMessages:
    """Conversations for SFT; see the module docstring for the batch layout.

    path: a .parquet / .jsonl / .json file (or a list or glob of them), or a Hugging Face
      dataset id or directory, read with `split` and `options`.
    tokenizer: a local tokenizer directory or a Hub name already in the local cache.
    seq_len: L, the number of predictions per row; rows hold L + 1 tokens.
    column: the field holding each conversation's messages; without it, a record is read as a
      prompt and a completion, or (verl) as the messages of `prompt`.
    columns: which fields hold the prompt, completion and tools, e.g. {"prompt": "question",
      "completion": "answer"} for GSM8K; naming prompt or completion selects that shape.
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
    columns: Mapping[str, str] | None = None
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
        object.__setattr__(self, "seq_len", integer("ChatMessages.seq_len", self.seq_len))
        choice("ChatMessages.overflow", self.overflow, OVERFLOW)
        object.__setattr__(self, "pad_id", integer("ChatMessages.pad_id", self.pad_id, at_least=0))
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"ChatMessages.column must be a column name, got {self.column!r}")
        if self.options is not None and not isinstance(self.options, HFOptions):
            raise TypeError(f"ChatMessages.options must be an HFOptions, got {type(self.options).__name__}")
        if not isinstance(self.loading, Loading):
            raise TypeError(f"ChatMessages.loading must be a Loading, got {type(self.loading).__name__}")
        if self.template_kwargs is not None and not isinstance(self.template_kwargs, Mapping):
            raise TypeError("ChatMessages.template_kwargs must be a mapping of template variables")
        formats.check_columns("ChatMessages", self.columns, formats.CHAT_COLUMNS)

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

    def conversations(self, path=None, split=None) -> list[Conversation]:
        """Every record of `path` (default: the training path) as a checked Conversation."""
        rows = read_rows(self.path if path is None else path, split=split or self.split,
                         options=self.options, threads=self.loading.threads)
        return self.read(rows)

    def shape(self, rows: Rows) -> str:
        """Which shape the source holds: 'messages', 'prompt-completion' or 'verl'."""
        names = formats.check_columns("ChatMessages", self.columns, formats.CHAT_COLUMNS)
        asked = self.columns is not None and ({"prompt", "completion"} & set(self.columns))
        if self.column in rows.columns and not asked:
            return "messages"
        if asked or names["completion"] in rows.columns:
            missing = [names[n] for n in ("prompt", "completion") if names[n] not in rows.columns]
            if missing:
                raise DataError(
                    f"{rows.source}: prompt-completion records need the fields {names['prompt']!r} "
                    f"and {names['completion']!r}, but no record has {missing[0]!r}; the fields are "
                    f"{list(rows.columns)}. Set ChatMessages(columns={{'prompt': ..., 'completion': ...}})"
                )
            return "prompt-completion"
        if names["prompt"] in rows.columns:
            return "verl"
        raise DataError(
            f"{rows.source}: missing column {self.column!r} and no prompt/completion fields; the "
            f"columns are {list(rows.columns)}. ChatMessages reads messages from {self.column!r} (set "
            "column=...), or a prompt and a completion (set columns={'prompt': ..., 'completion': ...}, "
            "e.g. for question and answer)"
        )

    def read(self, rows: Rows) -> list[Conversation]:
        """Check every record's shape and messages (no template needed) and return them."""
        names = formats.check_columns("ChatMessages", self.columns, formats.CHAT_COLUMNS)
        shape = self.shape(rows)
        wanted = {"messages": [self.column], "verl": [names["prompt"]],
                  "prompt-completion": [names["prompt"], names["completion"]]}[shape]
        fields = dict.fromkeys([*wanted, names["tools"]])
        values = {name: rows.column(name) for name in fields}  # only the columns read
        out = []
        for index in range(len(rows)):
            record = {name: column[index] for name, column in values.items()}
            where = f"conversation {index} ({rows.where(index)})"
            tools = formats.tools_field(record.get(names["tools"]), names["tools"], where)
            if shape == "prompt-completion":
                messages, context = formats.prompt_and_completion(record, names, where)
                out.append(Conversation(messages, tools, where, context))
                continue
            (column,) = wanted
            stored = record.get(column)
            if stored is None:
                raise DataError(
                    f"{where}: missing column {column!r}; every record needs its messages there (set "
                    "ChatMessages(column=...) to the field that holds them)"
                )
            messages = formats.parse_json_field(stored, column, where)
            check_messages(messages, where)
            out.append(Conversation(list(messages), tools, where))
        return out

    def tokenize(self, messages: Sequence[Mapping], tools: Sequence | None = None, *,
                 context: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Ids and roles of one conversation, to look at before a real run. `context`: how many
        leading messages are the prompt of a prompt-completion record (see template.Conversation)."""
        check_messages(messages, "conversation")
        return label(self.renderer(), list(messages), tools, "conversation", context)

    # ----- the Dataset ----------------------------------------------------------------------------

    def load(self, batch: int) -> Dataset:
        """Read, validate and return a Dataset of packed `[batch, seq_len + 1]` rows."""
        batch = check_batch_size("ChatMessages", batch)
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
