"""The trainer's side of rllm-model-gateway: stamping weight versions and waiting until it can serve.

rllm-model-gateway proxies a harness's OpenAI calls to the engines and records each call with the
weight version it holds when the call arrives (routes read from rllm-org/rllm,
rllm-model-gateway/src/rllm_model_gateway/server.py at 9beb6e0f): POST /admin/weight_version
{"weight_version": int} sets that version and answers it back; GET /health/workers answers
{"workers": [...], "healthy": n, "total": m}; /v1/... is proxied to a healthy worker, and while
none is healthy every proxied call gets a plain-text 500.

`Gateway.stamp` is the stamp a `Publication` runs after every replica serves a version.
`Gateway.ready` waits until the gateway has a healthy worker and answers GET /v1/models through
it, so the first rollouts do not fail on a worker the gateway has not yet seen healthy.
`open_session`, `session_url`, `traces` and `close_session` are what `HarborSource` uses to give
each trial its own recorded session and read its calls back (POST /sessions, /sessions/<id>/v1,
POST /admin/flush then GET /sessions/<id>/traces, DELETE /sessions/<id>).

The gateway has no authentication, and the port that proxies model calls also serves every
session's traces and these admin routes: keep `url` on an interface only the trainer reaches, and
give sandboxes `sandbox_url`, a reverse proxy that forwards only
POST /sessions/<session>/v1/chat/completions (see docs/publishing.md).

Not here: starting the gateway or its engines, turning traces into calls (rollouts/harbor.py).
"""

from __future__ import annotations

import dataclasses
import operator
import time
from urllib.parse import quote, urlsplit

import httpx

from dew_lib.inference.endpoints import EndpointFailed, call, root_url


class GatewayNotReady(TimeoutError):
    """The gateway had no healthy worker, or did not answer /v1/models, within `ready_timeout`."""


@dataclasses.dataclass(frozen=True)
class Gateway:
    """An rllm-model-gateway the trainer reaches at `url` (its root, not /v1).

    sandbox_url: the path-restricted proxy sandboxes use instead (None when no sandbox calls
    the gateway); it may not be `url` itself. ready_timeout: seconds `ready` waits.
    timeout: seconds one HTTP call may take.
    """

    url: str
    sandbox_url: str | None = None
    ready_timeout: float = 300.0
    timeout: float = 30.0

    def __post_init__(self):
        object.__setattr__(self, "url", root_url(self.url, "url"))
        if self.sandbox_url is not None:
            sandbox = root_url(self.sandbox_url, "sandbox_url")
            if urlsplit(sandbox).netloc == urlsplit(self.url).netloc:
                raise ValueError(
                    f"sandbox_url={self.sandbox_url!r} is the gateway's own address; sandboxes would reach "
                    "its admin and trace routes. Point it at a reverse proxy that forwards only "
                    "POST /sessions/<session>/v1/chat/completions")
            object.__setattr__(self, "sandbox_url", sandbox)
        for field in ("ready_timeout", "timeout"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be positive seconds, got {getattr(self, field)!r}")

    def stamp(self, version: int) -> None:
        """Label calls arriving from now on with `version`; raises `EndpointFailed` unless echoed back."""
        version = operator.index(version)
        with httpx.Client(timeout=self.timeout) as client:
            answer = call(client, self.url, "POST", "/admin/weight_version", body={"weight_version": version})
        echoed = answer.get("weight_version") if isinstance(answer, dict) else None
        if echoed != version:
            raise EndpointFailed(self.url, "POST /admin/weight_version",
                                 f"answered {answer!r}; expected weight_version {version}")

    def open_session(self, session: str, metadata: dict | None = None) -> None:
        """Create `session` on the gateway with `metadata`; raises `EndpointFailed` unless it echoes the id."""
        with httpx.Client(timeout=self.timeout) as client:
            answer = call(client, self.url, "POST", "/sessions",
                          body={"session_id": session, "metadata": metadata or {}})
        if not isinstance(answer, dict) or answer.get("session_id") != session:
            raise EndpointFailed(self.url, "POST /sessions", f"answered {answer!r}; expected session_id {session!r}")

    def session_url(self, session: str) -> str:
        """The OpenAI base URL a harness calls for `session`: through `sandbox_url` when there is one."""
        return f"{self.sandbox_url or self.url}/sessions/{quote(session, safe='')}/v1"

    def traces(self, session: str) -> list[dict]:
        """Every call recorded for `session`, in the order the gateway stored them.

        Flushes the gateway first, so a trace stored in the background after the harness's last
        call is not missed. Raises `EndpointFailed` when either call fails or the answer is not a
        list of objects.
        """
        path = f"/sessions/{quote(session, safe='')}/traces"
        with httpx.Client(timeout=self.timeout) as client:
            call(client, self.url, "POST", "/admin/flush")
            answer = call(client, self.url, "GET", path)
        if not isinstance(answer, list) or not all(isinstance(trace, dict) for trace in answer):
            raise EndpointFailed(self.url, f"GET {path}", f"answered {str(answer)[:400]}; expected a list of traces")
        return answer

    def close_session(self, session: str) -> None:
        """Delete `session` and its traces from the gateway."""
        with httpx.Client(timeout=self.timeout) as client:
            call(client, self.url, "DELETE", f"/sessions/{quote(session, safe='')}")

    def ready(self) -> None:
        """Wait up to `ready_timeout` s for a healthy worker and GET /v1/models through the gateway.

        Raises `GatewayNotReady` naming what was still missing and the last answer.
        """
        deadline = time.monotonic() + self.ready_timeout
        with httpx.Client(timeout=self.timeout) as client:
            while True:
                missing = self._missing(client)
                if missing is None:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GatewayNotReady(
                        f"rllm-model-gateway at {self.url} was not ready within {self.ready_timeout} s: "
                        f"{missing}. Check that its workers' URLs answer and that 3 x its "
                        "health_check_interval outlasts the engines' first-request compile")
                time.sleep(min(0.5, left))

    def _missing(self, client: httpx.Client) -> str | None:
        """What is not ready yet, in words with the last answer; None when both checks pass."""
        try:
            health = call(client, self.url, "GET", "/health/workers")
        except EndpointFailed as failure:
            return f"no healthy worker ({failure.endpoint} {failure.answer})"
        healthy = health.get("healthy") if isinstance(health, dict) else None
        if isinstance(healthy, bool) or not isinstance(healthy, int) or healthy < 1:
            return f"no healthy worker (GET /health/workers answered {health!r})"
        try:
            models = call(client, self.url, "GET", "/v1/models")
        except EndpointFailed as failure:
            return f"no answer to /v1/models through the gateway ({failure.endpoint} {failure.answer})"
        if not isinstance(models, dict) or not models.get("data"):
            return f"no model listed by /v1/models through the gateway (it answered {models!r})"
        return None
