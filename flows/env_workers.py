"""The env workers of an atropos-mode RL stage as a flow of their own, on the `cpu` pool.

With `rl.env_workers_deployment` set, the RL stage (on `h100`) keeps `run-api` and the policy
endpoint, and starts a run of that deployment (`env-workers/atropos`, on `cpu` in prefect.yaml) as
its sub-run: the sandboxes and verifiers run where the CPU work belongs, the trainer trains. The
flow resolves the policy's tokenizer from the store, runs the workers (restarted when they die),
and ends when the trainer's policy endpoint is gone.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.states import Cancelling
from pydantic import BaseModel, Field

from flywheel.data import ArtifactStore
from flywheel.training.grpo_config import GRPORunConfig
from flywheel.training.models import resolve_model

logger = logging.getLogger(__name__)
DEPLOYMENT = "env-workers/atropos"


class EnvWorkersParams(BaseModel):
    """Where the trainer is and what its workers roll."""

    store_url: str | None = Field(default=None, description="Artifact store holding the policy model.")
    config: GRPORunConfig = Field(description="The RL stage's run config.")
    api_url: str = Field(description="The trainer's run-api.")
    policy_url: str = Field(description="The trainer's policy endpoint.")


@flow(name="env-workers", flow_run_name="env-workers-{params.config.output_name}")
def env_workers(params: EnvWorkersParams) -> dict[str, Any]:
    """Run the RL stage's env workers until its policy endpoint goes away; their restarts."""
    from flywheel.training.atropos_mode import serve_env_workers  # The envs and their rollout machinery.

    model_dir = resolve_model(params.config.policy_model, ArtifactStore(params.store_url))
    with tempfile.TemporaryDirectory(prefix="env-workers-") as tmp:
        return serve_env_workers(params.config, model_dir, params.api_url, params.policy_url, Path(tmp))


class DeployedWorkers:
    """The RL stage's launcher (`training.worker_handoff.WorkerLauncher`; called by the trainer, or by the stage
    for a launched trainer): a run of `cfg.env_workers_deployment`,
    its state read for `problem`, waited for (it ends with the endpoint) or cancelled by `stop`."""

    def __init__(self, cfg: GRPORunConfig, store_url: str | None, poll: float = 5.0) -> None:
        self.cfg = cfg
        self.store_url = store_url
        self.poll = poll
        self.flow_run: Any = None
        self._checked = (0.0, None)

    def start(self, api_url: str, policy_url: str) -> None:
        params = EnvWorkersParams(store_url=self.store_url, config=self.cfg, api_url=api_url, policy_url=policy_url)
        self.flow_run = run_deployment(
            self.cfg.env_workers_deployment or DEPLOYMENT,
            parameters={"params": params.model_dump(mode="json")},
            timeout=0,  # Submitted: the workers run beside training, a sub-run of the RL stage.
            tags=["flywheel", "env-workers"],
        )
        logger.info("env workers: flow run %s of %s", self.flow_run.name, self.cfg.env_workers_deployment)

    def problem(self) -> str | None:
        """Why no group can come any more: the workers' run has ended (read at most every `poll` seconds)."""
        checked_at, problem = self._checked
        if self.flow_run is None or time.monotonic() - checked_at < self.poll:
            return problem
        state = self._state()
        if state is not None and state.is_final():
            problem = f"the env workers' flow run {self.flow_run.name} ended {state.name}: see its logs"
        self._checked = (time.monotonic(), problem)
        return problem

    def stop(self, timeout: float = 120) -> None:
        """After the endpoint has closed: wait for the workers' run to end by itself, else cancel it."""
        if self.flow_run is None:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self._state()
            if state is None or state.is_final():
                return
            if state.type == StateType.SCHEDULED:  # Never picked up: nothing will end it.
                break
            time.sleep(1)
        logger.warning("env workers' flow run %s did not end: cancelling it", self.flow_run.name)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(self.flow_run.id, Cancelling(), force=True)

    def _state(self) -> Any:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(self.flow_run.id).state
