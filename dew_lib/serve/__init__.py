"""`dew serve`: a checkpoint served over vLLM's OpenAI-compatible HTTP API by Dew's native server.

`serve(directory, host=, port=, slots=, capacity=, sampling=, dtype=, logprobs_mode=, options=)`
runs the server until SIGTERM; `create_app(ServedPolicy.load(directory, ...), options=)` builds
the same app for use in-process (`running(app)` serves it on a thread). The routes are the subset
of vLLM's API that Dew's remote clients use, plus the development routes a SafetensorsReload push
calls; `ServeOptions` holds the limits on clients (API key, sizes, timeouts, request chat
templates). `ServedModels` serves PEFT adapters over the checkpoint, each chosen by a request's
`model`. See docs/serve.md.

Not here: the engine (`dew_lib.inference`), the remote clients that call these routes.
"""

from dew_lib.serve.adapters import ServedModels
from dew_lib.serve.app import check_sampling, create_app
from dew_lib.serve.guard import ServeOptions
from dew_lib.serve.launch import dev_endpoints_for, is_loopback, running, serve
from dew_lib.serve.policy import ReloadError, ServedPolicy, checkpoint_eos
from dew_lib.serve.protocol import ServeError

__all__ = ["ReloadError", "ServeError", "ServeOptions", "ServedModels", "ServedPolicy", "check_sampling",
           "checkpoint_eos", "create_app", "dev_endpoints_for", "is_loopback", "running", "serve"]
