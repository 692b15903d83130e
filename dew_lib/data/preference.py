"""PreferencePairs: (chosen, rejected) pairs with completion masks, for DPO.

A record holds either token ids or text:

- ids: `chosen` and `rejected` token-id lists and, optionally, `chosen_mask` and `rejected_mask`
  lists of 0/1 of the same lengths (1 = completion token, counted by the loss). A missing mask
  counts every token as completion: Dew never guesses a prompt boundary inside a sequence of ids,
  so give masks for prompt-and-answer data.
- text (TRL's preference layout): a `prompt` and the two answers `chosen` and `rejected`, each a
  string or a list of messages (formats.py). With `tokenizer=`, each side is rendered with the
  chat template as prompt + answer, and the prompt alone with the generation prompt; the prompt's
  tokens must be a prefix of each side's tokens, and the mask is 1 from there on. A template that
  renders the prompt differently once an answer follows is refused with the pair's row.

`load(batch=B)` returns batches of

    input_ids        [B, 2, S] int32   index 0 chosen, 1 rejected, right-padded with pad_id
    completion_mask  [B, 2, S] int32   0 on prompt tokens and padding

where S = seq_len is the full row width (use DPOObjective(model, seq_len=S - 1)). A sequence
longer than S is refused, not cut: cutting would drop the end of an answer silently. Every record
is checked (and text tokenized) when `load` runs, so a bad row fails before training starts.

Not here: preference text with an implicit prompt (the prompt repeated inside both answers, as
hh-rlhf stores it); tokenizing text on worker processes (text pairs are tokenized at `load`, in
batches, in the calling process).
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
from dew_lib.data.readers import DataError, HFOptions, PathLike, Rows, open_source, require_columns, token_ids
from dew_lib.data.tokenizer import Renderer, TokenizerSpec, resolve_template
from dew_lib.options import integer

SIDES = ("chosen", "rejected")


def _mask(value: Any, length: int, field: str, where: str) -> np.ndarray:
    if value is None:
        return np.ones(length, np.int32)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise DataError(f"{where}: field {field!r} must be a list of 0 and 1, got {type(value).__name__}")
    if len(value) != length:
        raise DataError(
            f"{where}: field {field!r} has {len(value)} entries but its ids have {length}; a mask "
            "needs one 0/1 per token id"
        )
    for j, item in enumerate(value):
        if item not in (0, 1) or not isinstance(item, (int, np.integer)):
            raise DataError(f"{where}: field {field!r} item {j} is {item!r}; mask entries must be 0 or 1")
    return np.asarray(value, np.int32)


def read_pairs(rows: Rows, width: int, columns: Mapping[str, str] | None = None,
               spec: TokenizerSpec | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every record as ((chosen ids, mask), (rejected ids, mask)), validated; text tokenized."""
    names = formats.check_columns("PreferencePairs", columns, formats.PREFERENCE_COLUMNS)
    require_columns(rows, [names[side] for side in SIDES], "PreferencePairs")
    wanted = dict.fromkeys(names.values())
    values = {column: rows.column(column) for column in wanted}  # None where a record lacks it
    pairs: list = [None] * len(rows)
    texts = []  # (index, where, prompt, chosen, rejected, tools) of text records
    for index in range(len(rows)):
        where = f"pair {index} ({rows.where(index)})"
        record = {column: values[column][index] for column in wanted}  # by the data's field names
        field = {name: record[column] for name, column in names.items()}  # by Dew's names
        for side in SIDES:
            if field[side] is None:
                raise DataError(f"{where}: missing column {names[side]!r}; each pair needs chosen and "
                                "rejected answers (set PreferencePairs(columns=...) to the fields "
                                "that hold them)")
        if formats.is_text(field["chosen"]) or formats.is_text(field["rejected"]):
            for side in SIDES:
                if field[f"{side}_mask"] is not None:
                    raise DataError(f"{where}: field {names[side + '_mask']!r} is given with text "
                                    "answers; masks of text pairs come from the prompt boundary, "
                                    "drop the mask or give token ids")
            if spec is None:
                raise DataError(f"{where}: the answers are text, which needs a tokenizer; pass "
                                "PreferencePairs(tokenizer=...) or give token ids")
            prompt, chosen, rejected = formats.preference_messages(record, names, where)
            tools = formats.tools_field(field["tools"], names["tools"], where)
            texts.append((index, where, prompt, chosen, rejected, tools))
            continue
        sequences = []
        for side in SIDES:
            ids = token_ids(field[side], names[side], where)
            if ids.size == 0:
                raise DataError(f"{where}: field {names[side]!r} is empty; each side needs at least one token")
            _check_width(ids.size, names[side], width, where)
            sequences.append((ids, _mask(field[f"{side}_mask"], ids.size, names[f"{side}_mask"], where)))
        pairs[index] = tuple(sequences)
    if texts:
        if spec is None:  # each text record was refused above without one
            raise DataError("text answers need a tokenizer; pass PreferencePairs(tokenizer=...) or give token ids")
        for index, pair in tokenize_pairs(spec.renderer(), texts, width, names):
            pairs[index] = pair
    return pairs


