"""A real local Prefect server for the flow tests (one per session: it takes seconds to start)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from flywheel.flows.local_server import local_server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment (PREFECT_API_URL, PREFECT_HOME, ...) of a `prefect server start` on loopback."""
    with local_server(tmp_path_factory.mktemp("prefect-home")) as env:
        yield env


def flow_runs(env: dict[str, str], **flow_run_filter: Any) -> list[dict[str, Any]]:
    """Flow runs from the server's REST API (`flow_runs` filter body)."""
    body = {"flow_runs": flow_run_filter} if flow_run_filter else {}
    response = httpx.post(f"{env['PREFECT_API_URL']}/flow_runs/filter", json=body, timeout=10)
    response.raise_for_status()
    return response.json()


def task_runs(env: dict[str, str], flow_run_id: str | None = None, **task_run_filter: Any) -> list[dict[str, Any]]:
    """Task runs (of one flow run, when given) from the server's REST API (`task_runs` filter body)."""
    if flow_run_id is not None:
        task_run_filter["flow_run_id"] = {"any_": [flow_run_id]}
    body = {"task_runs": task_run_filter}
    response = httpx.post(f"{env['PREFECT_API_URL']}/task_runs/filter", json=body, timeout=10)
    response.raise_for_status()
    return response.json()


def heartbeats(env: dict[str, str], flow_run_id: str) -> int:
    """How many heartbeat events of a flow run the server has (up to 10)."""
    body = {
        "filter": {
            "event": {"name": ["prefect.flow-run.heartbeat"]},
            "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]},
        },
        "limit": 10,
    }
    response = httpx.post(f"{env['PREFECT_API_URL']}/events/filter", json=body, timeout=10)
    response.raise_for_status()
    return len(response.json()["events"])


def wait_for(check: Callable[[], Any], what: str, timeout: float = 120.0) -> None:
    """Poll `check` every second until it is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)
