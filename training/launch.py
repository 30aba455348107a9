"""Multi-GPU training as a child process: `accelerate launch` in its own process group, its output
streamed line by line into this process's log (so into the Prefect run log), killed with its
whole group when the caller is interrupted, times out or is cancelled."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from flywheel.data import ArtifactStore, Manifest
from flywheel.data.store import STORE_ENV
from flywheel.inference.server import gpu_python
from flywheel.training.config import DEEPSPEED_DIR, TrainConfig
from flywheel.training.worker_handoff import WorkerLauncher, relaying

logger = logging.getLogger(__name__)


def accelerate_cli() -> list[str]:
    """`accelerate launch` of the GPU runtime (`gpu_python`), never whatever is first on PATH (a worker's venv
    is not activated)."""
    return [gpu_python(), "-m", "accelerate.commands.launch"]


class LaunchError(RuntimeError):
    """The launched training exited non-zero."""


def run_logged(command: list[str], env: dict[str, str] | None = None, tail_lines: int = 50) -> None:
    """Run `command`, logging each line it prints; raise `LaunchError` (with its last lines) on failure."""
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    logger.info("launching %s", " ".join(command))
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line.rstrip())
            logger.info("[%s] %s", Path(command[0]).name, line.rstrip())
        code = process.wait()
    except BaseException:  # Timeout, cancellation (SIGTERM -> exception), Ctrl-C: take every process down.
        kill_tree(process.pid)
        process.wait()
        raise
    if code != 0:
        raise LaunchError(f"{' '.join(command[:4])} ... exited {code}:\n" + "\n".join(tail))


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its process group and every process under it: torchrun starts each rank in a
    session of its own, out of reach of the group's kill, and a killed launcher cannot pass it on."""
    import psutil

    try:
        launcher = psutil.Process(pid)
        processes = [launcher, *launcher.children(recursive=True)]
    except psutil.NoSuchProcess:
        processes = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


@dataclass(frozen=True)
class Machines:
    """The machines one training run spans: `count` of them, this one number `rank`; every machine's
    launcher meets machine 0 at `address:port` (torch's static rendezvous)."""

    count: int = 1
    rank: int = 0
    address: str = "127.0.0.1"
    port: int = 29500

    def options(self) -> list[str]:
        """`accelerate launch`'s machine options (none on one machine)."""
        if self.count == 1:
            return []
        return ["--machine_rank", str(self.rank), "--main_process_ip", self.address,
                "--main_process_port", str(self.port)]  # fmt: skip


def launcher(cfg: TrainConfig, num_gpus: int, machines: Machines = Machines()) -> list[str]:
    """`accelerate launch` and its options for `num_gpus` processes on each of `machines`, sharded as `cfg`
    says (ZeRO, FSDP or plain DDP); the program to run follows."""
    processes = num_gpus * machines.count
    command = [*accelerate_cli(), "--num_processes", str(processes), "--num_machines", str(machines.count)]
    command += machines.options()
    if cfg.deepspeed:
        command += [
            "--config_file",
            str(DEEPSPEED_DIR / "accelerate_multi_gpu.yaml"),
            "--deepspeed_config_file",
            str(DEEPSPEED_DIR / f"{cfg.deepspeed}.json"),
        ]
        if machines.count > 1:  # Each machine runs its own launcher (torchrun), not DeepSpeed's pdsh over ssh.
            command += ["--deepspeed_multinode_launcher", "standard"]
    elif cfg.fsdp:
        command += ["--config_file", str(DEEPSPEED_DIR / "accelerate_fsdp.yaml")]
    elif processes > 1:
        command.append("--multi_gpu")
    return command


def launch_command(
    cfg: TrainConfig,
    config_file: str,
    num_gpus: int,
    overrides: Sequence[str] = (),
    store_url: str | None = None,
    machines: Machines = Machines(),
) -> list[str]:
    """The `accelerate launch` argv that trains `cfg` (saved as `config_file`, plus `key=value` overrides)
    on `num_gpus` GPUs of each of `machines` (this one's command), saving into `store_url` (None: the
    launched process's own default); pure: nothing runs."""
    store = ["--store", store_url] if store_url else []
    train = ["train", cfg.algorithm, "--config", config_file, *overrides]
    return [*launcher(cfg, num_gpus, machines), "-m", "flywheel.flows.cli", *store, *train]


def launch(
    cfg: TrainConfig, store: ArtifactStore, num_gpus: int, env_workers: WorkerLauncher | None = None
) -> Manifest:
    """Train `cfg` on `num_gpus` GPUs with `accelerate launch`; returns its checkpoint's manifest.
    `env_workers` runs an atropos-mode trainer's env workers from here (`worker_handoff.relaying`)."""
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp, f"{cfg.algorithm}.yaml")
        config_file.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        with relaying(env_workers, Path(tmp)) as handoff:
            run_logged(
                launch_command(cfg, str(config_file), num_gpus), env={**os.environ, STORE_ENV: store.url, **handoff}
            )
    return store.manifest(f"checkpoint/{cfg.output_name}")
