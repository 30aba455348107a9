"""The processes beside an atropos-mode GRPO trainer: atroposlib's `run-api` and the env workers (or,
for a trainer elsewhere, the env workers alone).

A worker that dies is started again after a back-off (its in-flight groups are lost, not the run),
on items and sampling seeds of its own (a restart never replays what its predecessor rolled); one
that keeps dying is given up after `max_restarts`, and `problem()` says so once none is left.
Every process here dies with the trainer: each sets its parent-death signal itself, before
`exec` (`preexec_fn` can deadlock a child forked from a threaded parent), so a killed trainer
leaves none behind and its resumed run starts a fleet of its own. Each logs to a file in the
run's folder.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from flywheel.inference import free_port, reachable_host

logger = logging.getLogger(__name__)

# `python -c _DIE_WITH_PARENT PARENT_PID PROGRAM ARGS...`: SIGTERM when the parent exits
# (PR_SET_PDEATHSIG survives exec), unless the parent is already gone; then exec PROGRAM.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])"
)


class EnvFleet:
    """`run-api` on a free local port, and `workers` env workers (`flywheel.training.env_worker`) over
    `envs` in turn, watched every `poll` seconds; a context manager."""

    def __init__(
        self,
        envs: list[str],
        workers: int,
        worker_args: list[str],
        log_dir: Path,
        poll: float = 1.0,
        max_restarts: int = 5,
        host: str = "127.0.0.1",
        api_url: str | None = None,
    ) -> None:
        """`run-api` listens on `host`; with `api_url` the workers post to that one and none is started here."""
        self.envs = envs
        self.workers = workers
        self.worker_args = worker_args
        self.log_dir = log_dir
        self.poll = poll
        self.max_restarts = max_restarts
        self.host = host
        self.api_port = free_port(host)
        self.own_api = api_url is None
        self.api_url = api_url or f"http://{reachable_host(host)}:{self.api_port}"
        self.restarts: Counter[int] = Counter()
        self.given_up: set[int] = set()
        self.error: str | None = None  # What stopped the watcher, if anything did.
        self._api: subprocess.Popen[bytes] | None = None
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._due: dict[int, float] = {}  # A dead worker's restart time.
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="env-fleet", daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> EnvFleet:
        if self.own_api:
            run_api = Path(sys.executable).parent / "run-api"
            self._api = self._spawn([str(run_api), "--host", self.host, "--port", str(self.api_port)], "run-api")
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

    def problem(self) -> str | None:
        """Why no group can come any more (None: workers are running or will be restarted)."""
        if self.error:
            return f"the env workers' watcher failed: {self.error}"
        if self.workers and len(self.given_up) == self.workers:
            return f"every env worker died {self.max_restarts + 1} times: see their logs in {self.log_dir}"
        return None

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

    def _start_worker(self, index: int) -> subprocess.Popen[bytes]:
        env = self.envs[index % len(self.envs)]
        command = [sys.executable, "-m", "flywheel.training.env_worker", *self.worker_args, "--env", env]
        command += ["--index", str(index), "--restart", str(self.restarts[index])]
        return self._spawn(command, f"env-worker-{index}")

    def _spawn(self, command: list[str], name: str) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:  # The child keeps its own descriptor.
            wrapped = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
            return subprocess.Popen(wrapped, stdout=log, stderr=subprocess.STDOUT)

    def _watch(self) -> None:
        try:
            while not self._stop.wait(self.poll):
                self._check()
        except Exception as error:  # Its workers die with this thread (their parent-death signal).
            logger.exception("the env workers' watcher failed")
            self.error = repr(error)

    def _check(self) -> None:
        """Restart the workers that died and are due (after their back-off); give up on those that died too often."""
        with self._lock:
            for index, proc in list(self._procs.items()):
                if proc.poll() is None or index in self.given_up or self._stop.is_set():
                    continue
                if index not in self._due:
                    if self.restarts[index] >= self.max_restarts:
                        self.given_up.add(index)
                        logger.error("env worker %d exited (code %s) for the last time", index, proc.returncode)
                        continue
                    delay = min(30.0, 2.0 ** self.restarts[index])
                    self._due[index] = time.monotonic() + delay
                    logger.warning(
                        "env worker %d exited (code %s): restarting it in %.0f s (restart %d); "
                        "its in-flight groups are lost",
                        index, proc.returncode, delay, self.restarts[index] + 1,
                    )  # fmt: skip
                elif time.monotonic() >= self._due[index]:
                    del self._due[index]
                    self.restarts[index] += 1
                    self._procs[index] = self._start_worker(index)
