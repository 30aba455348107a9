"""In-process stages run without their own heartbeat thread, and nothing else of the settings changes."""

from __future__ import annotations

from prefect.settings import get_current_settings, temporary_settings

from flows.dispatch import without_heartbeat


def test_without_heartbeat_turns_off_only_the_heartbeat() -> None:
    with temporary_settings(updates={"flows.heartbeat_frequency": 30, "api.url": "http://127.0.0.1:9/api"}):
        outer = get_current_settings()
        with without_heartbeat():
            inner = get_current_settings()
            assert inner.flows.heartbeat_frequency is None
            assert inner.api.url == "http://127.0.0.1:9/api"
            assert inner.model_dump(exclude={"flows"}) == outer.model_dump(exclude={"flows"})
        assert get_current_settings().flows.heartbeat_frequency == 30
