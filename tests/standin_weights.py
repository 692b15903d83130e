"""Stand-ins for the weight-update endpoints of vLLM and SGLang and the admin routes of
rllm-model-gateway, served on 127.0.0.1 for tests of weight publishing.

Each factory returns a FastAPI `APIRouter`, so one app can carry these routes beside the completion
routes of tests/standin_completions.py; serve it with that module's `app(*routers)` and
`serve(app)` (uvicorn on 127.0.0.1 at an ephemeral port, in a background thread). The routes
answer with the statuses and JSON of the real servers:

- vLLM's development endpoints (vllm/entrypoints/serve/dev/{rlhf,rpc,cache}/api_router.py):
  POST /pause?mode=..., /resume, GET /is_paused, POST /collective_rpc, /reset_prefix_cache,
  /update_weight_version, GET /get_world_size, and the weight-transfer endpoints
  /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update.
  With `dev_mode=False` none of them exists (404), as without VLLM_SERVER_DEV_MODE=1.
- SGLang's POST /update_weights_from_disk (200 with success, or 400 with success false).
- rllm-model-gateway's /health, /health/workers, /admin/workers, /admin/weight_version, and a
  GET /v1/models that answers a plain-text 500 while no worker is healthy.

Every request is recorded in a `Journal` shared across servers, in arrival order, so a test can
check the order of calls on one replica and across replicas and the gateway. `Replica.fail` and
`GatewayState.fail` inject a failure into the next call of an endpoint: a status, a 200 with
success false, a timeout, a body that is not JSON, or a dropped connection. A vLLM reload and an
SGLang load read the directory back with `load_pretrained`, so a test sees what the replica
would serve (`Replica.reloaded`).

NCCL has no stand-in here but `Loopback`: groups keyed by unique id that hand the trainer's
tensors, in order, to the stand-in replica's /update_weights (`Replica.received`), with the
rendezvous and warm-up of a real group. `LoopbackCommunicator` is the trainer's end, injected
into `NCCLPush(communicator=...)`. A loopback replica has one worker.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from dew_lib.models.pretrained import load_pretrained

FAULTS = ("status", "unsuccessful", "timeout", "malformed", "drop")


# ----- recording and faults ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Call:
    """One request a stand-in received: which server, "POST /pause?mode=wait", its JSON body."""

    server: str
    endpoint: str
    body: Any


class Journal:
    """Every request the stand-ins sharing it received, in arrival order."""

    def __init__(self):
        self._lock = threading.Lock()
        self.calls: list[Call] = []

    def add(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def of(self, server: str) -> list[Call]:
        with self._lock:
            return [call for call in self.calls if call.server == server]

    def endpoints(self, server: str) -> list[str]:
        return [call.endpoint for call in self.of(server)]

    def index(self, server: str, endpoint: str) -> list[int]:
        """Positions in the whole journal of `server`'s calls to `endpoint`."""
        with self._lock:
            return [i for i, call in enumerate(self.calls) if call.server == server and call.endpoint == endpoint]


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    status: int = 500
    delay: float = 2.0


class _Dropped(Response):
    """Starts an answer, then fails, so the server closes the connection mid-response."""

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"64")]})
        raise ConnectionAbortedError("stand-in: dropped the connection on purpose")


