"""The deployments against a real Prefect server: registered by deployments/serve.py, a run started
through the API as the UI starts one, and its results found in the run store.

Everything this test starts (server, serving process, flow-run subprocesses) runs in its own
process group and is killed at the end, also when the test fails.
"""

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from dew_lib.store import Store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "data": {"train_problems": 400, "test_problems": 20},
    "model": {"emb_features": 32, "num_layers": 1, "num_heads": 2, "mlp_features": 64},
    "sft": {"steps": 2, "batch": 4, "log_every": 1, "checkpoint_every": 2},
    "dpo": {"steps": 1, "batch": 4, "log_every": 1, "checkpoint_every": 1},
    "grpo": {"steps": 1, "batch": 2, "log_every": 1, "checkpoint_every": 1, "max_new_tokens": 8},
    "evaluation": {"batch": 20, "max_new_tokens": 8},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def started(command, env, log):
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def wait_for(predicate, seconds, what, log_path):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception:  # noqa: BLE001 - the server may not answer yet
            pass
        time.sleep(1)
    with open(log_path) as handle:
        tail = handle.read()[-3000:]
    raise TimeoutError(f"{what} did not happen within {seconds} s; log:\n{tail}")


def healthy(api: str) -> bool:
    with urllib.request.urlopen(f"{api}/health", timeout=2) as reply:
        return reply.status == 200


@contextlib.contextmanager
def prefect_server(tmp_path, log, log_path):
    """A real server on a free port that answers; another port is tried if one is taken first."""
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    for _ in range(3):
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_RUNNER_POLL_FREQUENCY": "2",
               "PYTHONPATH": ROOT, "DEW_RETRAIN_CRON": "0 3 1 1 *"}
        with started([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env,
                     log) as server:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and server.poll() is None:
                with contextlib.suppress(OSError):
                    if healthy(api):
                        yield api, env
                        return
                time.sleep(1)
    wait_for(lambda: False, 0, "starting the Prefect server", log_path)


@pytest.mark.slow
def test_a_run_started_through_the_api_completes_and_lands_in_the_store(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    log_path = tmp_path / "services.log"
    # serve.py gives up when the API does not answer, so it starts once the server does
    with open(log_path, "w") as log, prefect_server(tmp_path, log, log_path) as (api, env), \
            started([sys.executable, os.path.join(ROOT, "deployments", "serve.py")], env, log), \
            temporary_settings(updates={PREFECT_API_URL: api}):
        # settings, not os.environ: Prefect reads the environment once, when it is first imported

        async def deployment(name):
            async with get_client() as client:
                return await client.read_deployment_by_name(name)

        async def start_run(deployment):
            async with get_client() as client:
                run = await client.create_flow_run_from_deployment(
                    deployment, parameters={"params": {**TINY, "root": str(tmp_path / "runs")}})
                return run.id

        async def state_of(run):
            async with get_client() as client:
                return (await client.read_flow_run(run)).state

        pipeline = wait_for(lambda: asyncio.run(deployment("pipeline/pipeline")), 300,
                            "registering the deployments", log_path)
        images = asyncio.run(deployment("flow_grpo_pipeline/flow-grpo"))
        assert images.entrypoint.endswith("flow_grpo.py:flow_grpo_pipeline")
        run = asyncio.run(start_run(pipeline.id))
        state = wait_for(lambda: (s := asyncio.run(state_of(run))) and s.is_final() and s, 900,
                         "finishing the flow run", log_path)
        assert state.is_completed(), state
    store = Store(str(tmp_path / "runs"))
    _, rows = store.rows("SELECT status FROM runs")
    assert rows == [("completed",)]
    _, stages = store.rows("SELECT stage, status FROM stages ORDER BY stage")
    assert dict(stages)["grpo"] == "completed" and len(stages) == 7
