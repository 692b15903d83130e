"""What stands between a client and the engine: an API key, size and time limits, OpenAI-shaped errors.

`ServeOptions` holds the limits `dew serve` is launched with. `install(app, options)` puts them on
a FastAPI app:

- `Guard`, an ASGI middleware in front of every route: with an `api_key`, every request but `GET
  /health` needs `Authorization: Bearer <key>` (401 otherwise, before its body is read); a body
  over `max_request_bytes` is refused with 413 (by its Content-Length before any of it is read, or
  as it arrives; uvicorn discards the rest, within the read timeout); a body that does not arrive
  within `read_timeout` seconds of its headers gets 408 and the connection is closed; a response
  the client does not take within `write_timeout` seconds (a stream whose reader stopped reading,
  once the socket's buffers are full) ends the request, which cancels its draws, and drops the
  connection.
- `protocol(read_timeout)`, uvicorn's h11 protocol with a deadline for a request's headers (from
  the connection, or from the end of the previous response), which uvicorn does not have: a
  client that connects and stalls mid-headers is disconnected instead of holding the socket.
- exception handlers that write every error, the framework's own included (404, 405, a body that
  is not UTF-8 or nests too deep, validation errors, unexpected failures), as OpenAI and vLLM do:
  `{"error": {"message", "type", "param", "code"}}`.

Not here: what a request may ask for (`app`), request chat templates (`template`). Not covered:
a request line or headers uvicorn cannot parse get uvicorn's own plain-text 400, before the app.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dew_lib.serve.protocol import error_response

MIB = 2**20
PUBLIC_PATHS = ("/health",)  # reachable without the key, as vLLM leaves its health probe open
# scope["extensions"] key under which `protocol` hands over the socket, as `{"transport": transport}`
# (ASGI extensions are dicts)
TRANSPORT = "dew.transport"
API_KEY_ENV = "DEW_SERVE_API_KEY"
PHRASES = {400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
           408: "Request Timeout", 413: "Request Entity Too Large", 500: "Internal Server Error"}
log = logging.getLogger("dew.serve")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """The limits a server enforces on its clients (docs/serve.md, "Limits and authentication").

    api_key: the bearer token every route but /health requires (None: no authentication).
    max_request_bytes: the largest request body. max_tokens_limit: the most ids one request may
    ask for (None: whatever the capacity leaves). read_timeout: seconds a request's headers and
    then its body may take to arrive. write_timeout: seconds a response write may wait for the
    client to read. trust_request_chat_template: render chat templates sent with requests (in a
    sandboxed process, `template`), instead of refusing them, as vLLM's flag of that name.
    template_timeout and template_max_chars: the seconds and characters such a rendering may take.
    """

    api_key: str | None = None
    max_request_bytes: int = 4 * MIB
    max_tokens_limit: int | None = None
    read_timeout: float = 30.0
    write_timeout: float = 30.0
    trust_request_chat_template: bool = False
    template_timeout: float = 1.0
    template_max_chars: int = MIB

    def __post_init__(self):
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or any(c.isspace() for c in self.api_key)):
            raise ValueError("ServeOptions.api_key must be None or a nonempty string without spaces")
        if self.max_request_bytes < 1024:
            raise ValueError(f"ServeOptions.max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"ServeOptions.max_tokens_limit must be None or >= 1, got {self.max_tokens_limit}")
        for name in ("read_timeout", "write_timeout", "template_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServeOptions.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.template_max_chars < 1:
            raise ValueError(f"ServeOptions.template_max_chars must be >= 1, got {self.template_max_chars}")


def install(app: FastAPI, options: ServeOptions) -> None:
    """Put `options` and the OpenAI-shaped error handlers on `app`."""
    app.state.options = options
    app.add_middleware(Guard, options=options)
    # FastAPI's decorator form, which (unlike Starlette's add_exception_handler) is typed to take a
    # handler for a narrower exception than Exception
    app.exception_handler(HTTPException)(_http_error)
    app.exception_handler(RequestValidationError)(_invalid)
    app.exception_handler(Exception)(_failed)


# ---- the middleware ----------------------------------------------------------------------------

class _Refused(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, close: bool = False,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = {**(headers or {}), **({"connection": "close"} if close else {})}

    def response(self):
        return error_response(self.message, param=self.param, status=self.status, kind=PHRASES[self.status],
                              headers=self.headers)


class _Gone(Exception):
    """The client disconnected while its body was arriving: nobody to answer."""


class Guard:
    """The API key, the body's size and arrival time, and the response's delivery time."""

    def __init__(self, app: ASGIApp, options: ServeOptions):
        self.app, self.options = app, options
        self._key = None if options.api_key is None else _digest(options.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._authorize(scope)
            body = await self._body(scope, receive)
        except _Refused as refused:
            await refused.response()(scope, receive, send)
            return
        except _Gone:
            return
        await self._serve(scope, _replay(body, receive), send)

    def _authorize(self, scope: Scope) -> None:
        if self._key is None or scope["path"] in PUBLIC_PATHS:
            return
        header = Headers(scope=scope).get("authorization")
        challenge = {"www-authenticate": "Bearer"}
        if not header:
            raise _Refused(401, "this server needs an API key: send the header `Authorization: Bearer <key>` "
                           "with the key dew serve was launched with (--api-key or $" + API_KEY_ENV + ")",
                           headers=challenge)
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(_digest(token.strip()), self._key):
            raise _Refused(401, "the API key sent is not this server's: send `Authorization: Bearer <key>` with the "
                           "key dew serve was launched with", headers=challenge)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        limit, seconds = self.options.max_request_bytes, self.options.read_timeout
        too_large = (f"the request body is larger than this server takes ({limit} bytes, its --max-request-bytes); "
                     "send a smaller request (fewer or shorter prompts)")
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise _Refused(400, f"Content-Length {declared!r} is not a number of bytes", close=True)
            if int(declared) > limit:
                raise _Refused(413, too_large + f"; this one declares {int(declared)}")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(seconds):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Gone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _Refused(413, too_large)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            raise _Refused(408, f"the request body did not arrive within {seconds:g} s of its headers ({size} bytes "
                           "came); dew serve drops requests that stall (--read-timeout)", close=True) from None

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        stalled, seconds = False, self.options.write_timeout

        async def delivered(message: Message) -> None:
            nonlocal stalled
            try:
                async with asyncio.timeout(seconds):
                    await send(message)
            except TimeoutError:
                stalled = True
                transport = scope.get("extensions", {}).get(TRANSPORT, {}).get("transport")
                if transport is not None:  # a socket with unread data in its buffers would never close
                    transport.abort()
                raise ConnectionAbortedError(f"the client took no data for {seconds:g} s") from None

        try:
            await self.app(scope, receive, delivered)
        except Exception:
            if not stalled:
                raise
            log.warning("dew serve: dropped %s %s: the client took no data for %g s (--write-timeout)",
                        scope.get("method"), scope.get("path"), seconds)
            await asyncio.sleep(0)  # the aborted connection's loss lands before uvicorn looks at it


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body already read: the body once, then the client's own messages (its
    disconnect, which routes watch for)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def protocol(read_timeout: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request's headers."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        """Closes a connection whose next request's headers take longer than `read_timeout` seconds
        (uvicorn's keep-alive timeout closes one that sends nothing at all sooner), and hands the
        transport to `Guard` in the request's scope, so a stalled reader's socket can be aborted."""

        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers arrived
                self._disarm()
                self.cycle.scope.setdefault("extensions", {})[TRANSPORT] = {"transport": self.transport}

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return DeadlineH11Protocol


# ---- errors in OpenAI's shape ------------------------------------------------------------------

async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (no route, wrong method, an unparsable body) as vLLM's
    handler writes them, with the type the status's phrase; a body's parse error says what it was."""
    message, param, cause = str(error.detail), None, error.__cause__
    if isinstance(cause, UnicodeDecodeError):
        message, param = (f"the request body is not valid UTF-8 ({cause.reason} at byte {cause.start}); send JSON "
                          "encoded as UTF-8"), "body"
    elif isinstance(cause, RecursionError):
        message, param = ("the request body nests JSON arrays or objects too deeply to parse; send a flatter "
                          "body"), "body"
    elif error.status_code == 404 and message == "Not Found":
        message = (f"{request.method} {request.url.path} is not a route of this server (docs/serve.md lists them; "
                   "the development routes need --dev-endpoints)")
    elif error.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    kind = PHRASES.get(error.status_code, "Error")
    return error_response(message, param=param, status=error.status_code, kind=kind, headers=error.headers)


def _param(loc: Sequence[Any]) -> str:
    """A validation error's location as a dotted field path, without pydantic's union branches."""
    parts = [str(p) for p in loc if not any(c in str(p) for c in "[]()") and str(p) not in ("str", "int", "list")]
    return ".".join(parts) or ".".join(map(str, loc))


def _shown(text: str, most: int = 200) -> str:
    return text if len(text) <= most else text[:most] + "..."


async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's validation errors as vLLM's validation handler writes them: 400, type "Bad Request",
    a dotted param; at most 10 errors, each shortened, so a malformed body cannot amplify itself."""
    errors = error.errors()
    kind = request.headers.get("content-type")
    if errors and tuple(errors[0].get("loc", ())) == ("body",) and "json" not in (kind or ""):
        return error_response(f"the request body must be JSON sent with Content-Type: application/json (this one's "
                              f"Content-Type is {kind or 'missing'})", param="body", status=400, kind="Bad Request")
    if errors and errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error", "JSON decode error")
        at = errors[0].get("loc", ("body", "?"))[-1]
        return error_response(f"the request body is not valid JSON: {reason} at character {at}", param="body",
                              status=400, kind="Bad Request")
    lines = [_shown(f"{_param(e.get('loc', ()))}: {e.get('msg', 'invalid')}") for e in errors[:10]]
    message = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}: " + "; ".join(lines)
    param = _shown(_param(errors[0].get("loc", ()))) if errors else None
    return error_response(message, param=param, status=400, kind="Bad Request")


async def _failed(request: Request, error: Exception) -> JSONResponse:
    # Starlette re-raises it after this answer, and uvicorn logs the traceback
    return error_response(f"the server failed: {type(error).__name__}", param=None, status=500,
                          kind="InternalServerError")


__all__ = ["API_KEY_ENV", "Guard", "ServeOptions", "install", "protocol"]
