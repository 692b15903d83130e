"""One notice from transformers that Dew removes: "PyTorch was not found".

transformers logs that notice on import whenever torch is absent, which is how Dew always runs it
(tokenizers and chat templates only), so every process that tokenizes printed it: the training
process and each loader worker. Dew drops exactly that record with a filter on the `transformers`
logger, installed when `dew_lib` (or a loader worker) starts, before anything imports
transformers. Every other transformers message, advisory warnings included, still prints, and the
user's own logging configuration is left alone.

Not here: silencing warnings of other libraries, or this notice when the program imported
transformers before dew_lib (it has printed by then).
"""

from __future__ import annotations

import logging

NOTICE = "PyTorch was not found."


class _DropTorchNotice(logging.Filter):
    """Rejects the one record whose message starts with `NOTICE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        return not message.startswith(NOTICE)


def drop_torch_notice() -> None:
    """Install the filter on the `transformers` logger once per process (idempotent)."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _DropTorchNotice) for f in logger.filters):
        logger.addFilter(_DropTorchNotice())


__all__ = ["NOTICE", "drop_torch_notice"]
