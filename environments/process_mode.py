"""`process` mode: generate groups concurrently and append them to a JSONL file, resuming a killed run.

atroposlib's own `process` runs one group at a time and renames an existing output file; this one
keeps `process_concurrency` groups in flight, writes each as it ends, and skips items already written.

With `process_workers` > 1 the rollouts run in that many processes: one process's event loop,
sandbox set-up and tokenisation cap it near one core (~150 rollouts/s, `benchmarks/rollout_throughput.py`).
The extra workers are spawned processes that rebuild the env from its constructor's arguments and
ask this process for items as they free up (a worker still importing takes none), over a pipe each;
they send each group's line back, and this process writes every line, so the file has one writer and
resumes as before. The items a worker held when it died go back to the others, once: an item that
kills a second process too is counted lost (a resumed run tries it again).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import importlib.util
import json
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.environments.agent_loop import sanitize

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from flywheel.environments.hermes_base_env import HermesAgentBaseEnv

logger = logging.getLogger(__name__)
Item = dict[str, Any]


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
    counts = {"written": 0, "failed": 0, "rollouts": 0, "infra_failures": 0, "requeued": 0, "lost": 0}
    lock = threading.Lock()
    pool = ItemPool(todo)
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
            with _workers(env, workers - 1, pool, write, counts):
                await _consume(env, pool.take_async, write)
            await _consume(env, pool.take_async, write)  # What dead workers gave back after this process ran dry.
        finally:
            await env.close()
    counts["rollouts"] += env._rollouts
    counts["infra_failures"] += env._infra_failures
    seconds = time.perf_counter() - started
    stats = {
        "groups_written": counts["written"],
        "groups_failed": counts["failed"],
        "groups_skipped_as_done": len(items) - len(todo),
        "groups_requeued": counts["requeued"],  # In flight in a worker that died: made by another process.
        "groups_lost": counts["lost"],  # Held by two processes that died: a resumed run tries them again.
        "rollouts": counts["rollouts"],
        "infra_failures": counts["infra_failures"],
        "process_workers": workers,
        "seconds": round(seconds, 2),
        "groups_per_second": round(counts["written"] / seconds, 3) if seconds else 0.0,
    }
    path.with_suffix(".stats.json").write_text(json.dumps(stats, indent=2))
    logger.info("%s: wrote %d groups (%d failed) in %.1f s", env.name, counts["written"], counts["failed"], seconds)
    return stats


class ItemPool:
    """A run's items, handed out one at a time to this process's consumers and the workers' requests;
    an item held by a worker that died goes back once (`give_back`)."""

    def __init__(self, items: list[Item]) -> None:
        self._items = collections.deque(items)
        self._returned: set[str] = set()
        self._lock = threading.Lock()

    def take(self) -> Item | None:
        with self._lock:
            return self._items.popleft() if self._items else None

    async def take_async(self) -> Item | None:
        return self.take()

    def give_back(self, items: list[Item]) -> int:
        """Put `items` back for another process; returns how many had been given back before (dropped)."""
        dropped = 0
        with self._lock:
            for item in items:
                key = str(item.get("item_id"))
                if key in self._returned:
                    dropped += 1
                else:
                    self._returned.add(key)
                    self._items.append(item)
        return dropped


Take = Callable[[], Awaitable[Item | None]]


async def _consume(env: HermesAgentBaseEnv, take: Take, write: Callable[[str | None], None]) -> None:
    """`process_concurrency` groups in flight, each on the next item `take` gives, until it gives none."""

    async def consumer() -> None:
        while (item := await take()) is not None:
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
def _workers(
    env: HermesAgentBaseEnv, extra: int, pool: ItemPool, write: Callable[[str | None], None], counts: dict[str, int]
) -> Iterator[None]:
    """`extra` spawned workers taking items from `pool` (a pipe each) and sending their lines to `write`.

    On the way out the workers are waited for, their rollout counts added to `counts`; the items of
    one that died go back to `pool` (counted in `requeued`, or `lost` the second time). An env class
    a worker could not import is refused first.
    """
    if extra == 0:
        yield
        return
    _check_spawnable(env)
    context = multiprocessing.get_context("spawn")  # The parent runs threads and an event loop: no fork.
    pipes, procs = [], []
    for index in range(extra):
        here, there = context.Pipe()
        proc = context.Process(
            target=_worker_main, args=(type(env), env.spawn_args, there, os.getpid()),
            name=f"{env.name}-process-{index + 1}", daemon=True,
        )  # fmt: skip
        proc.start()
        there.close()
        pipes.append(here)
        procs.append(proc)
    reader = threading.Thread(target=_serve_workers, args=(pipes, pool, write, counts), daemon=True)
    reader.start()
    try:
        yield
    finally:
        reader.join()
        for proc in procs:
            proc.join(timeout=30)
            if proc.exitcode != 0:
                logger.error("worker %s ended with code %s", proc.name, proc.exitcode)
                if proc.exitcode is None:
                    proc.kill()


def _serve_workers(
    pipes: list[Connection], pool: ItemPool, write: Callable[[str | None], None], counts: dict[str, int]
) -> None:
    """Answer the workers' item requests and write their lines until every pipe closes; give back
    the items of a worker that died; add each worker's last rollout counts (they travel with every
    line, so a worker that dies is counted too)."""
    from multiprocessing.connection import wait

    held: dict[int, dict[str, Item]] = {id(pipe): {} for pipe in pipes}
    last: dict[int, dict[str, int]] = {}
    open_pipes = list(pipes)
    while open_pipes:
        for pipe in wait(open_pipes):
            mine = held[id(pipe)]
            try:
                message = pipe.recv()
                if message == "take":
                    item = pool.take()
                    if item is not None:
                        mine[str(item.get("item_id"))] = item
                    pipe.send(item)
                    continue
            except (EOFError, OSError, pickle.UnpicklingError):  # Closed, or torn by a worker killed mid-send.
                open_pipes.remove(pipe)
                if mine:
                    dropped = pool.give_back(list(mine.values()))
                    counts["requeued"] += len(mine) - dropped
                    counts["lost"] += dropped
                    logger.warning("a worker died holding %d items: %d given back", len(mine), len(mine) - dropped)
                continue
            item_id, line, last[id(pipe)] = message
            mine.pop(item_id, None)
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


def _worker_main(env_class: type, spawn_args: dict[str, Any], pipe: Connection, parent: int) -> None:
    """A spawned worker: the env rebuilt, items asked for one at a time, each group's line (with the
    worker's rollout counts so far) sent to the parent, which writes it."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a killed parent takes its workers along.
    if os.getppid() != parent:
        return
    env = env_class(**spawn_args)
    env.process_mode = True
    asking = asyncio.Lock()
    current: dict[int, str] = {}  # The item each consumer task holds: its line names it.

    async def take() -> Item | None:
        async with asking:  # One request on the pipe at a time: replies come in order.
            pipe.send("take")
            item = await asyncio.to_thread(pipe.recv)
        if item is not None:
            current[id(asyncio.current_task())] = str(item.get("item_id"))
        return item

    def send_line(line: str | None) -> None:
        item_id = current.pop(id(asyncio.current_task()), None)
        pipe.send((item_id, line, {"rollouts": env._rollouts, "infra_failures": env._infra_failures}))

    async def run() -> None:
        await env.setup()
        try:
            await _consume(env, take, send_line)
        finally:
            await env.close()

    asyncio.run(run())
    pipe.close()


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
