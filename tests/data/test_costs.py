"""Cost accounting: artifacts put inside `track_costs()` record the peak memory reached in the block."""

from __future__ import annotations

import gc
import os
import signal
import weakref
from pathlib import Path

from flywheel.data import ArtifactStore
from flywheel.data.costs import counting_process, track_costs


def test_an_artifact_records_the_peak_memory_of_its_stage(tmp_path) -> None:
    store = ArtifactStore(tmp_path)
    assert "peak_rss_mb" not in store.put("dataset", "outside", {"x": b"1"}).metrics
    with track_costs():
        before = store.put("dataset", "light", {"x": b"1"}).metrics["peak_rss_mb"]
    with track_costs():
        ballast = bytearray(300 * 1024 * 1024)  # Touched: 300 MB resident.
        ballast[::4096] = b"\1" * len(ballast[::4096])
        del ballast
        heavy = store.put("dataset", "heavy", {"x": b"1"}).metrics["peak_rss_mb"]
    assert heavy >= before + 250, (before, heavy)
    with track_costs():  # The peak was reset: the freed ballast does not count for the next stage.
        assert store.put("dataset", "after", {"x": b"1"}).metrics["peak_rss_mb"] < heavy - 250


class _Node:
    """An object that can sit in a reference cycle (only the cyclic collector frees it)."""


def test_a_stage_start_collects_cycles_left_after_the_survivors_were_frozen() -> None:
    """The first stage start freezes what survives (imports); later garbage cycles are still collected."""
    gc.disable()  # Only track_costs collects here.
    try:
        with track_costs():
            pass
        assert gc.get_freeze_count() > 0
        node = _Node()
        node.itself = node  # type: ignore[attr-defined]
        alive = weakref.ref(node)
        del node
        assert alive() is not None  # A cycle: reference counting alone does not free it.
        with track_costs():
            assert alive() is None
    finally:
        gc.enable()


def _rss_mb() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_memory_an_earlier_stage_freed_is_not_charged_to_the_next(tmp_path) -> None:
    """Freed heap memory stays resident until handed back: a stage starts from a trimmed baseline."""
    store = ArtifactStore(tmp_path)
    chunks = [bytearray(100 * 1024) for _ in range(3000)]  # ~300 MB of heap chunks (below malloc's mmap threshold).
    for chunk in chunks:
        chunk[::4096] = b"\1" * len(chunk[::4096])
    pin = bytearray(100 * 1024)  # Above them: the space they free is not at the heap's top, so free() keeps it.
    del chunks
    freed_but_resident = _rss_mb()
    with track_costs():
        peak = store.put("dataset", "next", {"x": b"1"}).metrics["peak_rss_mb"]
    assert peak < freed_but_resident - 200, (freed_but_resident, peak)
    del pin


def test_a_counted_helper_process_adds_its_own_peak(tmp_path) -> None:
    """A model server the stage started, with the engine it spawned: their peaks are recorded beside
    the stage's, and the sum."""
    import subprocess
    import sys
    import time

    store = ArtifactStore(tmp_path)
    ready = tmp_path / "ready"
    touch = f"open({str(ready)!r}, 'w').close()"
    hold = "b = bytearray({} * 2**20); b[::4096] = b'1' * len(b[::4096])"
    engine = f"{hold.format(200)}; {touch}; input()"  # The model and its cache live in the child.
    script = f"import subprocess, sys; {hold.format(50)}; subprocess.run([sys.executable, '-c', {engine!r}])"
    helper = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, start_new_session=True)
    try:
        while not ready.exists():
            assert helper.poll() is None
            time.sleep(0.05)
        with track_costs(), counting_process(helper.pid):
            metrics = store.put("eval", "served", {"x": b"1"}).metrics
        with track_costs():
            alone = store.put("eval", "alone", {"x": b"1"}).metrics
    finally:
        os.killpg(helper.pid, signal.SIGKILL)  # The server and its engine.
        helper.wait()
    assert metrics["server_peak_rss_mb"] >= 250  # 50 MB in the server, 200 in its engine.
    assert metrics["total_peak_rss_mb"] == round(metrics["peak_rss_mb"] + metrics["server_peak_rss_mb"], 1)
    assert "server_peak_rss_mb" not in alone  # Counted only inside its block.
    with track_costs(), counting_process(helper.pid):  # A helper that has exited adds nothing.
        assert "server_peak_rss_mb" not in store.put("eval", "gone", {"x": b"1"}).metrics
