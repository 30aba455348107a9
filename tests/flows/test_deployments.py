"""The flywheel through real deployments: a local Prefect server, process workers on pools `cpu`
and `h100`, `prefect deploy --all` from prefect.yaml, and an S3 store on a moto server."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from flywheel.data import ArtifactStore, lineage
from flywheel.flows.local_server import prefect_bin, workers
from flywheel.flows.round_config import load_round_config
from flywheel.flows.stages import STAGES
from tests.conftest import TEST_BUCKET
from tests.flows.conftest import flow_runs
from tests.flows.test_cli import FLYWHEEL

ROOT = Path(__file__).resolve().parents[2]
ROUND_OVERRIDES = [
    "data.runner=dask", "data.shard_groups=2", "data.workers=2", "rl.rl_mode=atropos",
    "rl.env_workers_deployment=env-workers/atropos", "rl.serve_host=0.0.0.0", "rl.drop_flat_groups=false",
]  # fmt: skip
STAGE_RUNS = {f"{stage}-r1" for stage in STAGES} | {"evaluate-r0", "lm_eval-r0", "gate-r0", "mine-r0"}


class _Alerts(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Alerts.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def alerts() -> Iterator[str]:
    """A webhook receiver on loopback: the failure automation's target."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Alerts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/alert"
    server.shutdown()


