"""PreferencePairs: token-id pairs (chosen, rejected) with completion masks, for DPO.

Each record holds `chosen` and `rejected` token-id lists and, optionally, `chosen_mask` and
`rejected_mask` lists of 0/1 of the same lengths (1 = completion token, counted by the loss). A
missing mask counts every token as completion: Dew never guesses the prompt boundary from text,
so give masks for prompt-and-answer data. `load(batch=B)` returns batches of

    input_ids        [B, 2, S] int32   index 0 chosen, 1 rejected, right-padded with pad_id
    completion_mask  [B, 2, S] int32   0 on prompt tokens and padding

where S = seq_len is the full row width (use DPOObjective(model, seq_len=S - 1)). A sequence
longer than S is refused, not cut: cutting would drop the end of an answer silently. Every record
is checked when `load` runs, so a bad row fails before training starts.

Not here: tokenizing text pairs (tokenize prompt and answers yourself, with the same tokenizer and
chat format, and take masks from those token boundaries).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.data.dataset import Batch, Dataset
from dew_lib.data.loader import Pipeline, as_dataset, check_batch_size, check_sources
from dew_lib.data.loading import Loading
from dew_lib.data.readers import (DataError, HFOptions, PathLike, Rows, open_source, require_columns,
                                  token_ids)

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


def read_pairs(rows: Rows, width: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every record as (ids [2, n], masks [2, n]) lists, validated."""
    require_columns(rows, SIDES, "PreferencePairs")
    columns = {name: rows.column(name) for name in (*SIDES, "chosen_mask", "rejected_mask")}
    pairs = []
    for index in range(len(rows)):
        where = f"pair {index} ({rows.where(index)})"
        sequences = []
        for side in SIDES:
            value = columns[side][index]
            if value is None:
                raise DataError(f"{where}: missing column {side!r}; each pair needs chosen and rejected ids")
            ids = token_ids(value, side, where)
            if ids.size == 0:
                raise DataError(f"{where}: field {side!r} is empty; each side needs at least one token")
            if ids.size > width:
                raise DataError(
                    f"{where}: field {side!r} has {ids.size} ids, more than seq_len={width}; raise "
                    "seq_len or drop the pair (pairs are not cut, that would lose the answer's end)"
                )
            sequences.append((ids, _mask(columns[f"{side}_mask"][index], ids.size, f"{side}_mask", where)))
        pairs.append(tuple(sequences))
    return pairs


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
    loading: Loading = Loading()

    def __post_init__(self):
        check_sources("PreferencePairs", self.records, self.path, self.val_records, self.val_path)
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"PreferencePairs.seq_len must be an integer >= 2 (the full row width), "
                             f"got {self.seq_len!r}")
        if isinstance(self.pad_id, bool) or not isinstance(self.pad_id, int) or self.pad_id < 0:
            raise ValueError(f"PreferencePairs.pad_id must be a non-negative integer, got {self.pad_id!r}")
        if not isinstance(self.loading, Loading):
            raise TypeError(f"PreferencePairs.loading must be a Loading, got {type(self.loading).__name__}")

    def pairs(self, records=None, path=None) -> list:
        rows = open_source(records, path, split=self.split, options=self.options,
                           threads=self.loading.threads, owner="PreferencePairs")
        return read_pairs(rows, self.seq_len)

    def load(self, batch: int) -> Dataset:
        """Validate every pair and return a Dataset of `[batch, 2, seq_len]` batches."""
        check_batch_size("PreferencePairs", batch)
        loading = dataclasses.replace(self.loading, workers=0)
        layout = PairLayout(self.seq_len, self.pad_id)
        train = Pipeline(self.pairs(self.records, self.path), _PairEncoder(), layout, loading)
        val = None
        if self.val_records is not None or self.val_path is not None:
            val = Pipeline(self.pairs(self.val_records, self.val_path), _PairEncoder(), layout, loading)
        return as_dataset(train, val, batch)


__all__ = ["PairLayout", "PreferencePairs", "read_pairs"]
