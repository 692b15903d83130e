"""Loading options shared by the file-backed datasets (ChatMessages, PreferencePairs, Prompts)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loading:
    """How a loader reads and tokenizes.

    workers: processes that tokenize in parallel (0 tokenizes in the reading process).
    threads: threads that read files in each process.
    read_buffer: batches prepared ahead of the trainer.
    seed: shuffle seed; None keeps file order.
    """

    workers: int = 0
    threads: int = 1
    read_buffer: int = 2
    seed: int | None = 0

    def __post_init__(self):
        if self.workers < 0:
            raise ValueError(f"Loading.workers must be >= 0, got {self.workers}")
        if self.threads < 1:
            raise ValueError(f"Loading.threads must be >= 1, got {self.threads}")
        if self.read_buffer < 1:
            raise ValueError(f"Loading.read_buffer must be >= 1, got {self.read_buffer}")
