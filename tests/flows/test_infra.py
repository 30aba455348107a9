"""The deployment files and the h100 Kubernetes job template, validated as far as a CPU allows:
against prefect-kubernetes' own job configuration, and against each other."""

from __future__ import annotations

import asyncio
import re
import uuid
from pathlib import Path

import pytest
import yaml
from prefect.client.schemas.objects import FlowRun
from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

from flywheel.flows.infra import h100_job_template
from flywheel.flows.stages import STAGES

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT_FILES = [ROOT / "prefect.yaml", ROOT / "deploy" / "prefect-cluster.yaml"]


def job_manifest(values: dict) -> dict:
    """The Kubernetes Job the worker would submit for a flow run with these job variables."""
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(h100_job_template(), values))
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="sft-r2"))
    return config.job_manifest


def test_h100_job_template_gives_gpus_node_selector_tolerations_shm_and_cache() -> None:
    manifest = job_manifest({"image": "registry.example/flywheel:gpu", "gpu_count": 4})
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example/flywheel:gpu"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "flywheel-model-cache"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/dev/shm": "dshm", "/cache": "model-cache"}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["FLYWHEEL_CACHE"] == "/cache" and env["HF_HUB_OFFLINE"] == "1"
    assert env["FLYWHEEL_REQUIRE_ISOLATION"] == "1"  # A pod without bubblewrap refuses agent commands.


def test_h100_job_template_rejects_a_job_that_kubernetes_workers_cannot_run() -> None:
    template = h100_job_template()
    del template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["restartPolicy"]
    with pytest.raises(ValueError, match="restartPolicy"):
        asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, {}))


def test_every_placeholder_in_the_template_is_a_declared_variable() -> None:
    """Pools accept unknown job variables silently, so the template must declare every one it uses."""
    template = h100_job_template()
    used = set(re.findall(r"{{\s*(\w+)\s*}}", str(template["job_configuration"])))
    assert used <= set(template["variables"]["properties"])


@pytest.mark.parametrize("path", DEPLOYMENT_FILES, ids=lambda p: p.name)
def test_deployment_files_deploy_every_stage_on_its_pool(path: Path) -> None:
    spec = yaml.safe_load(path.read_text())
    deployments = {(d["entrypoint"].rsplit(":", 1)[1], d["name"]): d for d in spec["deployments"]}
    stages = [d for d in spec["deployments"] if d["name"] == "stage"]
    listed = [(d["entrypoint"], d["work_pool"]["name"], "gpu" in d["tags"]) for d in stages]
    record = [(f"flywheel.flows.stages:{s.flow.fn.__name__}", s.pool, s.gpu) for s in STAGES.values()]
    assert listed == record, "the stage deployments must follow flows/stages.py's STAGES, in order"
    full = deployments[("flywheel", "full")]
    assert full["concurrency_limit"] == 1 and full["parameters"]["dispatch"] == "deployments"
    assert [s["active"] for s in full["schedules"]] == [False]  # A cron schedule, off by default.
    assert ("eval_only", "only") in deployments
    assert any("set_working_directory" in next(iter(step)) for step in spec["pull"])
    declared = set(h100_job_template()["variables"]["properties"])
    for deployment in spec["deployments"]:
        if deployment["work_pool"]["name"] == "h100":
            assert set(deployment["work_pool"].get("job_variables", {})) <= declared, deployment["entrypoint"]


def test_both_deployment_files_define_the_same_deployments() -> None:
    local, cluster = (yaml.safe_load(path.read_text())["deployments"] for path in DEPLOYMENT_FILES)
    assert [(d["entrypoint"], d["name"]) for d in local] == [(d["entrypoint"], d["name"]) for d in cluster]


def test_the_cluster_sft_deployment_renders_a_valid_eight_gpu_job() -> None:
    """The job variables the cluster file gives the SFT stage, through the real worker configuration."""
    spec = yaml.safe_load(DEPLOYMENT_FILES[1].read_text())
    sft = next(d for d in spec["deployments"] if d["entrypoint"].endswith(":sft"))
    values = {**sft["work_pool"]["job_variables"], "image": "registry.example/flywheel:gpu"}
    container = job_manifest(values)["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"] for e in container["env"]}
    assert {"FLYWHEEL_CACHE", "HF_HUB_OFFLINE", "FLYWHEEL_STORE", "PREFECT_LOGGING_EXTRA_LOGGERS"} <= env
    assert "FLYWHEEL_REQUIRE_ISOLATION" in env
