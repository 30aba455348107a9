"""A flywheel flow run whose process dies is marked Crashed once its heartbeats stop (the automation
`flywheel infra setup` creates), and only that run: one still alive (beating every 30 s against a
45 s window), one that finished, and one outside the flywheel (no `flywheel` tag) are left as they
were. Real flow runs in subprocesses against the session's server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from flywheel.flows.infra import CRASH_NAME, crash_detection
from tests.flows.conftest import flow_runs, heartbeats, wait_for

HEARTBEAT = 30  # Prefect's shortest heartbeat period.
WITHIN = timedelta(seconds=45)  # More than one period: a live run always beats inside it.
PROBE = """
import sys, time
from prefect import flow, tags
from flywheel.flows.heartbeats import end_heartbeats_without_waiting

end_heartbeats_without_waiting()  # As every flywheel flow run: a finished run must stay Completed.

@flow(name="crash-probe", flow_run_name=sys.argv[1])
def probe() -> None:
    print("running", flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)

with tags(*sys.argv[3:]):
    probe()
"""


@pytest.fixture
def detection(prefect_server: dict[str, str]) -> Iterator[None]:
    """Crash detection with a 45 s window, removed again so no other test's runs meet it."""
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        assert "45 s -> Crashed" in crash_detection(WITHIN)
        try:
            yield
        finally:
            with get_client(sync_client=True) as client:
                for automation in client.read_automations_by_name(name=CRASH_NAME):
                    client.delete_automation(automation.id)


def start_probe(env: dict[str, str], name: str, mode: str, *tags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, name, mode, *tags],
        env={**os.environ, **env, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_of(env: dict[str, str], name: str) -> dict:
    """The flow run called `name` ({} until its process has created it)."""
    runs = flow_runs(env, name={"any_": [name]})
    assert len(runs) <= 1, runs
    return runs[0] if runs else {}


def test_a_dead_flywheel_run_is_marked_crashed_and_no_other_run_is(
    prefect_server: dict[str, str], detection: None
) -> None:
    tag = uuid.uuid4().hex[:8]
    dead, alive, outside, finished = (f"{kind}-{tag}" for kind in ("dead", "alive", "outside", "finished"))
    probes = {
        dead: start_probe(prefect_server, dead, "hang", "flywheel"),
        alive: start_probe(prefect_server, alive, "hang", "flywheel"),
        outside: start_probe(prefect_server, outside, "hang"),
        finished: start_probe(prefect_server, finished, "return", "flywheel"),
    }
    try:
        assert probes[finished].wait(timeout=120) == 0, probes[finished].stdout.read()  # type: ignore[union-attr]
        for name in (dead, outside):
            wait_for(lambda name=name: run_of(prefect_server, name), f"{name}'s flow run")
            run_id = run_of(prefect_server, name)["id"]
            wait_for(lambda run_id=run_id: heartbeats(prefect_server, run_id), f"{name}'s heartbeat")
            os.killpg(probes[name].pid, signal.SIGKILL)  # As an evicted pod or a dead node: no final state sent.
            probes[name].wait()
        wait_for(lambda: run_of(prefect_server, dead)["state"]["type"] == "CRASHED", "the dead run marked Crashed")
        time.sleep(10)  # Past the outside run's window too (it was killed just after the dead one).
        # The live run is past its first window (it started with the dead one) on its second heartbeat.
        assert run_of(prefect_server, alive)["state"]["type"] == "RUNNING"
    finally:
        for probe in probes.values():
            if probe.poll() is None:
                os.killpg(probe.pid, signal.SIGKILL)
    assert "No heartbeat for 45 s" in run_of(prefect_server, dead)["state"]["message"]
    assert run_of(prefect_server, outside)["state"]["type"] == "RUNNING"  # Not the flywheel's to judge.
    assert run_of(prefect_server, finished)["state"]["type"] == "COMPLETED"
