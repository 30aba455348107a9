"""Sync flow runs end without waiting out their heartbeat thread's sleep.

Prefect 3.9 sends a flow run's heartbeats (what crash detection watches, `flows/infra.py`) from a
daemon thread that sleeps in 1-second steps between them, and its sync flow engine joins that
thread when the run ends: every sync flow run waits up to a second for the thread's current sleep
to finish - ~0.9 s of a 1.1 s no-change re-run of a round. Prefect's async flow engine passes
`join_on_exit=False` instead: the stop flag is set before the run's final state, the thread sees it
when it wakes and returns without sending, and a heartbeat it was sending at that moment was
sent before the final state whether or not anyone waits for it. `flows/stages.py` (imported by every
module with a flow) gives sync flow runs that same exit; heartbeats are sent as before. A Prefect
whose heartbeat context takes no `join_on_exit` is left as it is (`tests/flows/test_heartbeats.py`
fails there).
"""

from __future__ import annotations

import functools
import inspect

from prefect import flow_engine


def end_heartbeats_without_waiting() -> None:
    """Make every flow run's heartbeat context exit as the async engine's does (idempotent)."""
    send = flow_engine._send_heartbeats
    if isinstance(send, functools.partial) or "join_on_exit" not in inspect.signature(send).parameters:
        return
    flow_engine._send_heartbeats = functools.partial(send, join_on_exit=False)
