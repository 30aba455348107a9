"""Cost accounting: artifacts put inside `track_costs()` record the peak memory reached in the block."""

from __future__ import annotations

from data import ArtifactStore
from data.costs import track_costs


def test_an_artifact_records_the_peak_memory_of_its_stage(tmp_path) -> None:
    store = ArtifactStore(tmp_path)
    assert "peak_rss_mb" not in store.put("dataset", "outside", {"x": b"1"}).metrics
    with track_costs():
        before = store.put("dataset", "light", {"x": b"1"}).metrics["peak_rss_mb"]
    with track_costs():
        ballast = bytearray(300 * 1024 * 1024)  # Touched: 300 MB resident.
        ballast[:: 4096] = b"\1" * len(ballast[:: 4096])
        del ballast
        heavy = store.put("dataset", "heavy", {"x": b"1"}).metrics["peak_rss_mb"]
    assert heavy >= before + 250, (before, heavy)
    with track_costs():  # The peak was reset: the freed ballast does not count for the next stage.
        assert store.put("dataset", "after", {"x": b"1"}).metrics["peak_rss_mb"] < heavy - 250