def _check_width(size: int, field: str, width: int, where: str) -> None:
    if size > width:
        raise DataError(
            f"{where}: field {field!r} has {size} ids, more than seq_len={width}; raise "
            "seq_len or drop the pair (pairs are not cut, that would lose the answer's end)"
        )


def tokenize_pairs(renderer: Renderer, items: Sequence[tuple], width: int,
                   names: Mapping[str, str]) -> list[tuple[int, tuple]]:
    """Ids and masks of text pairs: prompt + answer through the chat template, mask 1 after the
    prompt rendered with the generation prompt, which must be a token prefix of both sides."""
    plain = [i for i, item in enumerate(items) if not item[5]]
    rendered: list[list[str]] = [[] for _ in items]
    for k, (_index, where, prompt, chosen, rejected, tools) in enumerate(items):
        if tools:
            rendered[k] = [_render(renderer, prompt, tools, True, where),
                           _render(renderer, prompt + chosen, tools, False, where),
                           _render(renderer, prompt + rejected, tools, False, where)]
    if plain:
        try:
            columns = [renderer.render_many([items[k][2] for k in plain], generation=True),
                       renderer.render_many([items[k][2] + items[k][3] for k in plain]),
                       renderer.render_many([items[k][2] + items[k][4] for k in plain])]
            for j, k in enumerate(plain):
                rendered[k] = [column[j] for column in columns]
        except Exception:  # a template that refuses some record: render one by one to name it
            for k in plain:
                _, where, prompt, chosen, rejected, _ = items[k]
                rendered[k] = [_render(renderer, prompt, None, True, where),
                               _render(renderer, prompt + chosen, None, False, where),
                               _render(renderer, prompt + rejected, None, False, where)]
    out = []
    for start in range(0, len(items), 512):  # encode in chunks: bounded memory, few calls
        chunk = items[start:start + 512]
        encoded = renderer.encode([text for k in range(start, start + len(chunk)) for text in rendered[k]])
        for j, (index, where, *_rest) in enumerate(chunk):
            prompt_ids, *sides = encoded[3 * j:3 * j + 3]
            pair = []
            for side, ids in zip(SIDES, sides, strict=True):
                if ids[:len(prompt_ids)] != prompt_ids:
                    raise DataError(_boundary_error(renderer, where, side, prompt_ids, ids))
                if len(ids) == len(prompt_ids):
                    raise DataError(f"{where}: the {side} answer adds no tokens after the prompt")
                _check_width(len(ids), names[side], width, where)
                mask = np.zeros(len(ids), np.int32)
                mask[len(prompt_ids):] = 1
                pair.append((np.asarray(ids, np.int32), mask))
            out.append((index, tuple(pair)))
    return out


def _render(renderer: Renderer, messages, tools, generation: bool, where: str) -> str:
    try:
        return renderer.render(messages, tools, generation)
    except Exception as error:
        what = "the prompt with the generation prompt" if generation else "prompt and answer"
        raise DataError(f"{where}: the chat template failed on {what}: {type(error).__name__}: {error}") from None


