"""The Prefect objects a flywheel needs besides its deployments: work pools, the GPU limit, alerts,
and the automation that marks a flow run whose process died as Crashed.

Idempotent, so `flywheel infra setup` can run on every deploy. Locally both pools are `process`
pools; on a cluster `h100` is a Kubernetes pool built from `deploy/h100-job-template.json`.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect.automations import Automation
from prefect.blocks.webhook import Webhook
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate, WorkPoolCreate
from prefect.client.schemas.objects import StateType
from prefect.events.actions import CallWebhook, ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings
from prefect.workers.process import ProcessWorker

from flywheel.training.config import ConfigError

H100_TEMPLATE = Path(__file__).resolve().parent.parent / "deploy" / "h100-job-template.json"
GPU_LIMIT = "gpu"
ALERT_NAME = "flywheel-failure-alert"
CRASH_NAME = "flywheel-crash-unresponsive"
MISSED_HEARTBEATS = 3  # A run is dead after this many heartbeat periods without one (Prefect's own guide).
FLYWHEEL_RUNS = {"prefect.resource.id": "prefect.tag.flywheel"}  # Deployment runs carry the `flywheel` tag.
ALERT_BLOCK = "flywheel-alerts"
ALERT_PAYLOAD = (
    '{"text": "flywheel: flow run {{ flow_run.name }} ({{ flow_run.id }}) ended {{ flow_run.state.name }}: '
    '{{ flow_run.state.message }}"}'
)


def h100_job_template() -> dict[str, Any]:
    """The Kubernetes base job template of the `h100` pool."""
    return json.loads(H100_TEMPLATE.read_text())


def setup(kubernetes: bool = False, gpu_slots: int = 8, alert_url: str | None = None) -> list[str]:
    """Create or update pools `cpu` and `h100`, the `gpu` limit, crash detection and (given a URL) the
    failure alert."""
    if gpu_slots < 1:
        raise ConfigError(f"gpu_slots must be at least 1, got {gpu_slots}")
    done = []
    with get_client(sync_client=True) as client:
        process = ("process", ProcessWorker.get_default_base_job_template())
        h100 = ("kubernetes", h100_job_template()) if kubernetes else process
        for name, (kind, template) in (("cpu", process), ("h100", h100)):
            client.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=template), overwrite=True)
            done.append(f"work pool {name} ({kind})")
        if limit_exists(client, GPU_LIMIT):
            client.update_global_concurrency_limit(GPU_LIMIT, GlobalConcurrencyLimitUpdate(limit=gpu_slots))
        else:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=gpu_slots))
        done.append(f"global concurrency limit {GPU_LIMIT} = {gpu_slots}")
    done.append(crash_detection())
    if alert_url:
        done.append(failure_alert(alert_url))
    return done


def limit_exists(client: SyncPrefectClient, name: str) -> bool:
    """Whether the Prefect API has a global concurrency limit `name`."""
    try:
        client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        return False
    return True


def failure_alert(url: str) -> str:
    """An automation that POSTs to `url` when a flywheel-tagged flow run fails or crashes."""
    block_id = Webhook(method="POST", url=url).save(ALERT_BLOCK, overwrite=True)
    _replace(
        Automation(
            name=ALERT_NAME,
            description="Tell someone when a flywheel stage fails.",
            trigger=EventTrigger(
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=FLYWHEEL_RUNS,
                expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
                posture=Posture.Reactive,
                threshold=1,
            ),
            actions=[CallWebhook(block_document_id=block_id, payload=ALERT_PAYLOAD)],
        )
    )
    return f"automation {ALERT_NAME} -> {url}"


def crash_detection(within: timedelta | None = None) -> str:
    """An automation that marks a flywheel flow run Crashed once its heartbeats stop: a stage whose pod
    was evicted or whose node died would otherwise show Running forever (and the failure alert, which
    fires on Crashed, would never hear of it). Prefect's flow runs send the heartbeats
    (`PREFECT_FLOWS_HEARTBEAT_FREQUENCY`, 180 s by default); a run is dead after `within` without one
    (default: three periods of the setting where this runs, so give the workers the same setting: a
    run that beats less often than `within` would be marked Crashed alive). Replacing the automation
    drops its armed windows: a run that died just before a redeploy stays Running."""
    heartbeat = get_current_settings().flows.heartbeat_frequency or 180
    within = within or timedelta(seconds=MISSED_HEARTBEATS * heartbeat)
    _replace(
        Automation(
            name=CRASH_NAME,
            description="Mark a flywheel flow run Crashed when its heartbeats stop.",
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"},
                expect={
                    "prefect.flow-run.heartbeat",
                    *(f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")),
                },
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=FLYWHEEL_RUNS,
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=within,
            ),
            actions=[
                ChangeFlowRunState(
                    state=StateType.CRASHED,
                    message=f"No heartbeat for {within.total_seconds():.0f} s: the flow run's process is gone.",
                )
            ],
        )
    )
    return f"automation {CRASH_NAME}: no heartbeat for {within.total_seconds():.0f} s -> Crashed"


def _replace(automation: Automation) -> None:
    """Create `automation`, deleting any of the same name first (so setup can run on every deploy)."""
    with get_client(sync_client=True) as client:
        for existing in client.read_automations_by_name(name=automation.name):
            client.delete_automation(existing.id)
    automation.create()
