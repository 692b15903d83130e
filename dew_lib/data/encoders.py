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
from dew_lib.data.tokenizer import Renderer, TokenizerSpec, shipment


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
    """(kind, prompt, tools, where, metadata, completion) records -> (ids keeping the last
    `max_len`, metadata, completion ids keeping the first `completion_len`, or None).

    A completion is None, int32 ids (kept as they are) or a string (tokenized without special
    tokens, then `completion_eos` appended)."""

    spec: TokenizerSpec | None
    max_len: int
    completion_len: int | None = None
    completion_eos: int | None = None

    def __call__(self, records: Sequence[tuple]) -> list[tuple[np.ndarray, tuple, np.ndarray | None]]:
        made: list[Renderer] = []  # the renderer, made for the first record that needs one

        def renderer(what: str, where: str) -> Renderer:
            if not made:
                if self.spec is None:
                    raise DataError(f"{where}: a {what} needs a tokenizer to encode it; pass one or give token ids")
                made.append(self.spec.renderer())
            return made[0]

        out = []
        for kind, prompt, tools, where, metadata, completion in records:
            if isinstance(completion, str):
                if self.completion_eos is None:
                    raise DataError(f"{where}: a string completion needs completion_eos to end it")
                completion = np.asarray([*renderer("string completion", where).encode([completion])[0],
                                         self.completion_eos], np.int32)
            if completion is not None:
                completion = completion[:self.completion_len]
            if kind == "ids":
                ids = prompt
            elif kind == "text":
                ids = np.asarray(renderer("text prompt", where).encode_plain(prompt), np.int32)
            else:
                render = renderer(f"{kind} prompt", where)
                try:
                    text = render.render(prompt, tools, generation=True)
                except Exception as error:
                    raise DataError(f"{where}: the chat template failed: {type(error).__name__}: {error}") from None
                ids = np.asarray(render.encode([text])[0], np.int32)
            if kind != "ids" and ids.size == 0:
                raise DataError(f"{where}: the prompt tokenizes to no ids")
            out.append((ids[-self.max_len:], metadata, completion))
        return out

    def lengths(self, records: Sequence[tuple]) -> list[int]:
        return [1] * len(records)

    def setup(self) -> list:
        return [] if self.spec is None else [shipment(self.spec.name)]


__all__ = ["ChatEncoder", "PromptEncoder"]
