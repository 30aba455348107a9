"""Cost accounting: the peak resident memory of the process while a stage made its artifacts.

Inside `track_costs()`, every `ArtifactStore.put` adds `peak_rss_mb` to the artifact's metrics:
the process's high-water mark (Linux `VmHWM`) since the block began, which resets it through
`/proc/self/clear_refs`. Model servers, `accelerate launch` workers and vLLM engines are processes
of their own and are not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

_tracking: ContextVar[bool] = ContextVar("flywheel_track_costs", default=False)
_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


@contextlib.contextmanager
def track_costs() -> Iterator[None]:
    """Measure peak memory from here: every artifact put inside records it (where the peak can be
    reset; elsewhere nothing is recorded rather than the whole process's peak under the stage's name)."""
    try:
        _CLEAR_REFS.write_text("5")  # Resets VmHWM to the current RSS.
        reset = True
    except OSError:
        reset = False
    token = _tracking.set(reset)
    try:
        yield
    finally:
        _tracking.reset(token)


def cost_metrics() -> dict[str, float]:
    """`{"peak_rss_mb": ...}` inside `track_costs()` (where /proc can tell), else nothing."""
    if not _tracking.get():
        return {}
    try:
        line = next(x for x in _STATUS.read_text().splitlines() if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return {}
    return {"peak_rss_mb": round(int(line.split()[1]) / 1024, 1)}
