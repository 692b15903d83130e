"""UnpairedExamples: single completions labelled desirable or not, for KTO (TRL's unpaired layout).

A record holds a `prompt`, a `completion` and a boolean `label` (True: desirable), either as
token-id lists or as text (a string or a list of messages, rendered with the tokenizer's chat
template as PreferencePairs renders an answer: the mask starts where the prompt with the
generation prompt ends). `UnpairedExamples.from_pairs(pairs)` reads a PreferencePairs source
instead and makes two examples of each pair, the chosen answer desirable and the rejected one
not; its prompt is every id before the first masked one.

`load(batch=B)` returns batches of

    input_ids           [B, S] int32   prompt then completion, right-padded with pad_id
    completion_mask     [B, S] int32   1 on the completion
    label               [B]    int32   1 desirable, 0 undesirable
    kl_input_ids        [B, S] int32   row i's prompt followed by row i-1's completion (row 0
    kl_completion_mask  [B, S] int32   takes the last row's), cut at S

S = seq_len is the full row width (use KTOObjective(model, seq_len=S - 1)). The mismatched rows
are TRL's estimate of the KL term: KTOTrainer rotates completions by one within each batch the
same way. A prompt followed by its own completion longer than S is refused; a mismatched row
longer than S is cut, as TRL cuts it at max_length, since it only estimates a batch mean.

Not here: TRL's desirability-balance warning, unpaired data whose prompt is inside the
completion (give the prompt in its own field, or ids).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.data import formats
from dew_lib.data.dataset import Batch, Dataset
from dew_lib.data.loader import Pipeline, as_dataset, check_batch_size, check_sources
from dew_lib.data.loading import Loading
from dew_lib.data.preference import PreferencePairs, _PairEncoder, tokenize_pairs
from dew_lib.data.readers import DataError, HFOptions, PathLike, Rows, open_source, require_columns, token_ids
from dew_lib.data.tokenizer import TokenizerSpec, resolve_template
from dew_lib.options import integer

COLUMNS = ("prompt", "completion", "label", "tools")

Example = tuple[np.ndarray, np.ndarray, np.ndarray, int]  # prompt ids, completion ids, completion mask, label


def _label(value: Any, column: str, where: str) -> int:
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return int(value)
    raise DataError(f"{where}: field {column!r} is {value!r}; a label is true (desirable) or false")


def read_examples(rows: Rows, width: int, columns: Mapping[str, str] | None = None,
                  spec: TokenizerSpec | None = None) -> list[Example]:
    """Every record as (prompt ids, completion ids, completion mask, label), validated."""
    names = formats.check_columns("UnpairedExamples", columns, COLUMNS)
    require_columns(rows, [names["prompt"], names["completion"], names["label"]], "UnpairedExamples")
    values = {name: rows.column(column) for name, column in names.items()}
    examples: list = [None] * len(rows)
    texts = []
    labels: dict[int, int] = {}
    for index in range(len(rows)):
        where = f"example {index} ({rows.where(index)})"
        field = {name: values[name][index] for name in names}
        for name in ("prompt", "completion", "label"):
            if field[name] is None:
                raise DataError(f"{where}: missing column {names[name]!r}; each example needs a prompt, a "
                                "completion and a label (set UnpairedExamples(columns=...) to its fields)")
        label = _label(field["label"], names["label"], where)
        if formats.is_text(field["completion"]) or formats.is_text(field["prompt"]):
            if spec is None:
                raise DataError(f"{where}: the example is text, which needs a tokenizer; pass "
                                "UnpairedExamples(tokenizer=...) or give token ids")
            record = {"prompt": field["prompt"], "chosen": field["completion"], "rejected": field["completion"]}
            messages, answer, _ = formats.preference_messages(record, {"prompt": "prompt", "chosen": "chosen",
                                                                       "rejected": "rejected"}, where)
            tools = formats.tools_field(field["tools"], names["tools"], where)
            labels[index] = label
            texts.append((index, where, messages, answer, answer, tools))  # rendered as a pair of twins
            continue
        prompt = token_ids(field["prompt"], names["prompt"], where)
        completion = token_ids(field["completion"], names["completion"], where)
        if prompt.size == 0 or completion.size == 0:
            raise DataError(f"{where}: the prompt and the completion each need at least one token id")
        _fits(prompt.size + completion.size, width, where)
        examples[index] = (prompt, completion, np.ones(completion.size, np.int32), label)
    if texts:
        assert spec is not None
        side = {"chosen": names["completion"], "rejected": names["completion"]}
        for index, ((ids, mask), _) in tokenize_pairs(spec.renderer(), texts, width, side):
            start = int(np.argmax(mask))
            examples[index] = (ids[:start], ids[start:], mask[start:], labels[index])
    return examples


def _fits(size: int, width: int, where: str) -> None:
    if size > width:
        raise DataError(f"{where}: prompt and completion hold {size} ids, more than seq_len={width}; raise "
                        "seq_len or drop the example (examples are not cut)")


def split_pairs(pairs: Sequence[tuple]) -> list[Example]:
    """Two examples per preference pair: the chosen answer desirable, the rejected one not; the
    prompt is every id before the first completion id."""
    out = []
    for sides in pairs:
        for (ids, mask), label in zip(sides, (1, 0), strict=True):
            start = int(np.argmax(mask > 0)) if mask.any() else ids.size
            out.append((ids[:start], ids[start:], mask[start:], label))
    return out


@dataclasses.dataclass(frozen=True)
class UnpairedLayout:
    """One example per batch row, and each row's mismatched partner built from its neighbour."""

    seq_len: int
    pad_id: int
    width = 1
    fixed_length = 1

    def length(self, item) -> int:
        return 1

    def build(self, rows: int, placed) -> Batch:
        s = self.seq_len
        out: dict[str, np.ndarray] = {name: np.full((rows, s), self.pad_id, np.int32)
                                      for name in ("input_ids", "kl_input_ids")}
        out |= {name: np.zeros((rows, s), np.int32) for name in ("completion_mask", "kl_completion_mask")}
        out["label"] = np.zeros(rows, np.int32)
        for k, (row, _, (prompt, completion, mask, label)) in enumerate(placed):
            n = prompt.size + completion.size
            out["input_ids"][row, :n] = np.concatenate([prompt, completion])
            out["completion_mask"][row, prompt.size:n] = mask
            out["label"][row] = label
            _, _, (_, other, other_mask, _) = placed[k - 1]  # TRL's rotation: the previous row's completion
            kl = np.concatenate([prompt, other])[:s]
            out["kl_input_ids"][row, :kl.size] = kl
            out["kl_completion_mask"][row, prompt.size:kl.size] = other_mask[:kl.size - prompt.size]
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnpairedExamples:
    """Labelled single completions for KTO; see the module docstring for records and batches.

    records: a tuple of JSON strings (or mappings); or path: a .parquet / .jsonl file (or list or
      glob), or a Hugging Face dataset read with split and options. pairs: a PreferencePairs
      whose pairs become two examples each (`from_pairs`). Exactly one of the three.
    seq_len: S, the full row width. pad_id: the id written on padding. tokenizer, chat_template,
      template_kwargs: for text, as in PreferencePairs. columns: which fields hold prompt,
      completion, label and tools. val_records / val_path: validation examples. loading: prefetch
      and shuffle seed.
    """

    records: Sequence[str | Mapping] | None = None
    path: PathLike | Sequence[PathLike] | None = None
    pairs: PreferencePairs | None = None
    seq_len: int
    pad_id: int = 0
    split: str | None = None
    options: HFOptions | None = None
    val_records: Sequence[str | Mapping] | None = None
    val_path: PathLike | Sequence[PathLike] | None = None
    tokenizer: str | os.PathLike | None = None
    chat_template: str | os.PathLike | None = None
    template_kwargs: Mapping[str, Any] | None = None
    columns: Mapping[str, str] | None = None
    loading: Loading = Loading()

    def __post_init__(self):
        formats.check_columns("UnpairedExamples", self.columns, COLUMNS)
        if self.pairs is None:
            check_sources("UnpairedExamples", self.records, self.path, self.val_records, self.val_path)
        elif not isinstance(self.pairs, PreferencePairs) or self.records is not None or self.path is not None:
            raise ValueError("UnpairedExamples.pairs takes a PreferencePairs, and no records= or path= beside it")
        object.__setattr__(self, "seq_len", integer("UnpairedExamples.seq_len", self.seq_len, at_least=2,
                                                    accepts="an integer >= 2 (the full row width)"))
        object.__setattr__(self, "pad_id", integer("UnpairedExamples.pad_id", self.pad_id, at_least=0))
        if not isinstance(self.loading, Loading):
            raise TypeError(f"UnpairedExamples.loading must be a Loading, got {type(self.loading).__name__}")

    @classmethod
    def from_pairs(cls, pairs: PreferencePairs) -> UnpairedExamples:
        """KTO's examples from preference pairs: chosen answers desirable, rejected ones not."""
        return cls(pairs=pairs, seq_len=pairs.seq_len, pad_id=pairs.pad_id, loading=pairs.loading)

    def spec(self) -> TokenizerSpec | None:
        if self.tokenizer is None:
            return None
        return TokenizerSpec(name=os.fspath(self.tokenizer), chat_template=resolve_template(self.chat_template),
                             template_kwargs=tuple(sorted((self.template_kwargs or {}).items())))

    def examples(self, records=None, path=None) -> list[Example]:
        rows = open_source(records, path, split=self.split, options=self.options,
                           threads=self.loading.threads, owner="UnpairedExamples")
        return read_examples(rows, self.seq_len, self.columns, self.spec())

    def load(self, batch: int) -> Dataset:
        """Validate every example and return a Dataset of `[batch, seq_len]` batches."""
        batch = check_batch_size("UnpairedExamples", batch)
        loading = dataclasses.replace(self.loading, workers=0)
        layout = UnpairedLayout(self.seq_len, self.pad_id)
        if self.pairs is not None:
            source = self.pairs
            train_items = split_pairs(source.pairs(source.records, source.path))
            val_items = None
            if source.val_records is not None or source.val_path is not None:
                val_items = split_pairs(source.pairs(source.val_records, source.val_path))
        else:
            train_items = self.examples(self.records, self.path)
            val_items = None
            if self.val_records is not None or self.val_path is not None:
                val_items = self.examples(self.val_records, self.val_path)
        train = Pipeline(train_items, _PairEncoder(), layout, loading)
        val = None if val_items is None else Pipeline(val_items, _PairEncoder(), layout, loading)
        return as_dataset(train, val, batch)


__all__ = ["UnpairedExamples", "UnpairedLayout", "read_examples", "split_pairs"]
