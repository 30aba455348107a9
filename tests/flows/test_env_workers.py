"""The RL stage's side of deployed env workers against a real Prefect server: a workers' run that ends
is the trainer's reason to stop, and one never picked up is cancelled, not left scheduled.
(The whole path, a deployed RL stage with its workers on the `cpu` pool, is in test_deployments.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Completed, Failed

from flywheel.flows.env_workers import DeployedWorkers
from flywheel.flows.round_config import load_round_config
from flywheel.training.grpo import GRPORunConfig
from flywheel.training.worker_handoff import HandOff, relaying


@flow(name="env-workers-stand-in")
def _workers() -> None:
    """Never run: its flow runs only carry states."""


@pytest.fixture
def api(prefect_server: dict[str, str]) -> Iterator[None]:
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        yield


def _launched(cfg: GRPORunConfig) -> DeployedWorkers:
    """A `DeployedWorkers` whose run is a fresh (scheduled) flow run on the server."""
    workers = DeployedWorkers(cfg, store_url=None, poll=0)
    with get_client(sync_client=True) as client:
        workers.flow_run = client.create_flow_run(_workers, name="env-workers-test")
    return workers


def _config() -> GRPORunConfig:
    overrides = ["rl.rl_mode=atropos", "rl.env_workers_deployment=env-workers/atropos"]
    return load_round_config("tiny", overrides=overrides).rl_run_config(policy_model="tiny", output_name="rl-r1")


def _set(workers: DeployedWorkers, state) -> None:  # type: ignore[no-untyped-def]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(workers.flow_run.id, state, force=True)


def test_a_workers_run_that_ends_is_the_trainers_reason_to_stop(api: None) -> None:
    workers = _launched(_config())
    assert workers.problem() is None
    _set(workers, Failed(message="every env worker died"))
    assert workers.problem() == "the env workers' flow run env-workers-test ended Failed: see its logs"
    workers.stop(timeout=5)  # Already over: nothing to cancel.
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(workers.flow_run.id).state.name == "Failed"


def test_a_workers_run_never_picked_up_is_cancelled(api: None) -> None:
    workers = _launched(_config())
    workers.stop(timeout=30)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(workers.flow_run.id).state.type.value in ("CANCELLING", "CANCELLED")


def test_a_workers_run_that_completes_is_waited_for(api: None) -> None:
    workers = _launched(_config())
    _set(workers, Completed())
    workers.stop(timeout=5)
    assert workers.problem() is not None  # Over, whatever its state: no group can come from it.


def test_a_launched_trainers_workers_are_a_sub_run_of_the_stage_that_launched_it(api: None, tmp_path: Path) -> None:
    """The GPU path: the trainer is an `accelerate launch` child without Prefect; the stage's relay starts the
    workers' deployment run with the URLs the trainer handed back, linked under the stage's own run, and
    cancels it when the trainer is done (here it is never picked up)."""
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(_workers)
        client.create_deployment(flow_id=flow_id, name="relay")
    cfg = _config().model_copy(update={"env_workers_deployment": "env-workers-stand-in/relay"})
    workers = DeployedWorkers(cfg, store_url=None, poll=0)

    @flow(name="rl-stage-stand-in")
    def stage() -> str:
        with relaying(workers, tmp_path, poll=0.05):
            HandOff(tmp_path).start("http://trainer:1", "http://trainer:2")  # What the launched trainer writes.
            for _ in range(200):
                if workers.flow_run is not None:
                    break
                time.sleep(0.05)
        return str(workers.flow_run.id)

    with get_client(sync_client=True) as client:
        sub_run = client.read_flow_run(stage())
        assert sub_run.parameters["params"]["policy_url"] == "http://trainer:2"
        assert sub_run.parent_task_run_id is not None  # A sub-run of the stage's flow run.
        assert client.read_task_run(sub_run.parent_task_run_id).flow_run_id is not None
        assert sub_run.state.type.value in ("CANCELLING", "CANCELLED")


def test_env_workers_deployment_needs_atropos_mode() -> None:
    from flywheel.training.config import ConfigError

    with pytest.raises(ConfigError, match="env_workers_deployment places atropos mode's env workers"):
        load_round_config("tiny", overrides=["rl.env_workers_deployment=env-workers/atropos"])
