"""Child processes of a flow run (model servers) stream into the run log and die with the run:
on a flow timeout, and on the SIGTERM a worker sends when a run is cancelled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from tests.flows.conftest import flow_runs

FLOW = textwrap.dedent(
    """
    import sys, time
    import flywheel.flows  # Flywheel flows live in this package; importing it routes library logs to the run log.
    from prefect import flow
    from flywheel.inference import ModelServer, ServerConfig

    @flow(name="serve-then-wait", timeout_seconds=float(sys.argv[3]))
    def serve_then_wait(model: str, pid_file: str) -> None:
        with ModelServer(ServerConfig(model=model)) as server:
            open(pid_file, "w").write(str(server.process.pid))
            time.sleep(600)

    serve_then_wait(sys.argv[1], sys.argv[2])
    """
)


def start_flow(tiny_model: Path, tmp_path: Path, env: dict, timeout_s: float) -> tuple[subprocess.Popen, Path]:
    pid_file = tmp_path / "server.pid"
    command = [sys.executable, "-c", FLOW, str(tiny_model), str(pid_file), str(timeout_s)]
    env = {
        **env,
        "PREFECT_LOGGING_EXTRA_LOGGERS": "flywheel.inference",
    }  # Prefect is imported first: as in prefect.yaml.
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, pid_file


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 180) -> int:
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        assert time.monotonic() < deadline, "the model server never came up"
        time.sleep(0.2)
    return int(path.read_text())


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_flow_timeout_kills_the_model_server(prefect_server: dict, tiny_model: Path, tmp_path: Path) -> None:
    # The timeout must outlast the server's start (35 s on a busy 2-core machine, where 45 s was missed).
    process, pid_file = start_flow(tiny_model, tmp_path, prefect_server, timeout_s=100)
    server_pid = wait_for(pid_file, process)
    output, _ = process.communicate(timeout=180)
    assert "TimeoutError" in output or "timed out" in output, output[-2000:]
    assert not group_alive(server_pid), "the model server outlived its flow run"
    # The server's own output went to the run log, prefixed with its backend.
    run = next(r for r in flow_runs(prefect_server) if r["flow_id"] and r["state_name"] == "TimedOut")
    body = {"logs": {"flow_run_id": {"any_": [run["id"]]}}}
    logs = httpx.post(f"{prefect_server['PREFECT_API_URL']}/logs/filter", json=body)
    messages = [entry["message"] for entry in logs.raise_for_status().json()]
    assert any(m.startswith("[transformers]") for m in messages), messages[:20]


def test_sigterm_on_the_flow_run_kills_the_model_server(prefect_server: dict, tiny_model: Path, tmp_path: Path) -> None:
    process, pid_file = start_flow(tiny_model, tmp_path, prefect_server, timeout_s=600)
    server_pid = wait_for(pid_file, process)
    process.send_signal(signal.SIGTERM)  # What a worker sends to cancel a run.
    process.communicate(timeout=60)
    deadline = time.monotonic() + 15
    while group_alive(server_pid):
        assert time.monotonic() < deadline, "the model server outlived its cancelled flow run"
        time.sleep(0.2)
