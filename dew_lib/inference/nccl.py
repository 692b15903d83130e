"""`NCCLPush`: publish a policy version to vLLM replicas by NCCL broadcast from one trainer GPU.

`SafetensorsReload` goes through disk; this push sends the same tensors (`Pretrained.export`,
Hugging Face names and layout, bfloat16 by default) from one trainer device straight into each
replica's GPUs. vLLM serves it when launched with `--weight-transfer-config '{"backend": "nccl"}'`
and `VLLM_SERVER_DEV_MODE=1` (vLLM v0.30.0's routes). The endpoints and bodies follow vLLM's
dev router (vllm/entrypoints/serve/dev/rlhf/api_router.py) and its NCCL weight-transfer engine
(vllm/distributed/weight_transfer/nccl_common.py, nccl_engine.py), with the torch-free
rendezvous of vLLM PR #53784: the trainer mints the NCCL unique id and posts it, base64-encoded,
as `init_info.nccl_unique_id_b64`.

Per replica, once (the first push, and the first after `close` or a failed transfer):
GET /get_world_size?include_dp=true gives the replica's worker count W; the trainer mints a unique
id and posts {"init_info": {"nccl_unique_id_b64", "rank_offset": 1, "world_size": 1 + W,
"packed": false}} to /init_weight_transfer_engine while it joins the same group as rank 0
(`ncclCommInitRank`: both sides must be inside it together, since this rendezvous has no store
to wait on), then matches the one-element float32 all-reduce vLLM's communicator runs as it opens.

Per push of version v, every replica at once: POST /pause?mode=wait (in-flight draws finish on the
old weights), POST /start_weight_update, then POST /update_weights {"update_info": {"names",
"dtype_names", "shapes"}} on every replica while the trainer broadcasts the tensors in that order,
one broadcast per tensor, from rank 0 of every group; then POST /finish_weight_update
{"weight_version": "v"}, POST /reset_prefix_cache (must answer {"success": true}) and POST /resume.
Tensors go to the sending device a chunk (`chunk_bytes`, or one tensor larger than that) at a time:
the next chunk is copied there while the current one broadcasts, so at most two chunks sit on the
device beside the trainer's state. A replica that fails after its pause stays paused, as under
`SafetensorsReload`; a failed transfer aborts the groups, and the next push opens them again.

The trainer holds no torch: `NCCLLibrary` binds libnccl.so.2 with ctypes, and `CudaCommunicator`
sends JAX device buffers through it on the CUDA default stream. Load the engine's own library
(`library`, for a pip-installed vLLM <venv>/lib/python3.X/site-packages/nvidia/nccl/lib/libnccl.so.2):
NCCL refuses a peer of another version when the group opens, which shows up as a hang or an
error inside `ncclCommInitRank`, so pass `nccl_version` (the version vLLM logs at startup) to
have the mismatch refused up front. `close` aborts the groups (`ncclCommAbort`): NCCL's destroy
would wait for the engine's side, which the engine keeps until it exits.

Tested here against stand-in replicas through the `communicator=` seam (a loopback that stands in
for NCCL), plus the binding's refusals; the real broadcast (CudaCommunicator against a running
vLLM) has not run in this repository's tests and is to be checked on a GPU machine.

In a multi-process trainer, `Publication` runs the push on process 0 only, from that process's
copy of the replicated weights.

Not here: SGLang's NCCL route,
a replica that dies in the middle of a broadcast (the sender may then block inside NCCL until
the CUDA default stream is released; the push checks for failed replicas between chunks only).
"""

from __future__ import annotations

import base64
import ctypes
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from pathlib import Path
from typing import Any, Protocol

import httpx
import jax
import numpy as np

from dew_lib.inference.endpoints import (
    EndpointFailed,
    PushFailed,
    call,
    on_every,
    root_urls,
)
from dew_lib.models.pretrained import Pretrained
from dew_lib.models.pretrained.formats import numpy_dtype

