"""A real local Prefect server (SQLite under its own PREFECT_HOME) and process workers.

Used by the integration tests, the orchestration benchmark and the UI screenshot script: each
gets an isolated server, so nothing touches the user's ~/.prefect.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from flywheel.inference.server import free_port, wait_for_http


def prefect_env(home: Path, api_url: str) -> dict[str, str]:
    """Environment for every process that talks to this server (CLI, workers, flow runs)."""
    return {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api_url,
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",  # Fast pickup of scheduled runs.
        "PREFECT_WORKER_PREFETCH_SECONDS": "2",
    }


def prefect_bin() -> str:
    return str(Path(sys.executable).with_name("prefect"))


@contextlib.contextmanager
def local_server(home: Path, ui: bool = False, timeout: float = 120.0) -> Iterator[dict[str, str]]:
    """Start `prefect server start` on a free port; yield the environment that points at it."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = prefect_env(home, f"http://127.0.0.1:{port}/api")
    env["PREFECT_UI_ENABLED"] = "true" if ui else "false"
    log = home / "server.log"
    with _process([prefect_bin(), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log):
        try:
            wait_for_http(f"{env['PREFECT_API_URL']}/health", timeout, "the prefect server")
        except TimeoutError as err:
            raise TimeoutError(f"{err}:\n{log.read_text()[-3000:]}") from None
        yield env


@contextlib.contextmanager
def workers(pools: list[str], env: dict[str, str], logs: Path) -> Iterator[None]:
    """One process worker per pool, stopped (with their flow-run children) on exit."""
    with contextlib.ExitStack() as stack:
        for pool in pools:
            command = [prefect_bin(), "worker", "start", "--pool", pool, "--name", f"{pool}-worker"]
            stack.enter_context(_process(command, env, logs / f"worker-{pool}.log"))
        yield


@contextlib.contextmanager
def _process(command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield process
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # Workers need two SIGTERMs; their runs go too.
            process.wait()
