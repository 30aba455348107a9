"""A sync flow run ends without joining its heartbeat thread (`flows/heartbeats.py`), and still sends
its heartbeats. A real flow run in this process against the session's server."""

from __future__ import annotations

import threading

import pytest
from prefect import flow
from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from flywheel.flows.heartbeats import end_heartbeats_without_waiting
from tests.flows.conftest import heartbeats, wait_for


def is_heartbeat_thread(thread: threading.Thread) -> bool:
    """Prefect runs its `heartbeat_loop` through a copied context: `Context.run(heartbeat_loop)` (a
    thread forgets its arguments once it has run)."""
    args = getattr(thread, "_args", ())
    return bool(args) and getattr(args[0], "__name__", "") == "heartbeat_loop"


@flow(name="heartbeat-probe")
def probe() -> bool:
    return any(is_heartbeat_thread(t) for t in threading.enumerate())


def test_a_sync_flow_run_ends_without_joining_its_heartbeat_thread(
    prefect_server: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    end_heartbeats_without_waiting()
    end_heartbeats_without_waiting()  # Twice, as two flow modules may: still one partial, not nested.
    joined: list[bool] = []  # Whether each thread joined was a heartbeat thread (known before it ends).
    join = threading.Thread.join

    def recording_join(self: threading.Thread, timeout: float | None = None) -> None:
        joined.append(is_heartbeat_thread(self))
        join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", recording_join)
    settings = {PREFECT_API_URL: prefect_server["PREFECT_API_URL"], PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}
    with temporary_settings(updates=settings):
        state = probe(return_state=True)
    assert state.is_completed()
    assert state.result() is True, "the flow run had no heartbeat thread"
    assert not any(joined), "the flow run waited for its heartbeat thread"
    run_id = str(state.state_details.flow_run_id)
    wait_for(lambda: heartbeats(prefect_server, run_id), "the flow run's heartbeat")
