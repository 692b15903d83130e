"""Every process the project starts ends with the process that started it, however that ends.

- `bound_child` starts a child in its own process group with the parent-death signal
  (Linux `prctl(PR_SET_PDEATHSIG)`): the kernel sends it SIGTERM when its parent dies, even by
  SIGKILL. `stop` ends the child's whole group: SIGTERM, then SIGKILL after a grace period.
- `exit_with_parent` is a thread that polls the parent's pid and terminates this process
  (SIGTERM, then SIGKILL) when the parent is gone: for processes someone else starts, and as a
  bound on a child's graceful shutdown. A parent marks its children's environment
  (`children_exit_with_me`) and a marked child arms the thread (`exit_with_marked_parent`):
  deployments/ui.py marks serve.py, and serve.py the flow runs Prefect's runner starts from it,
  which arm it when they import tasks/ui.py, as every flow of the project does.
- `temporary_prefect_server` replaces the temporary API that Prefect would start by itself
  (`SubprocessASGIServer`, which outlives a parent killed with SIGKILL) with the same server
  started as a bound child, and points `PREFECT_API_URL` at it.
- `quiet_prefect` turns Prefect's telemetry off: its server's heartbeat (which logs
  `Failed to send telemetry` every 10 minutes offline) and the SDK's analytics.

Nothing here imports Prefect at module level, so an entry point can use it before Prefect starts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from dew_lib.children import die_with_parent, free_port

EXIT_WITH = "DEW_EXIT_WITH"  # in a child's environment: the pid of the parent it ends with
TELEMETRY_OFF = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}

def quiet_prefect(env: dict | None = None) -> dict:
    """Prefect's telemetry off in `env` (default: this process's environment, before Prefect is
    imported), unless the user set the variables."""
    env = os.environ if env is None else env
    for name, value in TELEMETRY_OFF.items():
        env.setdefault(name, value)
    return env


def bound_child(command: list[str], *, signal_number: int = signal.SIGTERM, **popen) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen)` in a new process group, with the parent-death signal."""
    return subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_parent(signal_number),
                            **popen)


def _signal_group(process: subprocess.Popen, signal_number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal_number)


def stop(process: subprocess.Popen | None, grace: float = 10) -> int | None:
    """End `process` and its process group: SIGTERM, then SIGKILL after `grace` seconds; what the
    group still holds once the process is gone gets SIGKILL."""
    if process is None:
        return None
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace)
    _signal_group(process, signal.SIGKILL)
    return process.returncode


def terminate_raises() -> None:
    """SIGTERM raises SystemExit in the main thread, so `finally` blocks stop the children."""
    def handler(signal_number, frame):
        raise SystemExit(128 + signal_number)

    signal.signal(signal.SIGTERM, handler)


def exit_with_parent(parent: int | None = None, *, interval: float = 0.5,
                     grace: float = 15) -> threading.Thread:
    """A daemon thread that sends this process SIGTERM when `parent` (default: the current parent)
    is no longer its parent, and ends it with SIGKILL `grace` seconds later if it still runs."""
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os.kill(os.getpid(), signal.SIGKILL)

    watcher = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    watcher.start()
    return watcher


def children_exit_with_me(env: dict | None = None) -> dict:
    """Mark `env` (default: this process's environment): a child started with it that calls
    `exit_with_marked_parent` ends when this process does."""
    env = os.environ if env is None else env
    env[EXIT_WITH] = str(os.getpid())
    return env


def exit_with_marked_parent() -> threading.Thread | None:
    """In a child of a process that marked its environment, `exit_with_parent` on that process
    (at once when it is already gone); elsewhere nothing. The mark is taken out of this
    process's environment, so what it starts in turn is not taken for such a child."""
    value = os.environ.get(EXIT_WITH)
    if not value or value == str(os.getpid()):  # unmarked, or the marking process itself
        return None
    del os.environ[EXIT_WITH]
    if os.getppid() != int(value):
        os.kill(os.getpid(), signal.SIGTERM)
    return exit_with_parent(int(value))


def healthy(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def wait_until_healthy(api: str, process: subprocess.Popen, seconds: float,
                       what: str = "the Prefect server") -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        if healthy(api):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer at {api} within {seconds:.0f} s")


def temporary_prefect_server(attempts: int = 3) -> subprocess.Popen | None:
    """Start Prefect's temporary API as a bound child when Prefect would start its own, and point
    this process (and what it starts) at it; None when an API is configured or ephemeral mode is
    off. The server stops at exit, after Prefect's own exit handlers have sent their logs."""
    import prefect
    from prefect.context import refresh_global_settings_context
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return None
    env = {**os.environ, **settings.to_environment_variables(exclude_unset=True),
           # what Prefect's SubprocessASGIServer sets: the API without the UI
           "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    quiet_prefect(env)
    for attempt in range(attempts):
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        server = bound_child(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on", "--timeout-graceful-shutdown", "5"], env=env)
        try:
            wait_until_healthy(api, server, settings.server.ephemeral.startup_timeout_seconds,
                               "the temporary Prefect server")
        except RuntimeError:  # the port was taken in between: another one
            stop(server)
            if attempt + 1 == attempts:
                raise
            continue
        except BaseException:
            stop(server)
            raise
        break
    print(f"Prefect API for this run at {api} (pid {server.pid}; it stops with this process)",
          file=sys.stderr, flush=True)
    atexit.register(stop, server)  # registered before Prefect's handlers, so it runs after them
    os.environ["PREFECT_API_URL"] = api
    os.environ.setdefault("PREFECT_UI_URL", "")  # it serves no UI: no "View at" links to it
    refresh_global_settings_context()
    return server
