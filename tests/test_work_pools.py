"""The Kubernetes and Docker work pools: the project's Kubernetes job template renders, for a flow
run, a Job the Kubernetes schema accepts (Prefect's own default does not), a real server takes it
as a pool's template, and the project image builds where a Docker engine answers."""

import asyncio
import inspect
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "deployments" / "kubernetes" / "base-job-template.json"
KUBERNETES = ("1.30", "1.33")  # the schema versions the rendered Job is checked against

pytest.importorskip("prefect_kubernetes")
kubernetes_validate = pytest.importorskip("kubernetes_validate")


def rendered(template: dict, **values) -> dict:
    """The Job manifest a Kubernetes worker would submit for a flow run of this template."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    configuration = KubernetesWorkerJobConfiguration.from_template_and_values(template, values)
    if inspect.isawaitable(configuration):  # Prefect answers sync or async depending on the caller
        configuration = asyncio.run(configuration)
    configuration.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="quiet-heron"))
    return configuration.job_manifest


@pytest.fixture(autouse=True)
def api(request):
    """Rendering asks the API for the template's block references: the harness's, not a
    temporary server of Prefect's own."""
    if "tmp_path" not in request.fixturenames:
        request.getfixturevalue("prefect_harness")


def test_the_job_template_renders_a_job_the_kubernetes_schema_accepts():
    template = json.loads(TEMPLATE.read_text())
    job = rendered(template)
    for version in KUBERNETES:
        kubernetes_validate.validate(job, version, strict=True)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "dew:latest"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DEW_REPOSITORY"] == "/opt/dew" and env["DO_NOT_TRACK"] == "1"
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "8Gi"}
    assert container["args"][:3] == ["prefect", "flow-run", "execute"]
    # another image and namespace through the pool's variables, as `prefect deploy --job-variable` gives
    other = rendered(template, image="registry.example/dew:7", namespace="training")
    kubernetes_validate.validate(other, KUBERNETES[-1], strict=True)
    assert other["metadata"]["namespace"] == "training"


def test_prefects_default_template_is_refused_by_the_schema_and_ours_keeps_its_variables():
    """Why the project ships its own: the default puts the Job's completions and parallelism in
    the pod spec. Ours keeps every variable, so the UI form is the same."""
    from prefect_kubernetes.worker import KubernetesWorker

    default = KubernetesWorker.get_default_base_job_template()
    with pytest.raises(kubernetes_validate.ValidationError, match="completions"):
        kubernetes_validate.validate(rendered(default, image="dew:latest"), KUBERNETES[-1], strict=True)
    ours = json.loads(TEMPLATE.read_text())
    assert set(ours["variables"]["properties"]) == set(default["variables"]["properties"])


@pytest.mark.slow
def test_a_prefect_server_takes_the_template_for_a_kubernetes_pool(tmp_path):
    from test_deployments import prefect_server

    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log, prefect_server(tmp_path, log, log_path) as (api, env):
        create = subprocess.run([prefect, "work-pool", "create", "dew-kubernetes", "--type", "kubernetes",
                                 "--base-job-template", str(TEMPLATE)], env=env, cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        assert create.returncode == 0, create.stdout + create.stderr
        shown = subprocess.run([prefect, "work-pool", "inspect", "dew-kubernetes"], env=env, cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        # docs/pipeline.md's deploy line: one deployment of prefect.yaml onto this pool, another image
        deploy = subprocess.run([prefect, "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml",
                                 "--name", "tool-episodes", "--pool", "dew-kubernetes", "--job-variable",
                                 "image=registry.example/dew:7"], env={**env, "DEW_REPOSITORY": str(ROOT)},
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        deployed = subprocess.run([prefect, "deployment", "inspect", "pipeline/tool-episodes"], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=120).stdout
    assert "kubernetes" in shown.stdout and "dew:latest" in shown.stdout
    assert "'work_pool_name': 'dew-kubernetes'" in deployed and "registry.example/dew:7" in deployed


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not docker_answers(), reason="no Docker engine answers here (`docker info`); the "
                    "image builds where one does")
def test_the_project_image_builds_and_imports_the_flows():
    tag = f"dew-test:{uuid.uuid4().hex[:8]}"
    try:
        subprocess.run(["docker", "build", "-f", "deployments/Dockerfile", "-t", tag, "."], cwd=ROOT, check=True,
                       timeout=1800)
        probe = subprocess.run(["docker", "run", "--rm", tag, "python", "-c",
                                "import dew_lib, flows.pipeline, prefect_kubernetes; print('ok')"],
                               capture_output=True, text=True, timeout=600)
        assert probe.stdout.strip().endswith("ok"), probe.stderr
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
