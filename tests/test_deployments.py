"""The deployments against a real Prefect server: registered by deployments/serve.py, a run started
through the API as the UI starts one, and its results found in the run store.

Everything these tests start (the module's one server, each test's serving process or worker and
their flow-run subprocesses) runs in its own process group and is killed when its test (the
server: the module) ends, also when it fails.
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
def prefect_server(home, log, log_path):
    """A real server on a free port that answers; another port is tried if one is taken first."""
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    for _ in range(3):
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api,
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(API URL, environment) of one server for the module's tests (starting one costs about 12 s
    of CPU). Each test's serving process or worker logs to the test's own services.log."""
    where = tmp_path_factory.mktemp("prefect-server")
    log_path = where / "server.log"
    with open(log_path, "w") as log, prefect_server(where / "home", log, log_path) as served:
        yield served


@pytest.mark.slow
def test_a_run_started_through_the_api_completes_and_lands_in_the_store(server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    log_path = tmp_path / "services.log"
    # serve.py gives up when the API does not answer, so it starts once the server does
    api, env = server
    with open(log_path, "w") as log, \
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

        # served, not only registered: another test of the module may have deployed the same names
        wait_for(lambda: "deployments are being served" in log_path.read_text(), 300,
                 "serving the deployments", log_path)
        pipeline = wait_for(lambda: asyncio.run(deployment("pipeline/pipeline")), 300,
                            "registering the deployments", log_path)
        images = wait_for(lambda: asyncio.run(deployment("flow_grpo_pipeline/flow-grpo")), 120,
                          "registering the image deployment", log_path)
        assert images.entrypoint.endswith("flow_grpo.py:flow_grpo_pipeline")
        tools = wait_for(lambda: asyncio.run(deployment("pipeline/tool-episodes")), 120,
                         "registering the tool-episodes deployment", log_path)
        assert tools.parameters["params"]["data"] == {"source": "tools"}
        run = asyncio.run(start_run(pipeline.id))
        state = wait_for(lambda: (s := asyncio.run(state_of(run))) and s.is_final() and s, 900,
                         "finishing the flow run", log_path)
        assert state.is_completed(), state
    store = Store(str(tmp_path / "runs"))
    _, rows = store.rows("SELECT status FROM runs")
    assert rows == [("completed",)]
    _, stages = store.rows("SELECT stage, status FROM stages ORDER BY stage")
    assert dict(stages)["grpo"] == "completed" and len(stages) == 7


def living_descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every living descendant of `pid`, from /proc."""
    def stat(p):
        try:
            with open(f"/proc/{p}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            return int(fields[1]), fields[0], fields[19]
        except OSError:
            return None

    table = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := stat(p)) and s[1] != "Z"}
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [(child, s[2]) for child, s in table.items() if s[0] == parent]
        found += children
        frontier += [child for child, _ in children]
    return found


def still_alive(processes) -> list:
    def started_at(pid):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            return None if fields[0] == "Z" else fields[19]
        except OSError:
            return None
    return [(pid, start) for pid, start in processes if started_at(pid) == start]


@pytest.mark.slow
def test_a_flow_run_ends_when_the_serving_process_is_killed(server, tmp_path):
    """serve.py's runner starts each flow run as a child; killed with SIGKILL, serve.py takes the
    flow run with it (tasks/lifetimes.py exit_with_marked_parent). The stage logs nothing after
    its start, so no write to a closed stream ends it instead."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    log_path = tmp_path / "services.log"
    long = {**TINY, "sft": {**TINY["sft"], "steps": 100_000, "log_every": 100_000,
                            "checkpoint_every": 100_000}}
    flow_runs = []
    api, env = server
    with open(log_path, "w") as log, \
            started([sys.executable, os.path.join(ROOT, "deployments", "serve.py")], env, log) as served, \
            temporary_settings(updates={PREFECT_API_URL: api}):

        async def start_run():
            async with get_client() as client:
                deployment = await client.read_deployment_by_name("pipeline/pipeline")
                run = await client.create_flow_run_from_deployment(
                    deployment.id, parameters={"params": {**long, "root": str(tmp_path / "runs")}})
                return run.id

        wait_for(lambda: "deployments are being served" in log_path.read_text(), 300,
                 "serving the deployments", log_path)
        asyncio.run(start_run())
        try:
            # the flow run is a child of serve.py that has got as far as training
            wait_for(lambda: "for flow 'sft'" in log_path.read_text(), 600, "the flow run training", log_path)
            time.sleep(3)
            flow_runs = living_descendants(served.pid)
            assert flow_runs
            served.kill()
            served.wait(timeout=30)
            deadline = time.monotonic() + 40
            while still_alive(flow_runs) and time.monotonic() < deadline:
                time.sleep(0.5)
            with open(log_path) as handle:
                tail = handle.read()[-3000:]
            assert not still_alive(flow_runs), f"the flow run outlived serve.py: {flow_runs}\n{tail}"
        finally:
            for pid, _ in still_alive(flow_runs):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_prefect_yaml_deploys_to_a_process_work_pool_whose_worker_runs_the_pipeline(server, tmp_path):
    """What docs/pipeline.md tells a team to do: create the process pool, `prefect deploy` the
    deployments of prefect.yaml, start a worker; a run started through the API completes, in
    the store and with its artifacts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.ui import artifact_key

    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    log_path = tmp_path / "services.log"
    api, env = server
    env = {**env, "DEW_REPOSITORY": ROOT, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    with open(log_path, "w") as log:
        for command in (["work-pool", "create", "dew", "--type", "process"],
                        ["--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"]):
            subprocess.run([prefect, *command], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                           check=True, timeout=300)
        with started([prefect, "worker", "start", "--pool", "dew"], env, log), \
                temporary_settings(updates={PREFECT_API_URL: api}):

            async def start_run():
                async with get_client() as client:
                    deployment = await client.read_deployment_by_name("pipeline/pipeline")
                    assert deployment.work_pool_name == "dew"
                    # SFT alone: the run through serve.py above trains every stage
                    params = {**TINY, "stages": ["sft"], "root": str(tmp_path / "runs")}
                    run = await client.create_flow_run_from_deployment(deployment.id, parameters={"params": params})
                    return run.id

            async def state_of(run):
                async with get_client() as client:
                    return (await client.read_flow_run(run)).state

            run = asyncio.run(start_run())
            state = wait_for(lambda: (s := asyncio.run(state_of(run))) and s.is_final() and s, 900,
                             "the worker finishing the flow run", log_path)
            assert state.is_completed(), state
            (stored,) = Store(str(tmp_path / "runs")).rows("SELECT run, status FROM runs")[1]
            assert stored[1] == "completed"

            async def artifacts():
                async with get_client() as client:
                    keys = [artifact_key(stored[0], name) for name in ("accuracy", "summary")]
                    return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))

            want = {artifact_key(stored[0], n) for n in ("accuracy", "summary")}
            assert {a.key for a in asyncio.run(artifacts())} == want


def test_prefect_yaml_declares_the_deployments_serve_py_serves():
    """One set of deployments, two ways to run them: names, flows, schedules and parameters agree."""
    import yaml

    sys.path.insert(0, os.path.join(ROOT, "deployments"))
    try:
        import serve
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "deployments", "prefect.yaml")) as handle:
        declared = {d["name"]: d for d in yaml.safe_load(handle)["deployments"]}
    served = {d.name: d for d in serve.deployments()}
    assert set(declared) == set(served)
    for name, deployment in served.items():
        entry = declared[name]
        assert entry["entrypoint"].split(":")[1] == deployment.entrypoint.split(":")[1], name
        assert entry.get("parameters", {}) == deployment.parameters, name
        crons = [s["cron"] for s in entry.get("schedules", [])]
        assert crons == [s.schedule.cron for s in deployment.schedules], name
    from tasks.params import PipelineParams

    tools = PipelineParams(**serve.TOOL_EPISODES["params"])
    assert tools.data.source == "tools" and tools.stages == ("sft", "grpo")
