"""`process` mode: generate groups concurrently and append them to a JSONL file, resuming a killed run.

atroposlib's own `process` runs one group at a time and renames an existing output file; this one
keeps `process_concurrency` groups in flight, writes each as it ends, and skips items already written.

With `process_workers` > 1 the rollouts run in that many processes: one process's event loop,
sandbox set-up and tokenisation cap it near one core (~150 rollouts/s, `benchmarks/rollout_throughput.py`).
The extra workers are spawned processes that rebuild the env from its constructor's arguments, take
items from a shared queue as they free up (a worker still importing takes none), and send each
group's line back; this process writes every line, so the file has one writer and resumes as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import json
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.environments.agent_loop import sanitize

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from flywheel.environments.hermes_base_env import HermesAgentBaseEnv

logger = logging.getLogger(__name__)
Item = dict[str, Any]
_DONE = None  # The end of the item queue, one per consumer.


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
    workers = max(1, min(env.config.process_workers, len(todo)))
    logger.info(
        "%s: %d groups to generate (%d already in %s) in %d process(es)",
        env.name, len(todo), len(items) - len(todo), path, workers,
    )  # fmt: skip
    started = time.perf_counter()
    counts = {"written": 0, "failed": 0, "rollouts": 0, "infra_failures": 0}
    lock = threading.Lock()
    with open(path, "a", encoding="utf-8") as out:

        def write(line: str | None) -> None:
            with lock:
                if line is None:
                    counts["failed"] += 1
                    return
                out.write(line)
                out.flush()
                counts["written"] += 1

        try:
            with _worker_pool(env, workers - 1, write, counts) as pending:
                for item in todo:
                    pending.put(item)
                for _ in range(workers * env.config.process_concurrency):
                    pending.put(_DONE)
                await _consume(env, pending, write)
        finally:
            await env.close()
    counts["rollouts"] += env._rollouts
    counts["infra_failures"] += env._infra_failures
    seconds = time.perf_counter() - started
    stats = {
        "groups_written": counts["written"],
        "groups_failed": counts["failed"],
        "groups_skipped_as_done": len(items) - len(todo),
        "groups_lost": len(todo) - counts["written"] - counts["failed"],  # In flight in a worker that died.
        "rollouts": counts["rollouts"],
        "infra_failures": counts["infra_failures"],
        "process_workers": workers,
        "seconds": round(seconds, 2),
        "groups_per_second": round(counts["written"] / seconds, 3) if seconds else 0.0,
    }
    path.with_suffix(".stats.json").write_text(json.dumps(stats, indent=2))
    logger.info("%s: wrote %d groups (%d failed) in %.1f s", env.name, counts["written"], counts["failed"], seconds)
    return stats


async def _consume(env: HermesAgentBaseEnv, pending: Any, write: Callable[[str | None], None]) -> None:
    """`process_concurrency` groups in flight, each on the next item of `pending`, until its end markers."""

    async def consumer() -> None:
        while (item := await asyncio.to_thread(pending.get)) is not _DONE:
            env.remember_item(item)  # Done by `get_next_item` in the parent; a worker needs it too.
            try:
                group, _ = await env.collect_trajectories(item)
            except Exception:
                logger.exception("group for item %s failed", item.get("item_id"))
                group = None
            line = None if group is None else await asyncio.to_thread(json_line, group)
            write(line)

    await asyncio.gather(*(consumer() for _ in range(env.config.process_concurrency)))


@contextlib.contextmanager
def _worker_pool(
    env: HermesAgentBaseEnv, extra: int, write: Callable[[str | None], None], counts: dict[str, int]
) -> Iterator[Any]:
    """The item queue, and `extra` spawned workers consuming it; their lines go to `write`.

    On the way out the workers are waited for (the queue ends with their end markers), their
    rollout counts added to `counts`; a worker that died loses its in-flight groups (not written:
    a resumed run makes them), and is logged. An env class a worker could not import is refused first.
    """
    if extra == 0:
        pending: Any = queue.SimpleQueue()
        yield pending
        return
    _check_spawnable(env)
    context = multiprocessing.get_context("spawn")  # The parent runs threads and an event loop: no fork.
    pending = context.Queue()
    pipes, procs = [], []
    for index in range(extra):
        receive, send = context.Pipe(duplex=False)
        proc = context.Process(
            target=_worker_main, args=(type(env), env.spawn_args, pending, send, os.getpid()),
            name=f"{env.name}-process-{index + 1}", daemon=True,
        )  # fmt: skip
        proc.start()
        send.close()
        pipes.append(receive)
        procs.append(proc)
    reader = threading.Thread(target=_read_workers, args=(pipes, write, counts), daemon=True)
    reader.start()
    try:
        yield pending
    finally:
        reader.join()
        for proc in procs:
            proc.join(timeout=30)
            if proc.exitcode != 0:
                logger.error("worker %s ended with code %s: its in-flight groups are lost", proc.name, proc.exitcode)
                if proc.exitcode is None:
                    proc.kill()
        pending.cancel_join_thread()  # End markers of workers that died may be left: nothing to wait for.
        pending.close()


def _read_workers(pipes: list[Connection], write: Callable[[str | None], None], counts: dict[str, int]) -> None:
    """Write the workers' lines as they come, until every worker's pipe closes; add each worker's
    last rollout counts (they travel with every line, so a worker that dies is counted too)."""
    from multiprocessing.connection import wait

    last: dict[int, dict[str, int]] = {}
    open_pipes = list(pipes)
    while open_pipes:
        for pipe in wait(open_pipes):
            try:
                line, last[id(pipe)] = pipe.recv()
            except (EOFError, OSError, pickle.UnpicklingError):  # Closed, or torn by a worker killed mid-send.
                open_pipes.remove(pipe)
                continue
            write(line)
    for worker in last.values():
        counts["rollouts"] += worker["rollouts"]
        counts["infra_failures"] += worker["infra_failures"]


def _check_spawnable(env: HermesAgentBaseEnv) -> None:
    """A worker rebuilds the env from its class, found by module and name: refuse one it could not find."""
    cls = type(env)
    module = cls.__module__
    importable = module == "__main__" or importlib.util.find_spec(module) is not None
    try:
        found = importable and pickle.loads(pickle.dumps(cls)) is cls
    except Exception:
        found = False
    if not found:
        raise ValueError(
            f"process_workers > 1: a worker process cannot import the env class {cls.__qualname__} (module "
            f"{module}); define it at the top level of an importable module or script, or use process_workers=1"
        )


def _worker_main(env_class: type, spawn_args: dict[str, Any], pending: Any, send: Connection, parent: int) -> None:
    """A spawned worker: the env rebuilt, its groups' lines (with its rollout counts so far) sent to the
    parent, which writes them."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a killed parent takes its workers along.
    if os.getppid() != parent:
        return
    env = env_class(**spawn_args)
    env.process_mode = True

    def send_line(line: str | None) -> None:
        send.send((line, {"rollouts": env._rollouts, "infra_failures": env._infra_failures}))

    async def run() -> None:
        await env.setup()
        try:
            await _consume(env, pending, send_line)
        finally:
            await env.close()

    asyncio.run(run())
    send.close()


def json_line(group: dict[str, Any]) -> str:
    """`group` as one JSONL line; a lone surrogate anywhere (it cannot be written as UTF-8) becomes U+FFFD.

    Walking a group in Python to look for one (its token lists too) cost ~3 ms a rollout; the
    encoder finds one for free.
    """
    line = json.dumps(group, ensure_ascii=False) + "\n"
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(sanitize(group), ensure_ascii=False) + "\n"
    return line


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
