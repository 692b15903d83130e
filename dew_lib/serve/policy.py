"""ServedPolicy: a checkpoint directory served by Dew's native server to asyncio request handlers.

`ServedPolicy.load(directory, ...)` reads a Hugging Face directory (`load_pretrained`) and starts a
`NativeRolloutServer` on it with one `Sampling` for every request, its EOS ids taken from the
checkpoint the way vLLM takes them: the tokenizer's EOS id first, then the other ids of
generation_config.json (config.json when there is none).

`draw` is what a route awaits: it submits the prompt and awaits the future without blocking the
event loop; a cancelled await (a client that went away) cancels the future, and the native server
frees the request's slot at its next call. A streaming route passes `on_ids`, which the native
server calls on its own thread with each engine call's new ids. A request that finds the engine
idle waits up to `window` seconds (until `quiet` seconds pass with no other arrival) for the rest
of its burst: HTTP requests sent together arrive a fraction of a millisecond apart, and a request
that joins after the engine started decoding waits for that whole call (`steps` ids), so without
the wait a burst of 32 would decode its first arrival alone for a call and everyone else one call
late. `pause` stops admitting requests (new ones wait, not fail) and returns once every request
already submitted has finished, as vLLM's `/pause?mode=wait`; `resume` releases the waiting ones.
`reload` re-reads the launch directory and hands the weights to the server under the next version.
Tokenizer work runs on one worker thread of its own, so it neither blocks the event loop nor runs
two encodes at once.

Not here: HTTP (`app`), the launcher (`launch`), the engine (`dew_lib.inference`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from dew_lib.inference import NativeRolloutServer, Server, ServerClosed, ServeTask, serving_mesh
from dew_lib.models.pretrained import load_pretrained
from dew_lib.records.draw import Draw
from dew_lib.sampling import Sampling
from dew_lib.serve.render import LOGPROBS_MODES

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
QUIET = 0.003  # seconds without a new arrival that end an idle engine's wait for a burst
DEFAULT_CAPACITY = 2048  # ids per slot when the model allows more: a KV cache sized for CPU memory


class ReloadError(RuntimeError):
    """The launch directory could not be served in place of the current weights."""


class _Burst:
    """Requests that reached an idle engine together, waiting to be submitted at once."""

    def __init__(self):
        self.requests: list = []
        self.arrived = asyncio.Event()
        self.task: asyncio.Task | None = None

    def join(self, request) -> None:
        self.requests.append(request)
        self.arrived.set()


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def checkpoint_eos(tokenizer: Any, config: Mapping[str, Any],
                   generation_config: Mapping[str, Any] | None) -> tuple[int | None, tuple[int, ...]]:
    """(primary EOS id, every EOS id) as vLLM reads them from a checkpoint."""
    others = _ids((generation_config or config).get("eos_token_id"))
    primary = getattr(tokenizer, "eos_token_id", None)
    if primary is None:
        primary = others[0] if others else None
    every = ([] if primary is None else [int(primary)]) + [i for i in others if i != primary]
    return (None if primary is None else int(primary)), tuple(dict.fromkeys(every))


class ServedPolicy:
    """A `NativeRolloutServer` over a checkpoint directory, with its tokenizer and serving state.

    Build it with `ServedPolicy.load`. `name` is the model name clients send; `sampling` the one
    `Sampling` every request is drawn with; `capacity` the most ids a request may hold (prompt and
    completion); `logprobs_mode` which likelihood responses report. `close` stops the server.
    """

    def __init__(self, native: NativeRolloutServer, *, name: str, directory: Path, tokenizer: Any,
                 dtype: str, primary_eos: int | None, logprobs_mode: str = "raw_logprobs",
                 window: float = 0.025, quiet: float = QUIET):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        self.native, self.name, self.directory = native, name, Path(directory)
        self.tokenizer, self.dtype, self.primary_eos = tokenizer, dtype, primary_eos
        self.logprobs_mode = logprobs_mode
        self.token_text: dict[int, str] = {}  # id -> its decoding alone; touched on the text thread only
        self.window, self.quiet = float(window), float(quiet)  # gathering a burst at an idle engine
        self.weight_version = "default"  # vLLM's label until /update_weight_version sets one
        self.in_flight = 0  # requests admitted (gathering or submitted) and not finished
        self.most_in_flight = 0  # the most at once since launch: a load gauge
        self.failure: BaseException | None = None  # why the engine stopped serving, if it did
        self._resumed: asyncio.Event | None = None  # not None while paused; made in the loop that pauses
        self._drained: asyncio.Event | None = None
        self._reloading: asyncio.Lock | None = None
        self._burst: _Burst | None = None  # requests gathering at an idle engine
        self._text = ThreadPoolExecutor(1, thread_name_prefix="dew-serve-text")

    @classmethod
    def load(cls, directory: str | Path, *, slots: int = 8, capacity: int | None = None,
             sampling: Sampling = Sampling(), dtype: str = "float32", logprobs_mode: str = "raw_logprobs",
             served_model_name: str | None = None, steps: int = 16, seed: int = 0,
             window: float = 0.025, tensor_parallel_size: int = 1, routing: bool = False) -> ServedPolicy:
        """Load `directory` and start serving it.

        sampling: temperature and filters for every request; its eos_id, when None, becomes the
        checkpoint's EOS ids. capacity: ids per slot (default: the model's max_seq_len, at most
        2048). dtype: "float32" or "bfloat16", the precision of weights and activations.
        steps: decode steps per compiled call. seed: the generator of seeds for requests
        without one. window: the most seconds a request reaching an idle engine waits for the
        rest of its burst (0: submit at once). tensor_parallel_size: local devices the model's
        heads, MLP and KV cache are split across (1: one device). routing: a mixture of experts
        reports each completion's routes (`routed_experts`, as vLLM does with
        --enable-return-routed-experts).
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        directory = Path(directory)
        mesh = serving_mesh(tensor_parallel_size) if tensor_parallel_size != 1 else None
        # split as it is read: no device ever holds the whole model
        pretrained, variables = load_pretrained(directory, dtype=DTYPES[dtype], sharding=mesh)
        primary, every = checkpoint_eos(pretrained.tokenizer, pretrained.config, pretrained.generation_config)
        if sampling.eos_id is None and every:
            sampling = dataclasses.replace(sampling, eos_id=every)
        elif sampling.eos_id is not None:
            primary = sampling.eos_ids[0] if primary not in sampling.eos_ids else primary
        model = pretrained.model
        capacity = min(model.max_seq_len, DEFAULT_CAPACITY) if capacity is None else capacity
        server = Server.from_task(ServeTask(model=model, variables=variables, sampling=sampling),
                                  slots=slots, capacity=capacity, steps=steps, mesh=mesh, routing=routing)
        return cls(NativeRolloutServer(server, seed=seed), name=served_model_name or directory.resolve().name,
                   directory=directory, tokenizer=pretrained.tokenizer, dtype=dtype, primary_eos=primary,
                   logprobs_mode=logprobs_mode, window=window)

    # ---- what the engine serves ---------------------------------------------------------------

    @property
    def model(self):
        return self.native.server.model

    @property
    def sampling(self) -> Sampling:
        return self.native.sampling

    @property
    def capacity(self) -> int:
        return self.native.server.capacity

    @property
    def vocab_size(self) -> int | None:
        return self.native.server.vocab_size

    @property
    def version(self) -> int:
        """The weights version new requests are drawn from: 0 at launch, one more per reload."""
        return self.native.version

    @property
    def paused(self) -> bool:
        return self._resumed is not None

    def warm_up(self) -> None:
        """Compile the first prefill and the decode call before any client waits on them."""
        budget = 2 if self.capacity > 2 else 1
        self.native.submit([0], budget, seed=0).result()

    # ---- requests -----------------------------------------------------------------------------

    async def draw(self, prompt_ids, max_tokens: int, seed: int | None, on_ids=None) -> Draw:
        """Sample one completion; waits while paused. Raises ValueError for a request the engine
        refuses and ServerClosed once the engine stopped. on_ids: `NativeRolloutServer.submit`'s,
        called on the engine's thread with the ids of each call that did not finish the draw."""
        while self._resumed is not None:
            await self._resumed.wait()
        self.in_flight += 1  # admitted: a pause from now on waits for this request
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self._burst is None and self.in_flight == 1 and self.window > 0:
                self._burst = _Burst()
                self._burst.task = asyncio.ensure_future(self._gather(self._burst))  # held: tasks are weak
            if self._burst is not None:
                submitted = asyncio.get_running_loop().create_future()
                self._burst.join((prompt_ids, max_tokens, seed, on_ids, submitted))
                future = await submitted
            else:
                future = self._submit(prompt_ids, max_tokens, seed, on_ids)
            return await asyncio.wrap_future(future)  # cancelling this await cancels the future
        except ServerClosed as error:
            self.failure = error
            raise
        finally:
            self.in_flight -= 1
            if not self.in_flight and self._drained is not None:
                self._drained.set()

    def _submit(self, prompt_ids, max_tokens, seed, on_ids=None):
        return self.native.submit(prompt_ids, max_tokens, seed=seed, on_ids=on_ids)

    async def _gather(self, burst: _Burst) -> None:
        """Wait for `burst` to fill the free slots, go quiet or outlast the window; submit it."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.window
        try:
            while len(burst.requests) < self.native.server.free and loop.time() < end:
                burst.arrived.clear()
                try:
                    async with asyncio.timeout(min(self.quiet, end - loop.time())):
                        await burst.arrived.wait()
                except TimeoutError:
                    break
        finally:
            self._burst = None
            for prompt_ids, max_tokens, seed, on_ids, submitted in burst.requests:  # in arrival order, at once
                if submitted.done():  # its client went away while it waited
                    continue
                try:
                    submitted.set_result(self._submit(prompt_ids, max_tokens, seed, on_ids))
                except Exception as error:  # noqa: BLE001 - it belongs to that request
                    submitted.set_exception(error)

    async def text(self, function, *args, **kwargs):
        """Run tokenizer work on the policy's text thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._text, functools.partial(function, *args, **kwargs))

    # ---- weights and pausing ------------------------------------------------------------------

    async def pause(self) -> None:
        """Admit no new request and return once every submitted one has finished."""
        if self._resumed is None:
            self._resumed = asyncio.Event()
        while self.in_flight:
            if self._drained is None or self._drained.is_set():
                self._drained = asyncio.Event()
            await self._drained.wait()

    def resume(self) -> None:
        """Admit requests again, the waiting ones first."""
        if self._resumed is not None:
            self._resumed.set()
            self._resumed = None

    async def reload(self) -> int:
        """Re-read the launch directory and serve its weights under the next version.

        Requests generating now continue on the new weights (pause first to avoid that); refuses
        a directory whose config.json now describes another model."""
        if self._reloading is None:
            self._reloading = asyncio.Lock()
        async with self._reloading:
            loaded = await asyncio.to_thread(load_pretrained, self.directory, dtype=DTYPES[self.dtype],
                                             tokenizer=False, sharding=self.native.server.mesh)
            if loaded.model != self.model:
                raise ReloadError(
                    f"{self.directory / 'config.json'} now describes a different model than the one "
                    f"served; reload_weights replaces weights only, so restart dew serve to serve it")
            version = self.version + 1
            await asyncio.to_thread(self.native.load, loaded.variables, version)
            return version

    def close(self) -> None:
        self.native.close()
        self._text.shutdown(wait=False)


__all__ = ["DEFAULT_CAPACITY", "DTYPES", "ReloadError", "ServedPolicy", "checkpoint_eos"]