@pytest.fixture(scope="module")
def deployed(prefect_server: dict[str, str], s3_endpoint: str, alerts: str, tmp_path_factory) -> Iterator[dict]:
    """Pools, limit and alert set up; workers running; every deployment in prefect.yaml deployed."""
    logs = tmp_path_factory.mktemp("workers")
    aws = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    env = {
        **prefect_server,
        **aws,
        "AWS_ENDPOINT_URL": s3_endpoint,
        "FLYWHEEL_ROOT": str(ROOT),
        "FLYWHEEL_CACHE": str(tmp_path_factory.mktemp("cache")),
    }
    setup = subprocess.run(
        [FLYWHEEL, "infra", "setup", "--gpu-slots", "1", "--alert-url", alerts], env=env, capture_output=True, text=True
    )
    assert setup.returncode == 0, setup.stderr
    assert "work pool h100 (process)" in setup.stdout and "gpu = 1" in setup.stdout
    assert "flywheel-crash-unresponsive: no heartbeat for 540 s -> Crashed" in setup.stdout
    with workers(["cpu", "h100"], env, logs):
        deploy = subprocess.run(
            [prefect_bin(), "--no-prompt", "deploy", "--all"], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        yield {"env": env, "store_url": f"s3://{TEST_BUCKET}/deployed-round", "logs": logs}


def deployment_run(env: dict[str, str], name: str, **params: str) -> subprocess.CompletedProcess[str]:
    args = [arg for key, value in params.items() for arg in ("--param", f"{key}={value}")]
    command = [prefect_bin(), "deployment", "run", name, *args, "--watch", "--watch-timeout", "800"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)


@pytest.fixture(scope="module")
def full_round(deployed: dict) -> dict:
    """`prefect deployment run flywheel/full` (tiny profile) to completion, its generation and curation
    in shards of 2 groups on a local Dask cluster (`data.runner: dask`), its RL stage in atropos mode
    with the env workers a sub-run on the `cpu` pool (run-api and the policy endpoint on every
    interface, reached by this machine's name)."""
    env = deployed["env"]
    config = load_round_config("tiny", overrides=ROUND_OVERRIDES)
    result = deployment_run(
        env, "flywheel/full", profile="tiny", store_url=deployed["store_url"], config=config.model_dump_json()
    )
    worker_logs = "".join(p.read_text()[-3000:] for p in deployed["logs"].glob("*.log"))
    assert result.returncode == 0, result.stdout[-3000:] + worker_logs
    return deployed


def test_every_stage_runs_completed_on_its_pool(full_round: dict) -> None:
    env = full_round["env"]
    parent = next(run for run in flow_runs(env, name={"any_": ["flywheel-tiny"]}) if run["deployment_id"])
    assert parent["state_type"] == "COMPLETED" and parent["work_pool_name"] == "cpu"
    # This round's stage runs only: another test's local round on the session's server has the same run names.
    runs = {run["name"]: run for run in flow_runs(env, parent_flow_run_id={"any_": [parent["id"]]})}
    assert set(runs) >= STAGE_RUNS
    for name in STAGE_RUNS:
        run = runs[name]
        assert run["state_type"] == "COMPLETED", (name, run["state"])
        assert run["deployment_id"], f"{name} did not run through its deployment"
        stage = name.rsplit("-r", 1)[0]
        assert run["work_pool_name"] == STAGES[stage].pool, name
        assert {"flywheel", f"stage-{stage}"} <= set(run["tags"])


def test_every_artifact_and_its_lineage_is_in_the_s3_store(full_round: dict) -> None:
    store = ArtifactStore(full_round["store_url"])
    kinds = {m.kind for m in store.list()}
    assert {"model", "rollouts", "dataset", "checkpoint", "eval", "gate", "weaknesses", "report"} <= kinds
    walked = {(m.kind, m.name) for m in lineage(store, "report/report-r1").walk()}
    assert {("checkpoint", "rl-r1"), ("checkpoint", "sft-r1"), ("dataset", "sft-r1"), ("model", "tiny")} <= walked
    assert ("rollouts", "rollouts-r1") in walked
    rollouts = store.manifest("rollouts/rollouts-r1")
    screened = {name for kind, name in walked if kind == "candidates"}
    assert len(rollouts.params["shards"]) == 2  # 4 groups: 2 + 2.
    parts = {f"tool_use_chain-teacher-0000{n}" for n in range(2)}  # A shard each.
    assert screened == {f"sft-r1-screened-rollouts-r1-{part}" for part in parts}
    assert store.verify() == []
    assert store.fs.exists(f"{store.root}/prefect-results")  # The stage cache lives with the artifacts.


def test_eval_only_evaluates_the_champion(full_round: dict) -> None:
    env, store_url = full_round["env"], full_round["store_url"]
    result = deployment_run(env, "eval/only", model="champion", profile="tiny", store_url=store_url)
    assert result.returncode == 0, result.stdout[-3000:]
    store = ArtifactStore(store_url)
    manifest = store.manifest("eval/eval-champion")
    assert store.resolve("champion") in manifest.parents
    assert store.resolve("champion") in store.manifest("eval/lm-eval-champion").parents  # Both evaluations ran.
    run = next(r for r in flow_runs(env) if r["name"] == "eval-champion")
    assert run["work_pool_name"] == "h100" and run["state_type"] == "COMPLETED"


def test_a_failed_run_fails_clearly_and_fires_the_alert(deployed: dict, alerts: str) -> None:
    env = deployed["env"]
    result = deployment_run(env, "eval/only", model="no-such-model", profile="tiny", store_url=deployed["store_url"])
    assert result.returncode != 0
    assert "Failed" in result.stdout
    deadline = time.monotonic() + 90
    while not any("eval-no-such-model" in alert["text"] for alert in _Alerts.received):
        assert time.monotonic() < deadline, f"no alert; received {_Alerts.received}"
        time.sleep(1)
    alert = next(a for a in _Alerts.received if "eval-no-such-model" in a["text"])
    assert "Failed" in alert["text"]


def test_the_rl_stages_env_workers_ran_as_its_sub_run_on_the_cpu_pool(full_round: dict) -> None:
    """The trainer on `h100` kept run-api and the policy endpoint; its env workers ran on `cpu` as a
    sub-run of the RL stage, and that run ended by itself when training was done."""
    env = full_round["env"]
    trainer = next(run for run in flow_runs(env, name={"any_": ["rl-r1"]}) if run["deployment_id"])
    assert trainer["work_pool_name"] == "h100" and trainer["state_type"] == "COMPLETED"
    sub_runs = flow_runs(env, parent_flow_run_id={"any_": [trainer["id"]]})
    workers = next(run for run in sub_runs if run["name"] == "env-workers-rl-r1")
    assert workers["work_pool_name"] == "cpu" and workers["state_type"] == "COMPLETED", workers["state"]
    atropos = ArtifactStore(full_round["store_url"]).manifest("checkpoint/rl-r1").metrics["atropos"]
    assert atropos["groups_trained"] > 0 and atropos["endpoint_replies"] > 0
