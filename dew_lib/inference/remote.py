"""What every client of a remote engine shares: request threads, futures, versions, and the Draw.

`RemoteRolloutServer` implements the `RolloutServer` contract over HTTP. `submit` checks the
request here and now (ValueError), records the version served at that moment and hands the
request to a thread pool; the future it returns stays pending until the engine's answer is
parsed, so `future.cancel()` succeeds any time before that. A request cancelled before its
thread picks it up is never sent; one already sent runs to its end on the engine and its answer
is dropped. A subclass says how one request is sent and read (`_draw`).

`load` hands the weights to the publisher the server was built with (a weight push, such as a
`Publication` over `SafetensorsReload` or `NCCLPush`); with `weights=None` the engine's weights
are fixed and `load` refuses. `version` is the publisher's own `version` when it has one, else
the version of the last `load` that returned. A draw carries the version served when it was
submitted: a push that lands while the request waits or runs can only make the draw newer than
its label, never older, so the label is the oldest weights that may have produced it.

Every way an engine can fail a request (an error status, a timeout, a dropped connection, an
answer that is not JSON or lacks a field the draw needs, a finish the draw cannot represent)
fails the future with `EngineError`, which the sources record as an INFRA_ERROR session and the
scheduler retries. `RemoteOptions` bounds every wait: nothing hangs on a silent engine.

Not here: the engines' wire formats (`openai_engine`, `vllm_generate`), weight pushes, retries
(the scheduler resubmits failed sessions).
"""

from __future__ import annotations

import abc
import base64
import binascii
import concurrent.futures
import dataclasses
import io
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from dew_lib.inference.base import Publisher, ServerClosed
from dew_lib.options import integer, number
from dew_lib.records.draw import Draw
from dew_lib.sampling import Sampling


