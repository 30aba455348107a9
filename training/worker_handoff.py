"""Where atropos mode's env workers run, when the trainer does not start them itself.

A `WorkerLauncher` starts them elsewhere (`flows.env_workers.DeployedWorkers`: a deployment run on
the `cpu` pool). When the trainer is itself a launched child (`accelerate launch` in the GPU
runtime, which has no Prefect), the launcher stays in the launching process: `relaying` there
tells the child a folder (`FLYWHEEL_ENV_WORKERS_HANDOFF`), the child's `HandOff` writes its
`run-api` and policy endpoint URLs into it once they serve, the launching process starts the
workers with them and writes back any reason they cannot run, which the trainer's group queue
then fails with; the workers are stopped when the child exits.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

HANDOFF_ENV = "FLYWHEEL_ENV_WORKERS_HANDOFF"
URLS_FILE = "urls.json"
PROBLEM_FILE = "problem.txt"


class WorkerLauncher(Protocol):
    """Runs a trainer's env workers somewhere else; by default they are the trainer's child processes."""

    def start(self, api_url: str, policy_url: str) -> None: ...

    def problem(self) -> str | None: ...

    def stop(self) -> None: ...


class HandOff:
    """A launched trainer's `WorkerLauncher`: the process that launched it starts and stops the workers."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @classmethod
    def from_environment(cls) -> HandOff | None:
        """The hand-off the launching process asked for (None: this trainer starts its own workers)."""
        folder = os.environ.get(HANDOFF_ENV)
        return cls(Path(folder)) if folder else None

    def start(self, api_url: str, policy_url: str) -> None:
        _write(self.folder / URLS_FILE, json.dumps({"api": api_url, "policy": policy_url}))

    def problem(self) -> str | None:
        path = self.folder / PROBLEM_FILE
        return path.read_text() if path.exists() else None

    def stop(self) -> None:
        """Nothing: the launching process stops the workers when this one exits."""


@contextlib.contextmanager
def relaying(launcher: WorkerLauncher | None, folder: Path, poll: float = 1.0) -> Iterator[dict[str, str]]:
    """Relay a launched trainer's env workers to `launcher` for the length of the block; yields the
    environment the trainer needs (nothing without a launcher)."""
    if launcher is None:
        yield {}
        return
    done, started = threading.Event(), threading.Event()
    # In the caller's context (a Prefect run's: a deployment run the launcher starts is its sub-run).
    relay = threading.Thread(
        target=contextvars.copy_context().run, args=(_relay, launcher, folder, done, started, poll), daemon=True
    )
    relay.start()
    try:
        yield {HANDOFF_ENV: str(folder)}
    finally:
        done.set()
        relay.join(timeout=120)  # A start still under way when the trainer ended: stop it anyway.
        if started.is_set():
            try:
                launcher.stop()
            except Exception:  # The trainer's outcome stands; the workers' run is left to its own end.
                logger.exception("the env workers could not be stopped")


def _relay(
    launcher: WorkerLauncher, folder: Path, done: threading.Event, started: threading.Event, poll: float
) -> None:
    """Start the workers once the trainer serves; pass their problem (or a failure to start them) back."""
    while not done.wait(poll):
        if not started.is_set():
            if not (folder / URLS_FILE).exists():
                continue
            urls = json.loads((folder / URLS_FILE).read_text())
            started.set()  # Stopped at the end even if starting fails half-way.
            try:
                launcher.start(urls["api"], urls["policy"])
            except Exception as error:  # The trainer fails with it instead of waiting for groups that cannot come.
                logger.exception("the env workers could not be started")
                _write(folder / PROBLEM_FILE, f"the env workers could not be started: {error!r}")
                return
        elif not (folder / PROBLEM_FILE).exists():
            try:
                problem = launcher.problem()
            except Exception:  # Asking failed (the orchestrator's API, say): ask again next time.
                logger.warning("could not ask the env workers' launcher for a problem", exc_info=True)
                continue
            if problem:
                _write(folder / PROBLEM_FILE, problem)


def _write(path: Path, text: str) -> None:
    """Whole or not at all: the other process polls for the file."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)