NCCL_TYPES = {"float16": 6, "float32": 7, "bfloat16": 9}
"""`ncclDataType_t` codes (nccl.h) of the dtypes a push sends."""
_SUM = 0  # ncclSum
_UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_MINIMUM = (2, 10, 0)  # the first NCCL with ncclBfloat16
_SYMBOLS = ("ncclGetVersion", "ncclGetErrorString", "ncclGetUniqueId", "ncclCommInitRank",
            "ncclAllReduce", "ncclBroadcast", "ncclCommAbort")


class NCCLError(RuntimeError):
    """The NCCL library could not be used (not found, not NCCL, wrong version) or a call failed."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * _UNIQUE_ID_BYTES)]


def _version_tuple(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE as (major, minor, patch): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def _parse_version(text: str) -> tuple[int, int, int]:
    parts = str(text).strip().split(".")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise ValueError(f"nccl_version={text!r} is not a version; write it as vLLM logs it, e.g. '2.27.3'")
    major, minor, patch = (int(part) for part in parts)
    return major, minor, patch


class NCCLLibrary:
    """A ctypes binding of the NCCL calls a push makes, loaded from `path`.

    Refuses at construction: a path that is not a file, a file the loader cannot open, a library
    without the NCCL symbols, an NCCL older than 2.10 (no bfloat16), and, when `expected_version`
    ("2.27.3") is given, any other version. `version` is (major, minor, patch).
    """

    def __init__(self, path: str | os.PathLike, expected_version: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise NCCLError(f"no NCCL library at {self.path}; pass the engine's own libnccl.so.2 (for a "
                            "pip-installed vLLM: <venv>/lib/python3.X/site-packages/nvidia/nccl/lib/libnccl.so.2)")
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as error:
            raise NCCLError(f"cannot load {self.path} as a shared library: {error}") from error
        missing = [name for name in _SYMBOLS if not hasattr(lib, name)]
        if missing:
            raise NCCLError(f"{self.path} is not an NCCL library: it lacks {', '.join(missing)}; pass the "
                            "engine's own libnccl.so.2")
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        collective = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_void_p, ctypes.c_void_p)
        lib.ncclAllReduce.argtypes = collective
        lib.ncclBroadcast.argtypes = collective
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        self._lib = lib
        code = ctypes.c_int()
        self._check(lib.ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
        self.version = _version_tuple(code.value)
        shown = ".".join(map(str, self.version))
        if self.version < _MINIMUM:
            raise NCCLError(f"{self.path} is NCCL {shown}; a push needs NCCL 2.10 or newer (bfloat16)")
        if expected_version is not None and self.version != _parse_version(expected_version):
            raise NCCLError(
                f"{self.path} is NCCL {shown} but the engine runs NCCL {expected_version}: NCCL refuses a peer "
                "of another version. Point library at the engine's own libnccl.so.2")

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            reason = self._lib.ncclGetErrorString(status) or b"unknown error"
            raise NCCLError(f"{what} failed with NCCL error {status}: {reason.decode(errors='replace')}")

    def unique_id(self) -> bytes:
        """A fresh `ncclUniqueId`, as its 128 bytes."""
        uid = _UniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), _UNIQUE_ID_BYTES)

    def init_rank(self, unique_id: bytes, rank: int, world: int) -> ctypes.c_void_p:
        """Join the group `unique_id` names as `rank` of `world`; blocks until every rank has joined."""
        if len(unique_id) != _UNIQUE_ID_BYTES:
            raise NCCLError(f"an NCCL unique id has {_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, _UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self._check(self._lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
        return comm

    def all_reduce(self, comm: ctypes.c_void_p, pointer: int, count: int, dtype: str) -> None:
        """Sum `count` elements at device `pointer` in place, on the default stream."""
        self._check(self._lib.ncclAllReduce(pointer, pointer, count, NCCL_TYPES[dtype], _SUM, comm, None),
                    "ncclAllReduce")

    def broadcast(self, comm: ctypes.c_void_p, pointer: int, count: int, dtype: str, root: int = 0) -> None:
        """Broadcast `count` elements at device `pointer` from `root`, on the default stream."""
        self._check(self._lib.ncclBroadcast(pointer, pointer, count, NCCL_TYPES[dtype], root, comm, None),
                    "ncclBroadcast")

    def abort(self, comm: ctypes.c_void_p) -> None:
        """Free `comm` without waiting for its peers or its operations."""
        self._check(self._lib.ncclCommAbort(comm), "ncclCommAbort")


class Communicator(Protocol):
    """What `NCCLPush` needs from the transport: the seam between HTTP sequencing and NCCL.

    open joins a group as `rank` of `world` (blocking until the peers join) and runs the warm-up
    all-reduce; place starts copying a chunk of tensors to the sending device and returns a
    handle; send broadcasts a placed chunk, tensor by tensor in order, to every group; done waits
    until a placed chunk is no longer in use and frees it; abort tears a group down.
    """

    def unique_id(self) -> bytes: ...

    def open(self, unique_id: bytes, rank: int, world: int) -> Any: ...

    def place(self, tensors: Sequence[Any]) -> Any: ...

    def send(self, groups: Sequence[Any], placed: Any) -> None: ...

    def done(self, placed: Any) -> None: ...

    def abort(self, group: Any) -> None: ...


class CudaCommunicator:
    """`Communicator` over `NCCLLibrary` for JAX arrays on one CUDA `device`.

    A communicator binds to the CUDA context current on the calling thread when it opens, so
    every call first makes the device's primary context (the one JAX uses) current. Collectives
    run on the CUDA default stream; `send` waits for a chunk's copies first, `done` waits for the
    default stream before the chunk's buffers may be freed.
    """

    def __init__(self, library: NCCLLibrary, device: Any):
        if getattr(device, "platform", None) != "gpu":
            raise NCCLError(f"NCCLPush sends from a CUDA device; {device} is not one (pass device=)")
        self.library, self.device = library, device
        self._cuda: Any = None
        self._context = ctypes.c_void_p()

    def _current(self) -> None:
        if self._cuda is None:
            cuda = ctypes.CDLL("libcuda.so.1")
            ordinal = ctypes.c_int()
            self._driver(cuda, cuda.cuInit(0), "cuInit")
            self._driver(cuda, cuda.cuDeviceGet(ctypes.byref(ordinal), self.device.local_hardware_id), "cuDeviceGet")
            self._driver(cuda, cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), ordinal),
                         "cuDevicePrimaryCtxRetain")
            cuda.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            cuda.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
            self._cuda = cuda
        self._driver(self._cuda, self._cuda.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    @staticmethod
    def _driver(cuda: Any, status: int, what: str) -> None:
        if status != 0:
            raise NCCLError(f"{what} failed with CUDA driver error {status}")

    def _synchronize(self) -> None:
        self._current()
        self._driver(self._cuda, self._cuda.cuStreamSynchronize(None), "cuStreamSynchronize")

    def unique_id(self) -> bytes:
        return self.library.unique_id()

    def open(self, unique_id: bytes, rank: int, world: int) -> ctypes.c_void_p:
        self._current()
        comm = self.library.init_rank(unique_id, rank, world)
        warm = jax.device_put(np.zeros(1, np.float32), self.device).block_until_ready()
        self._current()
        self.library.all_reduce(comm, warm.unsafe_buffer_pointer(), 1, "float32")
        self._synchronize()
        return comm

    def place(self, tensors: Sequence[Any]) -> list[Any]:
        return jax.device_put(list(tensors), self.device)

    def send(self, groups: Sequence[Any], placed: list[Any]) -> None:
        jax.block_until_ready(placed)
        self._current()
        for buffer in placed:
            for comm in groups:
                self.library.broadcast(comm, buffer.unsafe_buffer_pointer(), buffer.size, buffer.dtype.name)

    def done(self, placed: list[Any]) -> None:
        self._synchronize()
        placed.clear()

    def abort(self, group: ctypes.c_void_p) -> None:
        self._current()
        self.library.abort(group)


class NCCLPush:
    """Push by NCCL broadcast to the vLLM replicas at `engines`; see the module docstring.

    pretrained: the `Pretrained` the replicas serve (its `export` gives the tensors). engines: the
    replicas' root URLs. library: the engine's own libnccl.so.2, loaded and checked now.
    communicator: instead of `library`, any `Communicator` (the seam tests use). device: the JAX
    device that sends (default: the first local device). nccl_version: the engine's NCCL version
    ("2.27.3"), refused up front when the library differs. dtype: what the replicas receive.
    chunk_bytes: bytes placed on the sending device per chunk. timeout: seconds one HTTP call or
    a group opening may take (an /update_weights call lasts the whole broadcast).

    Call it as `push(variables, version)`; wrap it in `Publication` for a versioned publisher.
    `close` aborts the groups; use it as a context manager or close it when done.
    """

    def __init__(self, pretrained: Pretrained, engines: Sequence[str], library: str | os.PathLike | None = None,
                 *, communicator: Communicator | None = None, device: Any = None,
                 nccl_version: str | None = None, dtype: Any = "bfloat16", chunk_bytes: int = 512 * 2**20,
                 timeout: float = 600.0):
        if not isinstance(pretrained, Pretrained):
            raise ValueError(f"pretrained must be a dew_lib.models.pretrained.Pretrained, got "
                             f"{type(pretrained).__name__}")
        if (library is None) == (communicator is None):
            raise ValueError("pass library (the engine's libnccl.so.2) or communicator, exactly one of them")
        self.dtype = numpy_dtype(dtype)
        if self.dtype.name not in NCCL_TYPES:
            raise ValueError(f"dtype={dtype!r}: a push sends one of {sorted(NCCL_TYPES)}")
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.pretrained, self.engines = pretrained, root_urls(engines, "engines")
        self.device, self.chunk_bytes, self.timeout = device, chunk_bytes, timeout
        self.library = None if library is None else NCCLLibrary(library, expected_version=nccl_version)
        self._communicator = communicator
        self._groups: dict[str, Any] = {}

    # ----- the push ----------------------------------------------------------------------------
    def __call__(self, variables: Any, version: int) -> None:
        """Send `variables` to every replica and have them serve it as `version`."""
        what = f"pushing version {version} by NCCL"
        chunks = self._chunks(variables)
        pending = [next(chunks)]  # checks the variables against the model before any replica is touched
        communicator = self._transport()
        try:
            for root in self.engines:
                if root not in self._groups:
                    self._groups[root] = self._open(communicator, root)
        except EndpointFailed as failure:
            raise PushFailed(what, [failure], len(self.engines)) from failure
        on_every(self.engines, self._begin, what)
        self._transfer(communicator, pending, chunks, what)
        on_every(self.engines, lambda root: self._finish(root, str(version)), what)

    def close(self) -> None:
        """Abort every open group; a later push opens them again."""
        groups, self._groups = self._groups, {}
        for group in groups.values():
            self._transport().abort(group)

    def __enter__(self) -> NCCLPush:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- HTTP --------------------------------------------------------------------------------
    def _client(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout)

    def _begin(self, root: str) -> None:
        with self._client() as client:
            call(client, root, "POST", "/pause", params={"mode": "wait"})
            call(client, root, "POST", "/start_weight_update")

    def _receive(self, root: str) -> None:
        listing = {"names": [t.name for t in self.pretrained.tensors],
                   "dtype_names": [self.dtype.name] * len(self.pretrained.tensors),
                   "shapes": [list(t.shape) for t in self.pretrained.tensors]}
        with self._client() as client:
            call(client, root, "POST", "/update_weights", body={"update_info": listing})

    def _finish(self, root: str, version: str) -> None:
        with self._client() as client:
            call(client, root, "POST", "/finish_weight_update", body={"weight_version": version})
            call(client, root, "POST", "/reset_prefix_cache", must_succeed=True)
            call(client, root, "POST", "/resume")

    def _open(self, communicator: Communicator, root: str) -> Any:
        """Open the group with `root`: post the unique id and join as rank 0 at the same time."""
        with self._client() as client:
            answer = call(client, root, "GET", "/get_world_size", params={"include_dp": "true"})
        workers = answer.get("world_size") if isinstance(answer, dict) else None
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise EndpointFailed(root, "GET /get_world_size", f"answered {answer!r}; expected a positive world_size")
        unique_id = communicator.unique_id()
        body = {"init_info": {"nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
                              "rank_offset": 1, "world_size": 1 + workers, "packed": False}}

        def post() -> None:
            with self._client() as client:
                call(client, root, "POST", "/init_weight_transfer_engine", body=body)

        # Daemon threads: a side left waiting in the rendezvous must hold neither the push nor the exit.
        posting = _in_thread(post)
        joining = _in_thread(communicator.open, unique_id, 0, 1 + workers)
        wait([posting, joining], timeout=self.timeout, return_when=FIRST_EXCEPTION)
        if posting.done() and joining.done() and posting.exception() is None and joining.exception() is None:
            return joining.result()
        joining.add_done_callback(lambda opened: _abort_opened(communicator, opened))
        for side in (posting, joining):
            failed = side.exception() if side.done() else None
            if failed is not None:
                raise failed
        raise EndpointFailed(root, "POST /init_weight_transfer_engine",
                             f"did not open the NCCL group with the trainer within {self.timeout} s")

    # ----- tensors -----------------------------------------------------------------------------
    def _transport(self) -> Communicator:
        if self._communicator is None:
            assert self.library is not None
            self._communicator = CudaCommunicator(self.library, self.device or jax.local_devices()[0])
        return self._communicator

    def _chunks(self, variables: Any) -> Iterator[list[Any]]:
        """The exported tensors in listing order, grouped into chunks of at most `chunk_bytes`."""
        exported = self.pretrained.export(variables, dtype=self.dtype)
        chunk: list[Any] = []
        size = 0
        for tensor in self.pretrained.tensors:
            name, array = next(exported)
            if name != tensor.name:
                raise RuntimeError(f"export yielded {name} where the listing has {tensor.name}")
            nbytes = math.prod(tensor.shape) * self.dtype.itemsize
            if chunk and size + nbytes > self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(array)
            size += nbytes
        yield chunk

    def _transfer(self, communicator: Communicator, pending: list[list[Any]], rest: Iterator[list[Any]],
                  what: str) -> None:
        """Post /update_weights on every replica while broadcasting the chunks to every group."""
        groups = [self._groups[root] for root in self.engines]
        receiving = {root: _in_thread(self._receive, root) for root in self.engines}
        try:
            sent = self._broadcast(communicator, groups, pending, rest, receiving)
        except BaseException:
            self.close()
            raise
        if sent:
            wait(receiving.values())
        failures = [_failure(root, future) for root, future in receiving.items()
                    if not future.done() or future.exception() is not None]
        if failures:
            self.close()
            raise PushFailed(what, failures, len(self.engines)) from failures[0]

    def _broadcast(self, communicator: Communicator, groups: list[Any], pending: list[list[Any]],
                   rest: Iterator[list[Any]], receiving: dict[str, Future]) -> bool:
        """Send every chunk, the next one placed while the current one goes; False if a replica
        answered /update_weights before the last tensor was sent (it can only have failed).

        No reference to a chunk outlives its `done`: at most two are held, the one going and the
        one placed behind it.
        """
        held = [communicator.place(pending.pop())]
        try:
            while held:
                following = next(rest, None)
                if following is not None:
                    held.append(communicator.place(following))
                    following = None
                if any(future.done() for future in receiving.values()):
                    return False
                communicator.send(groups, held[0])
                communicator.done(held.pop(0))
            return True
        finally:
            for placed in held:
                communicator.done(placed)


def _in_thread(function: Callable[..., Any], *args: Any) -> Future:
    """`function(*args)` on a new daemon thread, its outcome in the returned future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(error)

    threading.Thread(target=run, name="dew-nccl", daemon=True).start()
    return future


def _abort_opened(communicator: Communicator, opened: Future) -> None:
    """Abort a group that opened after its replica's side had already failed."""
    if not opened.cancelled() and opened.exception() is None:
        communicator.abort(opened.result())


def _failure(root: str, future: Future) -> EndpointFailed:
    if future.done():
        error = future.exception()
        if isinstance(error, EndpointFailed):
            return error
        return EndpointFailed(root, "POST /update_weights", f"failed on the trainer's side: {error!r}")
    return EndpointFailed(root, "POST /update_weights", "was still receiving when the push stopped because "
                          "another replica failed")
