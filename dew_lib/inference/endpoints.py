"""HTTP calls to serving engines and the gateway, checked the way a weight push needs them.

Engines report a failed control call in several ways: a non-2xx status, a 200 whose JSON says
`"success": false` (vLLM's /reset_prefix_cache when the reset did not happen), a body that is not
JSON, or no answer at all (a timeout, a dropped connection). `call` turns every one of them into
an `EndpointFailed` that names the server, the endpoint and what it answered. `on_every` runs one
replica's sequence of calls on all replicas at once and raises one `PushFailed` naming every
replica that failed, after all of them have stopped.

Not here: which endpoints a push calls (`publish`, `nccl`, `gateway`), retries (a failed push
raises; the caller decides whether to push again).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx

_SHOWN = 400  # characters of an answer quoted in an error


class EndpointFailed(RuntimeError):
    """One call failed: `server` (its root URL), `endpoint` ("POST /pause") and `answer` (what came back)."""

    def __init__(self, server: str, endpoint: str, answer: str):
        self.server, self.endpoint, self.answer = server, endpoint, answer
        super().__init__(f"{server}: {endpoint} {answer}")


class PushFailed(RuntimeError):
    """A weight push failed on one or more replicas; `failures` holds each replica's `EndpointFailed`."""

    def __init__(self, what: str, failures: Sequence[EndpointFailed], total: int):
        self.failures = tuple(failures)
        lines = "\n".join(f"  {failure}" for failure in self.failures)
        super().__init__(f"{what} failed on {len(self.failures)} of {total} replicas:\n{lines}")


def root_url(url: Any, field: str) -> str:
    """`url` as a root URL without a trailing slash; refuses anything but http(s)://host[:port][/prefix]."""
    if not isinstance(url, str):
        raise ValueError(f"{field} must be a URL string such as 'http://10.0.0.5:8000', got {url!r}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"{field}={url!r} is not a root URL; write e.g. 'http://10.0.0.5:8000'")
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        raise ValueError(f"{field}={url!r} ends in /v1; pass the server's root URL (without /v1): the "
                         "weight and admin endpoints live at the root, not under the OpenAI API")
    return root


def root_urls(urls: Any, field: str) -> tuple[str, ...]:
    """A nonempty tuple of distinct root URLs."""
    if isinstance(urls, str) or not isinstance(urls, Sequence) or not urls:
        raise ValueError(f"{field} must be a nonempty list of replica root URLs, got {urls!r}")
    roots = tuple(root_url(url, field) for url in urls)
    if len(set(roots)) != len(roots):
        raise ValueError(f"{field} lists a replica twice ({list(roots)}); list each replica once")
    return roots


def _quoted(response: httpx.Response) -> str:
    text = response.text
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def call(client: httpx.Client, server: str, method: str, path: str, *, body: Any = None,
         params: dict[str, str] | None = None, must_succeed: bool = False) -> Any:
    """`method` `server + path` with JSON `body`; the answer's JSON (None for an empty body).

    Raises `EndpointFailed` on no answer, a non-2xx status, a non-empty body that is not JSON, a
    JSON object with `"success": false`, and, with `must_succeed`, any answer without
    `"success": true`.
    """
    endpoint = f"{method} {path}" + ("?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else "")
    try:
        response = client.request(method, server + path, json=body, params=params)
    except httpx.TimeoutException as error:
        raise EndpointFailed(server, endpoint, f"gave no answer within the timeout ({type(error).__name__})"
                             ) from error
    except httpx.HTTPError as error:
        raise EndpointFailed(server, endpoint, f"gave no answer ({type(error).__name__}: {error})") from error
    if not response.is_success:
        raise EndpointFailed(server, endpoint, f"answered {response.status_code}: {_quoted(response)}")
    answer = None
    if response.content.strip():
        try:
            answer = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise EndpointFailed(server, endpoint, f"answered {response.status_code} with a body that is "
                                 f"not JSON: {_quoted(response)}") from error
    succeeded = answer.get("success") if isinstance(answer, dict) else None
    if succeeded is False or (must_succeed and succeeded is not True):
        raise EndpointFailed(server, endpoint, f"answered {response.status_code}: {_quoted(response)} "
                             '(expected {"success": true})')
    return answer


def on_every(servers: Sequence[str], sequence: Callable[[str], None], what: str) -> None:
    """Run `sequence(server)` for every server at once; raise `PushFailed` once all have stopped.

    An `EndpointFailed` is collected as that server's failure; any other exception is a bug or a
    local fault and is raised as itself, after every sequence has stopped.
    """
    with ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="dew-publish") as pool:
        futures = [pool.submit(sequence, server) for server in servers]
    failures, unexpected = [], None
    for future in futures:
        error = future.exception()
        if isinstance(error, EndpointFailed):
            failures.append(error)
        elif error is not None and unexpected is None:
            unexpected = error
    if unexpected is not None:
        raise unexpected
    if failures:
        raise PushFailed(what, failures, len(servers)) from failures[0]
