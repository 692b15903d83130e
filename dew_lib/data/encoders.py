"""The per-record work the loaders hand to worker processes: tokenizing conversations and prompts.

These run inside `worker.py` subprocesses, so this module imports neither JAX nor pyarrow: a
worker starts with the tokenizer and nothing else. Each encoder is a frozen dataclass (it is
pickled to the workers) that rebuilds its Renderer once per process from a TokenizerSpec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dew_lib.data.errors import DataError
from dew_lib.data.template import label_many
from dew_lib.data.tokenizer import TokenizerSpec, shipment


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatEncoder:
    """Conversation tuples -> (ids int32, roles int8), cut or refused past `width`."""

    spec: TokenizerSpec
    width: int
    overflow: str

    def __call__(self, records: Sequence[tuple]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for (ids, roles), record in zip(label_many(self.spec.renderer(), records), records, strict=True):
            where = record[2]
            if ids.size > self.width:
                if self.overflow == "raise":
                    raise DataError(
                        f"{where}: the conversation has {ids.size} tokens, more than seq_len + 1 = "
                        f"{self.width}; raise seq_len, shorten it, or use overflow='truncate'"
                    )
                ids, roles = ids[:self.width], roles[:self.width]
            out.append((ids, roles))
        return out

    def lengths(self, records: Sequence[tuple]) -> list[int]:
        return [ids.size for ids, _ in self(records)]

    def setup(self) -> list:
        """What each worker runs first: receive this process's tokenizer."""
        return [shipment(self.spec.name)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptEncoder:
    """(kind, prompt, tools, where, metadata) records -> (ids keeping the last `max_len`, metadata)."""

    spec: TokenizerSpec | None
    max_len: int

    def __call__(self, records: Sequence[tuple]) -> list[tuple[np.ndarray, tuple]]:
        renderer = None
        out = []
        for kind, prompt, tools, where, metadata in records:
            if kind == "ids":
                ids = prompt
            else:
                if renderer is None:
                    if self.spec is None:
                        raise DataError(f"{where}: a {kind} prompt needs a tokenizer to encode it; pass one "
                                        "or give token ids")
                    renderer = self.spec.renderer()
                if kind == "text":
                    ids = np.asarray(renderer.encode_plain(prompt), np.int32)
                else:
                    try:
                        text = renderer.render(prompt, tools, generation=True)
                    except Exception as error:
                        raise DataError(f"{where}: the chat template failed: {type(error).__name__}: {error}") from None
                    ids = np.asarray(renderer.encode([text])[0], np.int32)
                if ids.size == 0:
                    raise DataError(f"{where}: the prompt tokenizes to no ids")
            out.append((ids[-self.max_len:], metadata))
        return out

    def lengths(self, records: Sequence[tuple]) -> list[int]:
        return [1] * len(records)

    def setup(self) -> list:
        return [] if self.spec is None else [shipment(self.spec.name)]


__all__ = ["ChatEncoder", "PromptEncoder"]