class EngineError(RuntimeError):
    """A remote engine failed a request: an error status, a timeout, a dropped connection, or an
    answer a draw cannot be read from. The message names the engine and what went wrong."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteOptions:
    """How a client talks to its engine.

    workers: requests in flight at once (the engine batches them); more wait in a queue.
    timeout: seconds a request may wait for its answer (reading or writing), generation
    included, so size it for the longest draw. connect_timeout: seconds to open a connection.
    """

    workers: int = 64
    timeout: float = 600.0
    connect_timeout: float = 10.0

    def __post_init__(self):
        integer("RemoteOptions.workers", self.workers)
        number("RemoteOptions.timeout", self.timeout, above=0)
        number("RemoteOptions.connect_timeout", self.connect_timeout, above=0)


def check_prompt(prompt_ids, max_new_tokens: int, seed: int | None) -> np.ndarray:
    """The prompt as int32 ids, after refusing what no engine can serve (ValueError)."""
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt_ids must be a nonempty 1-D sequence of ids, got shape {prompt.shape}")
    if not np.issubdtype(prompt.dtype, np.integer) or prompt.dtype == np.bool_:
        raise ValueError(f"prompt_ids must be integer token ids, got dtype {prompt.dtype}")
    if int(prompt.min()) < 0:
        raise ValueError(f"prompt_ids must be nonnegative token ids, got {int(prompt.min())}")
    integer("max_new_tokens", max_new_tokens)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)
                             or not 0 <= seed < 2**32):
        raise ValueError(f"seed must be None or an int in [0, 2**32), got {seed!r}")
    return prompt.astype(np.int32)


class RemoteRolloutServer(abc.ABC):
    """A `RolloutServer` whose draws come from an engine over HTTP (see the module docstring).

    Subclasses implement `_draw(prompt, max_new_tokens, seed, version) -> Draw`, raising
    `EngineError` for the engine's failures, and may override `_close_transport`.
    """

    engine = "the engine"  # how messages name the engine

    def __init__(self, sampling: Sampling, weights: Publisher | None, *, options: RemoteOptions,
                 seed: int = 0):
        if not isinstance(sampling, Sampling):
            raise TypeError(f"{type(self).__name__}.sampling must be a dew_lib.sampling.Sampling, "
                            f"got {type(sampling).__name__}")
        if weights is not None and not callable(getattr(weights, "load", None)):
            raise TypeError(f"{type(self).__name__}.weights must be a Publisher (load(variables, "
                            f"version)) or None for fixed weights, got {type(weights).__name__}")
        if not isinstance(options, RemoteOptions):
            raise TypeError(f"{type(self).__name__}.options must be a RemoteOptions, got "
                            f"{type(options).__name__}")
        self.sampling, self.weights, self.options = sampling, weights, options
        self._seeds = np.random.default_rng(seed)
        self._version = int(getattr(weights, "version", 0))
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(
            options.workers, thread_name_prefix=f"dew-{type(self).__name__}")

    @property
    def version(self) -> int:
        """The version of the weights requests submitted now are drawn from."""
        if self.weights is not None and hasattr(self.weights, "version"):
            return int(self.weights.version)
        return self._version

    def submit(self, prompt_ids, max_new_tokens: int, *, seed: int | None = None) -> Future[Draw]:
        """Send one request on a worker thread; the future resolves to its `Draw` or fails with
        `EngineError`. Refuses (ValueError, here and now) an empty or non-integer prompt, a bad
        budget and a seed outside [0, 2**32); seed None draws one from this server's generator."""
        prompt = check_prompt(prompt_ids, max_new_tokens, seed)
        future: Future[Draw] = Future()
        with self._lock:
            self._raise_if_closed()
            if seed is None:
                seed = int(self._seeds.integers(0, 2**32))
            version = self.version  # read with the request, before any later push
            self._pending.add(future)
            self._pool.submit(self._run, future, prompt, int(max_new_tokens), int(seed), version)
        return future

    def load(self, variables: Any, version: int) -> None:
        """Publish `variables` as `version` through the server's publisher; requests submitted
        after this returns are labelled `version`. Refuses when the weights are fixed."""
        if isinstance(version, bool) or not isinstance(version, int | np.integer):
            raise ValueError(f"load version must be an int, got {version!r}")
        self._raise_if_closed()
        if self.weights is None:
            raise ValueError(
                f"{type(self).__name__} was built with weights=None, so the engine's weights are "
                "fixed; build it with a publisher (e.g. Publication over SafetensorsReload or "
                "NCCLPush) to push new ones")
        self.weights.load(variables, int(version))
        if not hasattr(self.weights, "version"):
            self._version = int(version)

    def close(self) -> None:
        """Fail every request not yet answered with `ServerClosed`, drop queued ones and close
        the connection. Does not wait for requests in flight: their answers are dropped."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending), set()  # close settles these
        self._pool.shutdown(wait=False, cancel_futures=True)
        for future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(ServerClosed(f"{type(self).__name__} was closed before this "
                                                  "draw was answered"))
        self._close_transport()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _raise_if_closed(self):
        if self._closed:
            raise ServerClosed(f"{type(self).__name__} is closed")

    # An optional hook, not an abstract one: only servers that own a connection override it.
    def _close_transport(self) -> None:  # noqa: B027 (a no-op by default on purpose)
        """Release the connection a subclass owns (nothing by default)."""

    def _run(self, future: Future, prompt: np.ndarray, max_new_tokens: int, seed: int,
             version: int) -> None:
        if future.cancelled() or self._closed:
            self._settle(future)
            return
        try:
            draw = self._draw(prompt, max_new_tokens, seed, version)
        except BaseException as error:  # noqa: BLE001 - every failure goes to the future
            self._settle(future, error=error)
            return
        self._settle(future, draw=draw)

    def _settle(self, future: Future, *, draw: Draw | None = None,
                error: BaseException | None = None) -> None:
        """Resolve `future` unless `close` took it first; callbacks run outside the lock."""
        with self._lock:
            owned = future in self._pending
            self._pending.discard(future)
        if not owned or (draw is None and error is None) or not future.set_running_or_notify_cancel():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(draw)

    @abc.abstractmethod
    def _draw(self, prompt: np.ndarray, max_new_tokens: int, seed: int, version: int) -> Draw:
        """Send one request and read its answer into a Draw (on a pool thread); raise
        `EngineError` when the engine fails it. Each engine's client says how."""


