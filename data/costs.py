"""Cost accounting: the peak resident memory of the process while a stage made its artifacts.

Inside `track_costs()`, every `ArtifactStore.put` adds `peak_rss_mb` to the artifact's metrics:
the process's high-water mark (Linux `VmHWM`) since the block began, which resets it through
`/proc/self/clear_refs`, after handing what earlier stages freed back to the system
(`gc.collect()`, then glibc's `malloc_trim` or tcmalloc's release: freed tensors otherwise stay
resident in the allocator's heap, and a stage run in the same process would start from, and be
charged for, their pages).
A helper process the stage started (a model server) is counted inside
`counting_process(pid)`: `server_peak_rss_mb` is the high-water marks of it and every process it
started (`transformers serve` runs its generation engine, the model and KV cache, in a spawned
child), and `total_peak_rss_mb` the stage's and the server's together (an upper bound on what the
stage held at once). `accelerate launch` workers are not counted.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

_tracking: ContextVar[bool] = ContextVar("flywheel_track_costs", default=False)
_helpers: ContextVar[tuple[int, ...]] = ContextVar("flywheel_counted_processes", default=())
_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


@contextlib.contextmanager
def track_costs() -> Iterator[None]:
    """Measure peak memory from here: every artifact put inside records it (where the peak can be
    reset; elsewhere nothing is recorded rather than the whole process's peak under the stage's name)."""
    release_freed_memory()
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


def release_freed_memory() -> None:
    """Collect unreachable objects and return the allocator's free pages to the system (glibc or tcmalloc).

    The first call also freezes what survives (`gc.freeze`): by then mostly the imported modules,
    never garbage, which every later collection would otherwise traverse again (~450k objects,
    0.2-0.3 s a stage start with torch, transformers and Prefect imported)."""
    gc.collect()
    if gc.get_freeze_count() == 0:
        gc.freeze()
    return_free_heap()


def return_free_heap() -> None:
    """Hand the allocator's free pages back to the system: tcmalloc's free spans (where preloaded,
    `flows/fast_malloc.py`: it keeps them all for reuse), glibc's trimmable heap. Pages given back
    are mapped afresh, and resident only once written, when next allocated."""
    with contextlib.suppress(AttributeError):
        ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory()
    with contextlib.suppress(OSError, AttributeError):  # Not glibc (musl, macOS): nothing to trim this way.
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def counting_process(pid: int) -> Iterator[None]:
    """Count process `pid` (a model server this stage started) in the artifacts put meanwhile."""
    token = _helpers.set((*_helpers.get(), pid))
    try:
        yield
    finally:
        _helpers.reset(token)


def cost_metrics() -> dict[str, float]:
    """`{"peak_rss_mb": ...}` inside `track_costs()` (where /proc can tell), else nothing; with the
    counted helper processes' `server_peak_rss_mb` and the `total_peak_rss_mb` of both."""
    if not _tracking.get():
        return {}
    own = _high_water_mb(_STATUS)
    if own is None:
        return {}
    metrics = {"peak_rss_mb": own}
    counted = [pid for helper in _helpers.get() for pid in _process_tree(helper)]
    helpers = [mb for pid in counted if (mb := _high_water_mb(Path(f"/proc/{pid}/status"))) is not None]
    if helpers:
        server = sum(helpers)
        metrics |= {"server_peak_rss_mb": round(server, 1), "total_peak_rss_mb": round(own + server, 1)}
    return metrics


def _process_tree(pid: int) -> list[int]:
    """`pid` and every live process descended from it (parents read from /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # After the command, which may hold spaces.
        except (OSError, IndexError, ValueError):
            continue  # Exited meanwhile.
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree = [pid]
    for process in tree:
        tree.extend(children.get(process, []))
    return tree


def _high_water_mb(status: Path) -> float | None:
    """A process's peak resident memory (`VmHWM`) in MB, None where /proc cannot tell."""
    try:
        line = next(x for x in status.read_text().splitlines() if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return round(int(line.split()[1]) / 1024, 1)
