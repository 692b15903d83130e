"""Chat roles: the per-token label that decides which targets an SFT loss counts."""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    """Who wrote a token. Stored as int8 in `text_roles`; NONE marks padding and unlabelled ids."""

    NONE = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4


__all__ = ["Role"]