def remote_draw(engine: str, sampling: Sampling, *, ids: Sequence[int] | np.ndarray,
                log_probs: Sequence[float] | np.ndarray,
                finish_reason: Any, version: int, max_new_tokens: int,
                routed_experts: np.ndarray | None = None, prompt_size: int | None = None,
                support: Sequence[Sequence[int]] | None = None) -> Draw:
    """The `Draw` an engine's answer describes, or `EngineError` when it cannot be one.

    ids: the sampled ids as the engine listed them, EOS included on a natural stop (both vLLM
    and SGLang keep the EOS id in their token ids and report its log-probability). finish_reason
    "stop" is EOS, "length" the budget; any other ("abort", "error", none) fails the draw. Under
    a greedy `Sampling` the behavior log-probabilities are 0, whatever the engine reported,
    as for the native server: the greedy policy draws its id with certainty. routed_experts
    covering every id but the last (the engines never forward the last sampled id) get a zero
    row for it; no scored position reads that row. prompt_size is required with them.
    """
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0)):
        raise EngineError(f"{engine} reported sampled ids that are not token ids: {ids.tolist()[:20]}")
    values = np.asarray(log_probs, np.float64)
    if values.shape != ids.shape:
        raise EngineError(f"{engine} reported {values.size} log-probabilities for {ids.size} sampled "
                          "ids; it must report one per sampled id (request logprobs=0)")
    if not np.isfinite(values).all():
        raise EngineError(f"{engine} reported a non-finite log-probability: {values.tolist()[:20]}")
    if finish_reason not in ("stop", "length"):
        raise EngineError(f"{engine} finished the request with finish_reason={finish_reason!r}, "
                          "neither EOS ('stop') nor the budget ('length'); nothing was kept")
    if ids.size == 0 or ids.size > max_new_tokens:
        raise EngineError(f"{engine} returned {ids.size} sampled ids for a budget of "
                          f"{max_new_tokens}; a finished draw holds 1 to max_new_tokens ids")
    eos = finish_reason == "stop"
    if eos and sampling.eos_ids and int(ids[-1]) not in sampling.eos_ids:
        raise EngineError(
            f"{engine} stopped on id {int(ids[-1])}, which Sampling.eos_id={sampling.eos_id} does "
            "not list; add every id the engine stops on (the model's generation_config "
            "eos_token_id) to Sampling.eos_id")
    if sampling.greedy:
        values = np.zeros_like(values)
    routed = None
    if routed_experts is not None:
        routed = np.asarray(routed_experts)
        if prompt_size is None:
            raise TypeError("remote_draw needs prompt_size with routed_experts (they cover the prompt too)")
        full = prompt_size + ids.size
        if routed.ndim == 3 and routed.shape[0] == full - 1:
            routed = np.concatenate([routed, np.zeros((1, *routed.shape[1:]), routed.dtype)])
        if routed.ndim != 3 or routed.shape[0] != full:
            raise EngineError(f"{engine} reported routed_experts of shape {routed.shape} for "
                              f"{prompt_size} prompt and {ids.size} sampled ids; expected "
                              f"[{full - 1}, layers, top_k]")
    try:
        return Draw(ids=ids.astype(np.int32), behavior_log_probs=values, raw_log_probs=None,
                    eos=eos, version=version, routed_experts=routed, support=support)
    except (TypeError, ValueError) as error:
        raise EngineError(f"{engine} reported a draw Dew cannot record: {error}") from error


def decode_npy(engine: str, name: str, value: Any) -> np.ndarray:
    """An array sent as base64 `.npy` bytes (how vLLM sends routed_experts), or `EngineError`.
    name: where the answer holds it, for the message."""
    if not isinstance(value, str):
        raise EngineError(f"{engine} sent {name} as {type(value).__name__}, not base64 .npy text")
    try:
        return np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as error:
        raise EngineError(f"{engine} sent a {name} that is not base64 .npy bytes: {error}") from error


def field(engine: str, value: Any, path: str, kind: type | tuple[type, ...], *, at: str = "") -> Any:
    """`value` at the dotted `path` of a JSON answer, of type `kind`, or `EngineError` naming it.
    at: where `value` itself sits in the answer (e.g. "choices.0"), for the message."""
    named = f"{at}.{path}" if at else path
    for part in path.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise EngineError(f"{engine} answered without {named}")
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise EngineError(f"{engine} answered {named} as {type(value).__name__}, not "
                          f"{' or '.join(k.__name__ for k in kinds)}")
    return value


__all__ = ["EngineError", "RemoteOptions", "RemoteRolloutServer", "check_prompt", "decode_npy",
           "field", "remote_draw"]
