"""Refusals: a run that cannot work with its parameters or its data stops before it trains, says
why once, and is not retried.

`RunRefused` is what a task raises for such a run: lengths that cut too much of the data, a data
file without a field the pipeline reads, a stage whose data the run lacks. It is a ValueError, so
code that catches those still does. Parameters that do not validate (pydantic's ValidationError)
are refusals too.

- `retry_unless_refused` is the `retry_condition_fn` of every task with retries: a retry cannot
  change the parameters or the data, so Prefect fails such a task at once.
- `refusal_exit` runs an entry point's flow (`python -m flows`): a refusal prints its message once
  on stderr, without a traceback, and exits with status 1. While it runs, Prefect's console leaves
  out its records about the refusal (the task's and the flow's tracebacks, the failed states that
  quote the message); the Prefect API, and so the UI, still gets every record.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

NAME = "RunRefused"  # how Prefect's failed states name it: "... RunRefused: <message>"


class RunRefused(ValueError):
    """The run cannot start with these parameters or this data; the message says why and what to change."""


def refusal_in(error: BaseException | None) -> BaseException | None:
    """The refusal `error` is or was raised from (its causes and contexts), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (RunRefused, ValidationError)):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def retry_unless_refused(task, task_run, state) -> bool:
    """Prefect's retry condition: retry any failure but a refusal, which a retry cannot fix."""
    data = getattr(state, "data", None)
    return refusal_in(data if isinstance(data, BaseException) else None) is None


class QuietRefusals(logging.Filter):
    """Leaves out the log records about a refusal: those carrying it as their exception and those
    that quote it (Prefect's 'Finished in state Failed(... RunRefused: ...)')."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return refusal_in(error) is None and f"{NAME}: " not in record.getMessage()


def console_handlers() -> list[logging.Handler]:
    """The handlers that print Prefect's logs on the terminal (the root logger's)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    return [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]


def refusal_exit(prog: str, run: Callable[[], Any]) -> int:
    """0 once `run()` returns; 1 with `prog: <why>` on stderr, once, when it raises a refusal."""
    quiet, handlers = QuietRefusals(), console_handlers()
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        run()
    except Exception as error:
        refusal = refusal_in(error)
        if refusal is None:
            raise
        print(f"{prog}: {refusal}", file=sys.stderr, flush=True)
        return 1
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
    return 0


__all__ = ["RunRefused", "QuietRefusals", "refusal_exit", "refusal_in", "retry_unless_refused"]