def _boundary_error(renderer: Renderer, where: str, side: str, prompt: list[int], full: list[int]) -> str:
    j = next((j for j, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
    piece = renderer.tokenizer.convert_ids_to_tokens

    def show(ids):
        return f"{ids[j]} ({piece(ids[j])!r})" if j < len(ids) else "the end"

    return (f"{where}: the prompt rendered with the generation prompt is not a token prefix of the "
            f"prompt followed by the {side} answer: token {j} is {show(prompt)} in the prompt but "
            f"{show(full)} with the answer, so the answer's mask has no boundary. Use a chat "
            "template whose generation prompt starts the assistant turn exactly as it is rendered "
            "(check with `python tools/audit_template.py template --tokenizer ...`), or give token "
            "ids with masks")


def _identity(records: Sequence[Any]) -> list[Any]:
    return list(records)


class _PairEncoder:
    """Pairs are validated at load time; encoding only hands them on."""

    def __call__(self, records):
        return _identity(records)

    def lengths(self, records):
        return [1] * len(records)


@dataclasses.dataclass(frozen=True)
class PairLayout:
    """One pair per batch row."""

    seq_len: int
    pad_id: int
    width = 1  # one slot per row
    fixed_length = 1

    def length(self, item) -> int:
        return 1

    def build(self, rows: int, placed) -> Batch:
        ids = np.full((rows, 2, self.seq_len), self.pad_id, np.int32)
        mask = np.zeros((rows, 2, self.seq_len), np.int32)
        for row, _, sides in placed:
            for side, (tokens, weights) in enumerate(sides):
                ids[row, side, :tokens.size] = tokens
                mask[row, side, :tokens.size] = weights
        return {"input_ids": ids, "completion_mask": mask}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferencePairs:
    """Preference pairs for DPO; see the module docstring for the record and batch layout.

    records: a tuple of JSON strings (or mappings), one pair each; or path: a .parquet / .jsonl
      file (or list or glob), or a Hugging Face dataset read with split and options. Exactly one.
    seq_len: S, the full row width. pad_id: the id written on padding.
    tokenizer: needed for text pairs (a local directory or a cached Hub name), with chat_template
      and template_kwargs as in ChatMessages. columns: which fields hold prompt, chosen, rejected,
      their masks and tools, e.g. {"chosen": "preferred"}.
    val_records / val_path: pairs for validation (at most one). loading: prefetch and shuffle
      seed (there is nothing to tokenize, so workers are not used).
    """

    records: Sequence[str | Mapping] | None = None
    path: PathLike | Sequence[PathLike] | None = None
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
        formats.check_columns("PreferencePairs", self.columns, formats.PREFERENCE_COLUMNS)
        if self.template_kwargs is not None and not isinstance(self.template_kwargs, Mapping):
            raise TypeError("PreferencePairs.template_kwargs must be a mapping of template variables")
        check_sources("PreferencePairs", self.records, self.path, self.val_records, self.val_path)
        object.__setattr__(self, "seq_len", integer("PreferencePairs.seq_len", self.seq_len, at_least=2,
                                                    accepts="an integer >= 2 (the full row width)"))
        object.__setattr__(self, "pad_id", integer("PreferencePairs.pad_id", self.pad_id, at_least=0))
        if not isinstance(self.loading, Loading):
            raise TypeError(f"PreferencePairs.loading must be a Loading, got {type(self.loading).__name__}")

    def spec(self) -> TokenizerSpec | None:
        if self.tokenizer is None:
            return None
        return TokenizerSpec(name=os.fspath(self.tokenizer), chat_template=resolve_template(self.chat_template),
                             template_kwargs=tuple(sorted((self.template_kwargs or {}).items())))

    def pairs(self, records=None, path=None) -> list:
        rows = open_source(records, path, split=self.split, options=self.options,
                           threads=self.loading.threads, owner="PreferencePairs")
        return read_pairs(rows, self.seq_len, self.columns, self.spec())

    def load(self, batch: int) -> Dataset:
        """Validate every pair and return a Dataset of `[batch, 2, seq_len]` batches."""
        batch = check_batch_size("PreferencePairs", batch)
        loading = dataclasses.replace(self.loading, workers=0)
        layout = PairLayout(self.seq_len, self.pad_id)
        train = Pipeline(self.pairs(self.records, self.path), _PairEncoder(), layout, loading)
        val = None
        if self.val_records is not None or self.val_path is not None:
            val = Pipeline(self.pairs(self.val_records, self.val_path), _PairEncoder(), layout, loading)
        return as_dataset(train, val, batch)


__all__ = ["PairLayout", "PreferencePairs", "read_pairs", "tokenize_pairs"]
