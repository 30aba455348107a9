"""`process` mode: generate groups concurrently and append them to a JSONL file, resuming a killed run.

atroposlib's own `process` runs one group at a time and renames an existing output file; this one
keeps `process_concurrency` groups in flight, writes each as it ends, and skips items already written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.environments.agent_loop import sanitize

if TYPE_CHECKING:
    from flywheel.environments.hermes_base_env import HermesAgentBaseEnv

logger = logging.getLogger(__name__)


async def write_groups(env: HermesAgentBaseEnv, path: Path) -> dict[str, Any]:
    """Generate `env.n_groups_to_process` groups into `path`; return the run's stats (also `<path>.stats.json`).

    Items already in the file (by `item_id`) are skipped, so a killed run resumes. Calls the env's
    `setup` first and `close` last.
    """
    await env.setup()
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_torn_tail(path)
    done = _written_item_ids(path)
    items = [await env.get_next_item() for _ in range(env.n_groups_to_process)]
    todo = [item for item in items if item.get("item_id") not in done]
    logger.info("%s: %d groups to generate (%d already in %s)", env.name, len(todo), len(items) - len(todo), path)
    started = time.perf_counter()
    semaphore = asyncio.Semaphore(env.config.process_concurrency)
    written = failed = 0
    lock = asyncio.Lock()
    with open(path, "a", encoding="utf-8") as out:

        async def one(item: dict[str, Any]) -> None:
            nonlocal written, failed
            async with semaphore:
                try:
                    group, _ = await env.collect_trajectories(item)
                except Exception:
                    logger.exception("group for item %s failed", item.get("item_id"))
                    group = None
            async with lock:
                if group is None:
                    failed += 1
                    return
                out.write(json.dumps(sanitize(group), ensure_ascii=False) + "\n")
                out.flush()
                written += 1

        try:
            await asyncio.gather(*(one(item) for item in todo))
        finally:
            await env.close()
    seconds = time.perf_counter() - started
    stats = {
        "groups_written": written,
        "groups_failed": failed,
        "groups_skipped_as_done": len(items) - len(todo),
        "rollouts": env._rollouts,
        "infra_failures": env._infra_failures,
        "seconds": round(seconds, 2),
        "groups_per_second": round(written / seconds, 3) if seconds else 0.0,
    }
    path.with_suffix(".stats.json").write_text(json.dumps(stats, indent=2))
    logger.info("%s: wrote %d groups (%d failed) in %.1f s", env.name, written, failed, seconds)
    return stats


def _drop_torn_tail(path: Path) -> None:
    """Cut a partial last line left by a run killed mid-write, so appends start on a clean line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as handle:
            handle.truncate(keep)
        logger.warning("dropped a torn last line (%d bytes) from %s", len(data) - keep, path)


def _written_item_ids(path: Path) -> set[str]:
    """Item ids already in an output file."""
    if not path.exists():
        return set()
    done = set()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                meta = json.loads(line).get("meta") or {}
            except json.JSONDecodeError:
                continue
            if meta.get("item_id"):
                done.add(meta["item_id"])
    return done
