"""A stand-in rllm-model-gateway that proxies sessions to a real engine and records their calls.

What a harness and HarborSource see of rllm-model-gateway, read from rllm-org/rllm at
9beb6e0f (rllm-model-gateway/src/rllm_model_gateway/; nothing copied):

- server.py: POST /sessions {"session_id", "metadata"} answers {"session_id", "url":
  "/sessions/<id>/v1"}; GET /sessions/<id>/traces answers the session's TraceRecords in the order
  they were stored; DELETE /sessions/<id> answers {"deleted": n}; POST /admin/flush answers
  {"status": "flushed"}; POST /admin/weight_version {"weight_version": int} sets the version calls
  are stamped with from then on and answers it; GET /health/workers answers {"workers": [...],
  "healthy": n, "total": m}; everything under /v1 (and /sessions/<id>/v1) goes to the worker.
- middleware.py: a session's path is rewritten to /v1/..., and POST bodies get "logprobs": true
  and "return_token_ids": true unless the client set them.
- proxy.py / data_process.py (build_trace_record): a call is stamped with the version the gateway
  holds when the request arrives (e09b1b96, "stamp weight_version at dispatch"); the trace holds
  messages, prompt_token_ids (the response's root field), completion_token_ids (choices[0].token_ids),
  logprobs (choices[0].logprobs.content[].logprob for chat), finish_reason, weight_version,
  timestamp and metadata. Session ids may hold slashes (`{session_id:path}`).

`Recorder.drop_versions` makes it record traces without a version, as gateways before f83139a1 do.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response


class Recorder:
    """The gateway's state: its worker, the version it stamps, and every session's traces."""

    def __init__(self, worker: str, model: str):
        self.worker, self.model = worker.rstrip("/"), model
        self.weight_version: int | None = None
        self.sessions: dict[str, dict] = {}
        self.traces: dict[str, list[dict]] = {}
        self.deleted: list[str] = []
        self.drop_versions = False
        self.lock = threading.Lock()


def gateway_router(recorder: Recorder) -> APIRouter:
    router = APIRouter()

    @router.get("/health/workers")
    async def workers():
        healthy = True
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                healthy = (await client.get(recorder.worker + "/health")).is_success
        except httpx.HTTPError:
            healthy = False
        return {"workers": [{"worker_id": "0", "url": recorder.worker, "api_path": "/v1",
                             "model_name": recorder.model, "healthy": healthy}],
                "healthy": int(healthy), "total": 1}

    @router.post("/admin/weight_version")
    async def stamp(request: Request):
        body = await request.json()
        if body.get("weight_version") is None:
            return JSONResponse({"error": "weight_version is required"}, status_code=400)
        recorder.weight_version = int(body["weight_version"])
        return {"weight_version": recorder.weight_version}

    @router.post("/admin/flush")
    async def flush():
        return {"status": "flushed"}

    @router.post("/sessions")
    async def open_session(request: Request):
        body = await request.json()
        session = body.get("session_id") or str(uuid.uuid4())
        with recorder.lock:
            recorder.sessions[session] = {"metadata": body.get("metadata") or {}, "created_at": time.time()}
        return {"session_id": session, "url": f"/sessions/{session}/v1"}

    @router.get("/sessions/{session:path}/traces")
    async def traces(session: str):
        with recorder.lock:
            return list(recorder.traces.get(session, []))

    @router.delete("/sessions/{session:path}")
    async def close_session(session: str):
        with recorder.lock:
            recorder.sessions.pop(session, None)
            recorder.deleted.append(session)
            return {"deleted": len(recorder.traces.pop(session, []))}

    @router.get("/v1/models")
    async def models():
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.get(recorder.worker + "/v1/models")
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @router.post("/sessions/{session:path}/v1/chat/completions")
    async def chat(session: str, request: Request):
        body = await request.json()
        body.setdefault("logprobs", True)
        body.setdefault("return_token_ids", True)
        version = recorder.weight_version  # stamped when the call arrives
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=120) as client:
            answer = await client.post(recorder.worker + "/v1/chat/completions", json=body)
        if answer.is_success:
            with recorder.lock:
                recorder.sessions.setdefault(session, {"metadata": {}, "created_at": time.time()})
                recorder.traces.setdefault(session, []).append(
                    trace(session, body, answer.json(), None if recorder.drop_versions else version,
                          (time.monotonic() - started) * 1000))
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    return router


def trace(session: str, request: dict, response: dict, version: int | None, latency_ms: float) -> dict[str, Any]:
    """One TraceRecord as the gateway stores it for a chat completion."""
    choice = (response.get("choices") or [{}])[0]
    content = (choice.get("logprobs") or {}).get("content")
    return {
        "trace_id": str(uuid.uuid4()), "session_id": session, "model": request.get("model", ""),
        "messages": request.get("messages", []),
        "prompt_token_ids": list(response.get("prompt_token_ids") or []),
        "response_message": choice.get("message") or {},
        "completion_token_ids": list(choice.get("token_ids") or []),
        "logprobs": [float(entry["logprob"]) for entry in content] if content else None,
        "routing_matrices": None, "finish_reason": choice.get("finish_reason"),
        "weight_version": version, "latency_ms": latency_ms, "token_counts": {},
        "timestamp": time.time(), "metadata": {}, "raw_request": request, "raw_response": response,
    }
