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


@pytest.mark.slow
def test_a_run_started_through_the_api_completes_and_lands_in_the_store(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_RUNNER_POLL_FREQUENCY": "2",
           "PYTHONPATH": ROOT, "DEW_RETRAIN_CRON": "0 3 1 1 *"}
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    log_path = tmp_path / "services.log"
    with open(log_path, "w") as log, \
            started([prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log):
        # serve.py gives up if the API does not answer yet, so it starts once the server does
        wait_for(lambda: urllib.request.urlopen(f"{api}/health", timeout=2).status == 200, 300,
                 "the server answering", log_path)
        with started([sys.executable, os.path.join(ROOT, "deployments", "serve.py")], env, log):
            os.environ["PREFECT_API_URL"] = api
            try:
                from prefect.client.orchestration import get_client

                async def deployment_id():
                    async with get_client() as client:
                        return (await client.read_deployment_by_name("pipeline/pipeline")).id

                async def start_run(deployment):
                    async with get_client() as client:
                        run = await client.create_flow_run_from_deployment(
                            deployment, parameters={"params": {**TINY, "root": str(tmp_path / "runs")}})
                        return run.id

                async def state_of(run):
                    async with get_client() as client:
                        return (await client.read_flow_run(run)).state

                deployment = wait_for(lambda: asyncio.run(deployment_id()), 300, "registering the deployments",
                                      log_path)
                async def image_deployment():
                    async with get_client() as client:
                        return await client.read_deployment_by_name("flow_grpo_pipeline/flow-grpo")

                assert asyncio.run(image_deployment()).entrypoint.endswith("flow_grpo.py:flow_grpo_pipeline")
                run = asyncio.run(start_run(deployment))
                state = wait_for(lambda: (s := asyncio.run(state_of(run))) and s.is_final() and s, 900,
                                 "finishing the flow run", log_path)
                assert state.is_completed(), state
            finally:
                os.environ.pop("PREFECT_API_URL", None)
    store = Store(str(tmp_path / "runs"))
    _, rows = store.rows("SELECT status FROM runs")
    assert rows == [("completed",)]
    _, stages = store.rows("SELECT stage, status FROM stages ORDER BY stage")
    assert dict(stages)["grpo"] == "completed" and len(stages) == 7
