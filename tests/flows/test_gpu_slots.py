"""GPU stages hold slots of the `gpu` global concurrency limit where the server has one, and skip
Prefect's slot service where it has none (that round trip cost ~2 s a stage in a local round)."""

from __future__ import annotations

import uuid

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.settings import PREFECT_API_URL, temporary_settings

import flywheel.flows.stages
from flywheel.flows.round_config import RoundConfig


@pytest.fixture
def limit_name(prefect_server: dict, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A limit name of this test's own, in place of `gpu`, against the session's Prefect server."""
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(flywheel.flows.stages, "GPU_LIMIT", name)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        yield name


def active_slots(name: str) -> int:
    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


def test_a_gpu_stage_holds_its_slots_while_it_runs_and_releases_them(limit_name: str) -> None:
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=limit_name, limit=4))
    with flywheel.flows.stages.gpu_slots(RoundConfig(model="tiny", gpus=2)):
        assert active_slots(limit_name) == 2
    assert active_slots(limit_name) == 0


def test_without_the_limit_a_gpu_stage_runs_without_asking_the_slot_service(
    limit_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_service(*args: object, **kwargs: object) -> None:
        raise AssertionError("asked Prefect's slot service for a limit the server does not have")

    monkeypatch.setattr(flywheel.flows.stages, "concurrency", no_service)
    ran = []
    with flywheel.flows.stages.gpu_slots(RoundConfig(model="tiny", gpus=1)):
        ran.append(True)
    assert ran == [True]
