"""The worker side of `SubprocessEnvironment`: answer JSON-line requests with a handler object.

A tool worker is a program that reads one JSON request per line on stdin and writes one JSON
reply per line on stdout. `serve(handler)` is that loop, so a worker is a few lines:

    from dew_lib.tool_worker import serve

    class Square:
        def reset(self, episode, task):      # episode: every EpisodeId field; task: {"id", "data"}
            return task["data"]["prompt"], "running", ""
        def step(self, request):             # context, tokens, terminated, step, policy_step
            result = sum(request["tokens"]) ** 2
            return [*request["context"], *request["tokens"], result], "completed", str(result)

    serve(Square())

`reset` and `step` return `(context, status, detail)`: the token ids the model reads next, one
of "running", "completed", "truncated", "cancelled", "error" (or an `EpisodeStatus`), and free
text. Optional `get_state() -> bytes` and `set_state(state: bytes)` serve the journal's
snapshots (sent base64-encoded). An exception in the handler is answered with
`{"error": "Type: message"}` and its traceback goes to stderr; the worker keeps serving.

While `serve` runs, file descriptor 1 points at stderr and replies go to a private duplicate of
the original stdout, so a stray `print` (in the handler or a program it starts) cannot corrupt
the reply stream.

This module imports only the standard library, and `dew_lib/__init__.py` loads nothing heavy,
so `import dew_lib.tool_worker` costs about what Python's own start does. A sandbox that cannot
see the installed `dew_lib` can take this file as a single module: copy its text next to the
worker script (`SubprocessEnvironment(files={"tool_worker.py": ...})`) and
`from tool_worker import serve`.

Not here: starting workers, deadlines and limits (`dew_lib.rollouts.subprocess_environment`).
"""

from __future__ import annotations

import base64
import json
import os
import sys
import traceback
from typing import Any, BinaryIO

STATUSES = ("running", "completed", "truncated", "cancelled", "error")


def serve(handler: Any, *, requests: BinaryIO | None = None, replies: BinaryIO | None = None) -> None:
    """Answer requests until stdin ends.

    requests, replies: binary streams to use instead of stdin and stdout (tests); when left
    out, stdout is moved aside as described in the module docstring.
    """
    if requests is None:
        requests = sys.stdin.buffer
    if replies is None:
        replies = _private_stdout()
    for line in requests:
        if not line.strip():
            continue
        reply = answer(handler, line)
        replies.write(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
        replies.flush()


def answer(handler: Any, line: bytes) -> dict:
    """The reply to one request line; a failure becomes `{"error": ...}`, never an exception."""
    try:
        request = json.loads(line)
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            raise TypeError(f"a request must be a JSON object with an 'op', got {line[:200]!r}")
        return _dispatch(handler, request)
    except Exception as error:  # noqa: BLE001 - every failure is the parent's to judge
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        return {"error": f"{type(error).__name__}: {error}"}


def _dispatch(handler: Any, request: dict) -> dict:
    op = request["op"]
    if op == "reset":
        return observation(handler.reset(request["episode"], request["task"]))
    if op == "step":
        return observation(handler.step(request))
    if op == "get_state":
        state = _method(handler, "get_state")()
        if not isinstance(state, (bytes, bytearray)):
            raise TypeError(f"get_state() must return bytes, got {type(state).__name__}")
        return {"state": base64.b64encode(bytes(state)).decode("ascii")}
    if op == "set_state":
        _method(handler, "set_state")(base64.b64decode(request["state"], validate=True))
        return {"restored": True}
    raise ValueError(f"unknown op {op!r}; the ops are reset, step, get_state and set_state")


def _method(handler: Any, name: str):
    method = getattr(handler, name, None)
    if method is None:
        raise NotImplementedError(f"the handler {type(handler).__name__} has no {name}(); "
                                  "snapshots need both get_state and set_state")
    return method


def observation(result: Any) -> dict:
    """A handler's `(context, status, detail)` as the reply object, checked here so a handler
    bug is reported with the handler's traceback rather than as a malformed reply."""
    if isinstance(result, dict):
        result = (result.get("context"), result.get("status"), result.get("detail", ""))
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise TypeError(f"reset() and step() must return (context, status, detail), got {result!r}")
    context, status, detail = result
    status = getattr(status, "value", status)  # an EpisodeStatus passes as its value
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    ids = [int(token) for token in context]
    return {"context": ids, "status": status, "detail": str(detail)}


def _private_stdout() -> BinaryIO:
    """A duplicate of fd 1 for replies; fd 1 itself (and `sys.stdout`) then writes to stderr."""
    sys.stdout.flush()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return replies


__all__ = ["STATUSES", "answer", "observation", "serve"]
