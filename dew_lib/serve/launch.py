"""Launching `dew serve`: load a checkpoint, bind a socket, run uvicorn until SIGTERM or SIGINT.

`serve(directory, ...)` is what the `dew serve` command runs; `running(app)` serves an app on a
background thread for tests, benches and notebooks, and yields its URL.

`lora_modules` ({name: PEFT adapter directory}, the `--lora NAME=PATH` flags) serves those
adapters over the checkpoint, each under its name (`adapters.ServedModels`).

`options` (`guard.ServeOptions`) are the limits on clients: an API key (`--api-key`), request
size, read and write timeouts, a per-request max_tokens ceiling and whether request chat
templates are rendered. The development routes (pause, reload, weight version) change what every
client is served, so `serve` mounts them only with dev_endpoints=True (the `--dev-endpoints` flag,
Dew's counterpart of vLLM's VLLM_SERVER_DEV_MODE=1), behind the API key when there is one.
`serve` warns on stderr when it listens beyond loopback without a key, and when the development
routes are on without one.

A SIGTERM or SIGINT stops accepting connections, gives in-flight requests `grace` seconds to
finish, cancels the rest, closes the engine and returns; `serve` then exits the process with
status 0 for SIGTERM. Nothing is forked: the engine runs on threads of this process.

Not here: the routes (`app`), the engine (`policy`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from dew_lib.sampling import Sampling
from dew_lib.serve.guard import ServeOptions, protocol

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def dev_endpoints_for(host: str, dev_endpoints: bool | None) -> bool:
    """Whether to mount the development routes: only when asked for, on any host (None: no)."""
    return bool(dev_endpoints)


def launch_warnings(host: str, dev_endpoints: bool, options: ServeOptions) -> list[str]:
    """What the launcher warns about before it listens: open doors, each in one line."""
    found = []
    if options.api_key is None and not is_loopback(host):
        found.append(f"listening on {host} with no API key: anyone who can reach this port can draw from the "
                     "model; set --api-key (or $DEW_SERVE_API_KEY), or bind 127.0.0.1")
    if dev_endpoints and options.api_key is None:
        where = "any process on this machine" if is_loopback(host) else "anyone who reaches this port"
        found.append(f"the development routes are on with no API key: {where} can pause the server and swap "
                     "its weights")
    if options.trust_request_chat_template:
        found.append("request chat templates are trusted: clients' templates run in a sandboxed process "
                     f"(at most {options.template_timeout:g} s and {options.template_max_chars} characters each)")
    return found


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 takes a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def _config(app, log_level: str, grace: float):
    import uvicorn

    options = getattr(getattr(app, "state", None), "options", ServeOptions())  # create_app's, else the defaults
    # uvicorn annotates timeout_graceful_shutdown as int but only hands it to asyncio.timeout,
    # which takes float seconds
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace,  # type: ignore[arg-type]
                          access_log=False, lifespan="off", http=protocol(options.read_timeout))


def serve(directory: str | Path, *, host: str = "127.0.0.1", port: int = 8000, slots: int = 8,
          capacity: int | None = None, sampling: Sampling = Sampling(), dtype: str = "float32",
          logprobs_mode: str = "raw_logprobs", served_model_name: str | None = None,
          dev_endpoints: bool | None = None, steps: int = 16, seed: int = 0, grace: float = 5.0,
          log_level: str = "info", options: ServeOptions = ServeOptions(),
          tensor_parallel_size: int = 1, lora_modules: Mapping[str, str] | None = None,
          routing: bool = False) -> None:
    """Serve the Hugging Face checkpoint in `directory` over HTTP until SIGTERM or SIGINT.

    slots: requests decoded together. capacity: ids per request, prompt and completion (default:
    the model's max_seq_len, at most 2048). sampling: temperature and filters of every request
    (EOS ids from the checkpoint unless set). dtype: "float32" or "bfloat16". logprobs_mode:
    "raw_logprobs" (the model's log-softmax) or "processed_logprobs" (after temperature and
    filters). served_model_name: the model name clients send (default: the directory's name).
    dev_endpoints: mount the development routes (default no). options: the limits on clients
    (`ServeOptions`). tensor_parallel_size: local devices the model is split across (vLLM's
    `--tensor-parallel-size`). lora_modules: {name: PEFT adapter directory} served over the
    checkpoint, chosen by a request's `model`. routing: a mixture of experts sends each
    completion's routes (vLLM's `--enable-return-routed-experts`). Prints one line with the URL
    once listening.
    """
    import uvicorn

    from dew_lib.serve.adapters import ServedModels
    from dew_lib.serve.app import create_app
    from dew_lib.serve.policy import ServedPolicy

    mounted = dev_endpoints_for(host, dev_endpoints)
    for line in launch_warnings(host, mounted, options):
        print(f"dew serve: warning: {line}", file=sys.stderr, flush=True)
    sock = bind(host, port)  # before loading: a taken port fails fast
    policy = ServedPolicy.load(directory, slots=slots, capacity=capacity, sampling=sampling, dtype=dtype,
                               logprobs_mode=logprobs_mode, served_model_name=served_model_name,
                               steps=steps, seed=seed, tensor_parallel_size=tensor_parallel_size,
                               routing=routing)
    models = ServedModels(policy)
    terminate = signal.getsignal(signal.SIGTERM)
    try:
        policy.warm_up()
        for name, path in (lora_modules or {}).items():
            models.add(name, path)
        server = uvicorn.Server(_config(create_app(models, dev_endpoints=mounted, options=options), log_level, grace))
        shown = f"[{host}]" if ":" in host else host
        mesh = policy.native.server.mesh
        split = f", tensor parallel over {mesh.size} devices" if mesh is not None else ""
        split += f", adapters {', '.join(models.adapters)}" if models.adapters else ""
        print(f"dew serve: {policy.name} on http://{shown}:{sock.getsockname()[1]} ({policy.native.server.slots} "
              f"slots, capacity {policy.capacity}{split}, development routes {'on' if mounted else 'off'}, "
              f"{'API key required' if options.api_key else 'no API key'})", flush=True)
        if threading.current_thread() is threading.main_thread():
            # uvicorn re-raises the SIGTERM it shut down for; exit with status 0 instead of dying by it
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        server.run(sockets=[sock])
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, terminate)
        sock.close()
        models.close()


@contextlib.contextmanager
def running(app, *, host: str = "127.0.0.1", port: int = 0, grace: float = 2.0,
            log_level: str = "warning", timeout: float = 60.0) -> Iterator[str]:
    """Serve `app` with uvicorn on a background thread; yields its base URL ("http://host:port").

    Leaving the block shuts the server down (in-flight requests get `grace` seconds).
    """
    import uvicorn

    sock = bind(host, port)
    server = uvicorn.Server(_config(app, log_level, grace))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dew-serve-http", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=grace + 10)
        sock.close()


__all__ = ["bind", "dev_endpoints_for", "is_loopback", "launch_warnings", "running", "serve"]
