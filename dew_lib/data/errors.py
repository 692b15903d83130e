"""DataError: the one exception the loaders raise for input they cannot turn into correct batches.

It lives in its own module so that worker processes can raise and unpickle it without importing
the readers (pyarrow) or the Dataset contract (JAX).
"""


class DataError(ValueError):
    """A record or option that a loader cannot turn into a correct batch; the message says where."""


__all__ = ["DataError"]