class _Server:
    """What every stand-in server shares: a name, the journal, pending faults by path."""

    def __init__(self, name: str, journal: Journal):
        self.name, self.journal = name, journal
        self._faults: dict[str, list[Fault]] = {}
        self._lock = threading.Lock()

    def fail(self, path: str, kind: str, *, status: int = 500, delay: float = 2.0, times: int = 1) -> None:
        """Fail the next `times` calls to `path` ("/reset_prefix_cache") the way `kind` says."""
        if kind not in FAULTS:
            raise ValueError(f"kind={kind!r}; use one of {FAULTS}")
        with self._lock:
            self._faults.setdefault(path, []).extend([Fault(kind, status, delay)] * times)

    async def enter(self, request: Request) -> tuple[Any, Response | None]:
        """Record the request; return its JSON body (or raw text) and the fault's answer, if any."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        query = f"?{request.url.query}" if request.url.query else ""
        self.journal.add(Call(self.name, f"{request.method} {request.url.path}{query}", body))
        with self._lock:
            pending = self._faults.get(request.url.path)
            fault = pending.pop(0) if pending else None
        if fault is None:
            return body, None
        if fault.kind == "timeout":
            await asyncio.sleep(fault.delay)  # then answer normally: the client has given up
            return body, None
        if fault.kind == "status":
            return body, JSONResponse({"success": False, "message": "stand-in: injected failure"}, fault.status)
        if fault.kind == "unsuccessful":
            return body, JSONResponse({"success": False, "message": "stand-in: injected failure"})
        if fault.kind == "malformed":
            return body, Response("{not json", media_type="application/json")
        return body, _Dropped()


def _internal_error(reason: str) -> Response:
    """What uvicorn answers when a vLLM route raises: a plain-text 500 (the reason is for the test log)."""
    return PlainTextResponse(f"Internal Server Error ({reason})", 500)


# ----- NCCL stand-in -----------------------------------------------------------------------------

class _Group:
    """One loopback group: a rendezvous for all its ranks and a queue of broadcast tensors."""

    def __init__(self, world: int, timeout: float):
        self.world, self.timeout = world, timeout
        self._barrier = threading.Barrier(world, timeout=timeout)
        self._tensors: queue.Queue = queue.Queue()
        self._aborted = threading.Event()

    def rendezvous(self) -> None:
        """Wait for every rank (ncclCommInitRank, and again for the warm-up all-reduce)."""
        self._barrier.wait()

    def put(self, tensor: np.ndarray) -> None:
        self._tensors.put(tensor)

    def receive(self, count: int) -> list[np.ndarray]:
        deadline = time.monotonic() + self.timeout
        out = []
        while len(out) < count:
            if self._aborted.is_set():
                raise ConnectionAbortedError("the trainer aborted the group")
            if time.monotonic() > deadline:
                raise TimeoutError(f"received {len(out)} of {count} tensors within {self.timeout} s")
            try:
                out.append(self._tensors.get(timeout=0.02))
            except queue.Empty:
                continue
        return out

    def abort(self) -> None:
        self._aborted.set()
        self._barrier.abort()


class Loopback:
    """Groups between a trainer and stand-in replicas, keyed by the NCCL unique id the trainer minted."""

    def __init__(self, timeout: float = 5.0):
        self.timeout = timeout
        self._groups: dict[bytes, _Group] = {}
        self._lock = threading.Lock()

    def group(self, unique_id: bytes, world: int) -> _Group:
        with self._lock:
            group = self._groups.setdefault(unique_id, _Group(world, self.timeout))
        if group.world != world:
            raise ValueError(f"the group has world size {group.world}, a rank joined with {world}")
        return group


class LoopbackCommunicator:
    """The trainer's end of a `Loopback`: an `NCCLPush` communicator with no GPU.

    Records how many chunks were placed and not yet done at once (`most_held`), the groups it
    opened and aborted, and every tensor it sent.
    """

    def __init__(self, loopback: Loopback, *, warm_up: bool = True):
        self.loopback, self.warm_up = loopback, warm_up
        self.held = self.most_held = self.opened = self.aborted = 0
        self.sent: list[np.ndarray] = []
        self._lock = threading.Lock()

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def open(self, unique_id: bytes, rank: int, world: int) -> _Group:
        group = self.loopback.group(unique_id, world)
        group.rendezvous()
        if self.warm_up:
            group.rendezvous()
        with self._lock:
            self.opened += 1
        return group

    def place(self, tensors: Sequence[Any]) -> list[np.ndarray]:
        with self._lock:
            self.held += 1
            self.most_held = max(self.most_held, self.held)
        return [np.array(tensor) for tensor in tensors]

    def send(self, groups: Sequence[_Group], placed: list[np.ndarray]) -> None:
        for tensor in placed:
            self.sent.append(tensor)
            for group in groups:
                group.put(tensor)

    def done(self, placed: list[np.ndarray]) -> None:
        with self._lock:
            self.held -= 1

    def abort(self, group: _Group) -> None:
        group.abort()
        with self._lock:
            self.aborted += 1


# ----- engines -----------------------------------------------------------------------------------

class Replica(_Server):
    """One stand-in engine's state: paused or not, the version it reports, what it would serve.

    directory: the checkpoint it was launched on (what a reload reads). workers: its world size.
    loopback: where its NCCL weight-transfer group lives (None: /init_weight_transfer_engine fails
    as on an engine launched without --weight-transfer-config).
    """

    def __init__(self, name: str, journal: Journal, *, directory: str | Path | None = None,
                 workers: int = 1, loopback: Loopback | None = None):
        super().__init__(name, journal)
        self.directory = None if directory is None else Path(directory).absolute()
        self.workers, self.loopback = workers, loopback
        self.paused = False
        self.version: str | None = None
        self.reloaded: dict[str, Any] | None = None  # variables read back from the directory
        self.received: dict[str, np.ndarray] | None = None  # tensors received by NCCL
        self.loads = 0
        self._group: _Group | None = None
        self._updating = False

    def read_back(self) -> None:
        if self.directory is None:
            raise RuntimeError("this stand-in replica was not launched on a directory")
        self.reloaded = load_pretrained(self.directory, dtype=jnp.bfloat16, tokenizer=False).variables
        self.loads += 1


def vllm_router(replica: Replica, *, dev_mode: bool = True) -> APIRouter:
    """vLLM's development endpoints for weight updates; none of them without `dev_mode`."""
    router = APIRouter()
    if not dev_mode:
        return router

    @router.post("/pause")
    async def pause(request: Request, mode: str = "abort"):
        _, fault = await replica.enter(request)
        if fault:
            return fault
        if mode not in ("abort", "wait", "keep"):
            return JSONResponse({"detail": f"mode must be abort, wait or keep, got {mode!r}"}, 422)
        replica.paused = True
        return {"status": "paused"}

    @router.post("/resume")
    async def resume(request: Request):
        _, fault = await replica.enter(request)
        if fault:
            return fault
        replica.paused = False
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused(request: Request):
        _, fault = await replica.enter(request)
        return fault or {"is_paused": replica.paused}

    @router.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        if not isinstance(body, dict) or body.get("method") is None:
            return JSONResponse({"detail": "Missing 'method' in request body"}, 400)
        if body["method"] != "reload_weights":
            return _internal_error(f"the stand-in knows no worker method {body['method']!r}")
        try:
            await run_in_threadpool(replica.read_back)
        except Exception as error:  # noqa: BLE001 - a worker's failure is a 500 in vLLM
            return _internal_error(repr(error))
        return {"results": [None] * replica.workers}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        _, fault = await replica.enter(request)
        return fault or {"success": True}

    @router.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return JSONResponse({"detail": [{"type": "missing", "loc": ["body", "new_version"],
                                             "msg": "Field required"}]}, 422)
        replica.version = version
        return {"success": True, "new_version": version}

    @router.get("/get_world_size")
    async def get_world_size(request: Request):
        _, fault = await replica.enter(request)
        return fault or {"world_size": replica.workers}

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        info = body.get("init_info") if isinstance(body, dict) else None
        if info is None:
            return JSONResponse({"detail": "Missing 'init_info' in request body"}, 400)
        problem = _init_problem(info, replica)
        if problem:
            return _internal_error(problem)
        group = replica.loopback.group(base64.b64decode(info["nccl_unique_id_b64"]), info["world_size"])
        try:
            await run_in_threadpool(group.rendezvous)  # ncclCommInitRank
            await run_in_threadpool(group.rendezvous)  # the communicator's warm-up all-reduce
        except threading.BrokenBarrierError:
            return _internal_error("the trainer did not join the group (or skipped the warm-up all-reduce)")
        replica._group = group
        return {"message": "Weight transfer initialized"}

    @router.post("/start_weight_update")
    async def start_weight_update(request: Request):
        _, fault = await replica.enter(request)
        if fault:
            return fault
        if replica._group is None:
            return _internal_error("NCCL weight transfer not initialized")
        replica._updating = True
        return {"message": "Weight update started"}

    @router.post("/update_weights")
    async def update_weights(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        info = body.get("update_info") if isinstance(body, dict) else None
        if info is None:
            return JSONResponse({"detail": "Missing 'update_info' in request body"}, 400)
        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not (isinstance(names, list) and len(names) == len(dtypes or []) == len(shapes or [])):
            return _internal_error("names, dtype_names and shapes must be lists of one length")
        if replica._group is None or not replica._updating:
            return _internal_error("update_weights before init_weight_transfer_engine/start_weight_update")
        try:
            arrays = await run_in_threadpool(replica._group.receive, len(names))
        except (TimeoutError, ConnectionAbortedError) as error:
            return _internal_error(repr(error))
        for name, dtype, shape, array in zip(names, dtypes, shapes, arrays, strict=True):
            if array.dtype.name != dtype or list(array.shape) != shape:
                return _internal_error(f"{name}: listed {dtype}{shape}, received {array.dtype.name}"
                                       f"{list(array.shape)}")
        replica.received = dict(zip(names, arrays, strict=True))
        return {"message": "Weights updated"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        replica._updating = False
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None:
            replica.version = version
        return {"message": "Weight update finished"}

    return router


def _init_problem(info: Any, replica: Replica) -> str | None:
    """Why vLLM's NCCL engine would refuse (or never finish) this init_info; None if it is sound."""
    if replica.loopback is None:
        return "no weight-transfer engine (launch with --weight-transfer-config)"
    if not isinstance(info, dict):
        return "init_info must be an object"
    if "master_address" in info or "master_port" in info:
        return "pass nccl_unique_id_b64 OR master_address/master_port, not both"
    try:
        unique_id = base64.b64decode(info.get("nccl_unique_id_b64") or "", validate=True)
    except (binascii.Error, ValueError):
        return "nccl_unique_id_b64 is not valid standard base64"
    if len(unique_id) != 128:
        return f"nccl_unique_id_b64 must decode to 128 bytes, got {len(unique_id)}"
    if info.get("rank_offset") != 1 or info.get("world_size") != 1 + replica.workers:
        return f"rank_offset {info.get('rank_offset')} / world_size {info.get('world_size')} do not fit " \
               f"one trainer rank and {replica.workers} worker(s)"
    if replica.workers != 1:
        return "the loopback stand-in serves one worker"
    return None


def sglang_router(replica: Replica) -> APIRouter:
    """SGLang's POST /update_weights_from_disk."""
    router = APIRouter()

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        path = body.get("model_path") if isinstance(body, dict) else None
        if not path or replica.directory is None or Path(path) != replica.directory:
            return JSONResponse({"success": False, "message": f"Failed to load weights from {path!r}",
                                 "num_paused_requests": 0}, 400)
        try:
            await run_in_threadpool(replica.read_back)
        except Exception as error:  # noqa: BLE001 - SGLang answers a failed load with 400
            return JSONResponse({"success": False, "message": repr(error), "num_paused_requests": 0}, 400)
        if body.get("weight_version") is not None:
            replica.version = body["weight_version"]
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    return router


# ----- gateway -----------------------------------------------------------------------------------

class GatewayState(_Server):
    """A stand-in rllm-model-gateway: its workers' health, the weight version it stamps calls with."""

    def __init__(self, name: str, journal: Journal, *, workers: int = 1, healthy: bool = True,
                 model: str = "policy"):
        super().__init__(name, journal)
        self.healthy = [healthy] * workers
        self.model = model
        self.weight_version: int | None = None

    def workers(self) -> list[dict[str, Any]]:
        return [{"worker_id": f"worker-{i}", "url": f"http://127.0.0.1:{9000 + i}", "api_path": "/v1",
                 "model_name": self.model, "weight": 1, "healthy": healthy, "active_requests": 0}
                for i, healthy in enumerate(self.healthy)]


def gateway_router(gateway: GatewayState) -> APIRouter:
    """rllm-model-gateway's health and admin routes, and GET /v1/models."""
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request):
        _, fault = await gateway.enter(request)
        return fault or {"status": "ok"}

    @router.get("/health/workers")
    async def health_workers(request: Request):
        _, fault = await gateway.enter(request)
        workers = gateway.workers()
        return fault or {"workers": workers, "healthy": sum(w["healthy"] for w in workers), "total": len(workers)}

    @router.get("/admin/workers")
    async def admin_workers(request: Request):
        _, fault = await gateway.enter(request)
        return fault or gateway.workers()

    @router.get("/admin/weight_version")
    async def get_weight_version(request: Request):
        _, fault = await gateway.enter(request)
        return fault or {"weight_version": gateway.weight_version}

    @router.post("/admin/weight_version")
    async def set_weight_version(request: Request):
        body, fault = await gateway.enter(request)
        if fault:
            return fault
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is None:
            return JSONResponse({"error": "weight_version is required"}, 400)
        try:
            gateway.weight_version = int(version)
        except (TypeError, ValueError):
            return JSONResponse({"error": f"invalid weight_version: {version!r}"}, 400)
        return {"weight_version": gateway.weight_version}

    @router.get("/v1/models")
    async def models(request: Request):
        _, fault = await gateway.enter(request)
        if fault:
            return fault
        if not any(gateway.healthy):
            return PlainTextResponse("No healthy workers available", 500)
        return {"object": "list", "data": [{"id": gateway.model, "object": "model", "owned_by": "vllm"}]}

    return router
