"""`run_logged`: a launched trainer's output reaches the log, failures say why, and an interrupted
caller takes the child's whole process group down (what happens to `accelerate launch` when a
stage times out or is cancelled). `launch_command`: what each launched process runs carries every
override and the store."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flywheel.training.launch import LaunchError, accelerate_cli, launch_command, run_logged
from flywheel.training.sft import SFTRunConfig

SFT_CONFIG = str(Path(__file__).resolve().parents[2] / "training" / "configs" / "sft_tiny.yaml")


def test_output_is_logged_line_by_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="flywheel.training.launch"):
        run_logged([sys.executable, "-c", "print('step 1 loss 2.0'); print('step 2 loss 1.5')"])
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.endswith("] step 1 loss 2.0") for line in lines)
    assert any(line.endswith("] step 2 loss 1.5") for line in lines)


def test_a_failed_launch_raises_with_its_last_lines() -> None:
    with pytest.raises(LaunchError, match="exited 3") as err:
        run_logged([sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"])
    assert "CUDA out of memory" in str(err.value)


def test_an_interrupted_caller_kills_the_whole_process_group(caplog: pytest.LogCaptureFixture) -> None:
    # The grandchild in a session of its own, as torchrun starts each rank: the group's kill does not reach it.
    child = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '120'], start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(120)"
    )

    def timeout(*_: object) -> None:
        raise TimeoutError("stage timed out")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(3)
    try:
        with caplog.at_level(logging.INFO, logger="flywheel.training.launch"), pytest.raises(TimeoutError):
            run_logged([sys.executable, "-c", child])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    grandchild = int(caplog.records[-1].getMessage().rsplit("] ", 1)[1])
    deadline = time.monotonic() + 5
    while _alive(grandchild):
        assert time.monotonic() < deadline, "the launched process's own child survived"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:  # A zombie waiting for its reaper is dead too.
            return stat.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_launch_command_carries_every_override_and_the_store() -> None:
    command = launch_command(
        SFTRunConfig(dataset="d"), "cfg.yaml", 2, ["total_steps=5", "learning_rate=1e-4"], "s3://bucket/runs"
    )
    assert command[:5] == [*accelerate_cli(), "--num_processes", "2"] and "--multi_gpu" in command
    cli = command[command.index("flywheel.flows.cli") :]
    assert cli == ["flywheel.flows.cli", "--store", "s3://bucket/runs", "train", "sft", "--config", "cfg.yaml",
                   "total_steps=5", "learning_rate=1e-4"]  # fmt: skip


def _run_launched_process(command: list[str]) -> subprocess.CompletedProcess[str]:
    """What each GPU's process runs: `python -m flywheel.flows.cli ...` (accelerate only adds the process group)."""
    module = command[command.index("flywheel.flows.cli") - 1 :]
    return subprocess.run([sys.executable, *module], capture_output=True, text=True, timeout=120)


def test_the_launched_process_trains_with_the_overrides(tmp_path: Path) -> None:
    command = launch_command(SFTRunConfig(dataset="d"), SFT_CONFIG, 2, ["total_steps=0"], str(tmp_path))
    result = _run_launched_process(command)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and "total_steps" in result.stderr


def test_the_launched_process_saves_into_the_given_store() -> None:
    result = _run_launched_process(
        launch_command(SFTRunConfig(dataset="d"), SFT_CONFIG, 2, [], "ftp://elsewhere/store")
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and "ftp://elsewhere/store" in result.stderr
