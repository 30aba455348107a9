"""The processes beside an atropos-mode GRPO trainer: atroposlib's `run-api` and the env workers.

A worker that dies is started again (its in-flight groups are lost, not the run); every process
here dies with the trainer (`PR_SET_PDEATHSIG`), so a killed trainer leaves none behind, and its
resumed run starts a fleet of its own. Each process logs to a file in the run's folder.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import IO

from flywheel.inference import free_port

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it exits (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EnvFleet:
    """`run-api` on a free local port, and `workers` env workers (`flywheel.training.env_worker`) over
    `envs` in turn, watched every `poll` seconds; a context manager."""

    def __init__(self, envs: list[str], workers: int, worker_args: list[str], log_dir: Path, poll: float = 1.0) -> None:
        self.envs = envs
        self.workers = workers
        self.worker_args = worker_args
        self.log_dir = log_dir
        self.poll = poll
        self.api_port = free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.restarts: Counter[int] = Counter()
        self._api: subprocess.Popen[bytes] | None = None
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="env-fleet", daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> EnvFleet:
        run_api = Path(sys.executable).parent / "run-api"
        self._api = self._spawn([str(run_api), "--host", "127.0.0.1", "--port", str(self.api_port)], "run-api")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_workers(self, policy_url: str) -> None:
        """Start the env workers (after the trainer registered with `run-api`: envs wait for it)."""
        self.worker_args = [*self.worker_args, "--api", self.api_url, "--policy", policy_url]
        with self._lock:
            for index in range(self.workers):
                self._procs[index] = self._start_worker(index)
        self._watcher.start()

    def worker_pids(self) -> dict[int, int]:
        with self._lock:
            return {index: proc.pid for index, proc in self._procs.items()}

    def close(self) -> None:
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join(timeout=10)
        with self._lock:
            procs = [*self._procs.values(), *([self._api] if self._api else [])]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()

    def _start_worker(self, index: int) -> subprocess.Popen[bytes]:
        env = self.envs[index % len(self.envs)]
        command = [sys.executable, "-m", "flywheel.training.env_worker", *self.worker_args, "--env", env]
        return self._spawn([*command, "--index", str(index)], f"env-worker-{index}")

    def _spawn(self, command: list[str], name: str) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - open for the process's lifetime.
        self._logs.append(log)
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            with self._lock:
                for index, proc in list(self._procs.items()):
                    if proc.poll() is not None and not self._stop.is_set():
                        self.restarts[index] += 1
                        logger.warning(
                            "env worker %d exited (code %s): restarting it (restart %d); its in-flight groups are lost",
                            index, proc.returncode, self.restarts[index],
                        )  # fmt: skip
                        self._procs[index] = self._start_worker(index)
