"""Start, health-check and stop an OpenAI-compatible model server (`transformers serve` or `vllm serve`).

Command lines are built by pure functions so the GPU (vLLM) path is tested on CPU machines. The
server runs in its own process group; stopping it (also on exceptions, timeouts and interpreter
exit) kills the whole group, so no stray workers survive.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Literal

import httpx
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, model_validator

logger = logging.getLogger(__name__)

_LIVE: set[ModelServer] = set()


class ServerError(Exception):
    """The model server could not be started, did not become healthy, or is unreachable."""


class ServerConfig(BaseModel):
    """How to serve one model directory."""

    # -- what and where
    model: str = Field(description="Local HF model directory to serve.")
    backend: Literal["transformers", "vllm"] = Field(
        default="transformers", description="`transformers serve` (CPU) or `vllm serve` (GPU)."
    )
    host: str = Field(default="127.0.0.1", description="Listen address.")
    port: int = Field(default=0, ge=0, le=65535, description="Listen port; 0 picks a free one.")
    served_model_name: str | None = Field(default=None, description="vLLM: name clients send as `model`.")
    dtype: str = Field(default="auto", description="Weights dtype (auto, float32, bfloat16, ...).")
    startup_timeout_s: float = Field(default=600.0, gt=0, description="Give up if not healthy by then.")
    extra_args: list[str] = Field(default_factory=list, description="Appended verbatim to the command.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables for the server.")

    # -- transformers serve (CPU)
    device: str = Field(default="cpu", description="transformers: device for inference.")
    continuous_batching: bool = Field(
        default=True, description="transformers: batch concurrent requests (4-6x tokens/s on CPU)."
    )
    cb_max_batch_tokens: int = Field(
        default=1024,
        ge=16,
        description="transformers: tokens per forward pass. 1024 is the fastest on 2 cores (per-sequence SDPA: "
        "2048 x0.90, 512 x0.94; with one mask per step the library's default, 8192, was ~5x slower).",
    )
    sdpa_gqa: bool = Field(
        default=True,
        description="transformers: grouped-query attention inside the library's SDPA (TRANSFORMERS_SDPA_FORCE_GQA) "
        "instead of copying every key/value head: 1.26x tokens/s on CPU (benchmarks/serve_throughput.py); "
        "per-sequence SDPA always does.",
    )
    varlen_sdpa: bool = Field(
        default=True,
        description="transformers: each batched request attends over its own keys, not every key of the step "
        "(inference/varlen_sdpa.py): 1.80x tokens/s on 16 first turns (benchmarks/serve_throughput.py).",
    )
    cb_max_memory_percent: float = Field(
        default=0.12,
        gt=0,
        le=1,
        description="transformers: KV-cache share of available RAM (12 %: ~20k tokens of SmolLM2 on 24 GB, so "
        "~13 multi-turn rollouts fit with their earlier turns still cached; 5 % held ~8k: 1.45x slower evaluations "
        "than 15 % with 64-token blocks, benchmarks/serve_throughput.py --agentic). Not 15 %: a round 3 whose "
        "training left the round's process 1.3 GB larger took its evaluation to 6.3 GB with it.",
    )
    cb_block_size: int = Field(
        default=64,
        ge=16,
        description="transformers: KV-cache block in tokens. A new turn reuses its conversation's cached "
        "prefix in whole blocks; the library's 256 recomputes up to 255 tokens of it every turn.",
    )

    # -- vllm serve (GPU)
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM: GPUs per model replica.")
    data_parallel_size: int = Field(default=1, ge=1, description="vLLM: model replicas (one per GPU group).")
    max_model_len: int | None = Field(default=None, ge=1, description="vLLM: context length cap.")
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="vLLM: GPU memory share.")
    tool_call_parser: str | None = Field(
        default="hermes", description="vLLM: parser for auto tool choice; None disables tool calling."
    )
    enable_prefix_caching: bool = Field(default=True, description="vLLM: reuse shared prompt prefixes.")

    @classmethod
    def checked(cls, **fields: object) -> ServerConfig:
        """Validate, turning every field error into one ServerError line."""
        try:
            return cls.model_validate(fields)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in err.errors())
            raise ServerError(f"invalid server config: {problems}") from err

    @model_validator(mode="after")
    def _check_model_dir(self, info: ValidationInfo) -> ServerConfig:
        planned = bool(info.context and info.context.get("planned"))  # `flywheel plan`: nothing is served.
        if not planned and not Path(self.model, "config.json").exists():
            raise ValueError(f"model directory '{self.model}' has no config.json")
        return self


GPU_PYTHON_ENV = "FLYWHEEL_GPU_PYTHON"


def gpu_python() -> str:
    """The interpreter of the GPU runtime (requirements/gpu.txt: vLLM cannot share Prefect's environment):
    `FLYWHEEL_GPU_PYTHON`, else this one (a machine with one environment)."""
    return os.environ.get(GPU_PYTHON_ENV) or sys.executable


def vllm_cli() -> list[str]:
    """`vllm` of the GPU runtime, never whatever `vllm` is first on PATH."""
    return [gpu_python(), "-m", "vllm.entrypoints.cli.main"]


def build_command(config: ServerConfig, port: int) -> list[str]:
    """The server's argv for `config` listening on `port` (pure: no process is started)."""
    if config.backend == "vllm":
        command = [
            *vllm_cli(),
            "serve",
            config.model,
            "--host",
            config.host,
            "--port",
            str(port),
            "--served-model-name",
            config.served_model_name or Path(config.model).name,
            "--dtype",
            config.dtype,
            "--tensor-parallel-size",
            str(config.tensor_parallel_size),
            "--data-parallel-size",
            str(config.data_parallel_size),
            "--gpu-memory-utilization",
            str(config.gpu_memory_utilization),
        ]
        if config.max_model_len is not None:
            command += ["--max-model-len", str(config.max_model_len)]
        if config.tool_call_parser:
            command += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
        if config.enable_prefix_caching:
            command.append("--enable-prefix-caching")
    else:
        launcher = ["python", "-m", "flywheel.inference.transformers_serve"] if config.varlen_sdpa else ["transformers"]
        command = [
            *launcher,
            "serve",
            config.model,
            "--host",
            config.host,
            "--port",
            str(port),
            "--device",
            config.device,
            "--dtype",
            config.dtype,
            "--log-level",
            "info",
        ]
        if config.continuous_batching:
            command += ["--continuous-batching", "--cb-max-memory-percent", str(config.cb_max_memory_percent)]
            command += ["--cb-max-batch-tokens", str(config.cb_max_batch_tokens)]
            command += ["--cb-block-size", str(config.cb_block_size)]
    return command + list(config.extra_args)


def server_env(config: ServerConfig) -> dict[str, str]:
    """Environment variables the server gets on top of ours (pure: unit-tested)."""
    tuned = {"TRANSFORMERS_SDPA_FORCE_GQA": "1"} if config.backend == "transformers" and config.sdpa_gqa else {}
    return tuned | config.env


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the server binds it right after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def reachable_host(bind_host: str) -> str:
    """The name other machines reach a server bound to `bind_host` by: this machine's FQDN for every
    interface (`0.0.0.0`, `::`), else the address itself."""
    return socket.getfqdn() if bind_host in ("0.0.0.0", "::", "") else bind_host


def wait_for_http(url: str, timeout_s: float, what: str) -> None:
    """Poll `GET url` until it answers 200 (a process that is starting); TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while True:
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not answer at {url} within {timeout_s:.0f} s")
            time.sleep(0.2)


def wait_until_healthy(
    base_url: str,
    timeout_s: float,
    process: subprocess.Popen[bytes] | None = None,
    api_key: str | None = None,
) -> str:
    """Poll `GET {base_url}/models` until it answers; return the first served model id.

    Works for any OpenAI-compatible endpoint. Fails early if `process` exits meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last_error = "no answer"
    # One client for every poll: a new one builds an SSL context each time (~20-40 ms of CPU taken
    # from the server that is starting, twice a second).
    with httpx.Client(headers=headers, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise ServerError(f"server exited with code {process.returncode} before becoming healthy")
            try:
                response = client.get(f"{base_url}/models")
                if response.status_code == 200:
                    models = response.json().get("data") or []
                    if models:
                        return models[0]["id"]
                    last_error = "it lists no models"
                else:
                    last_error = f"HTTP {response.status_code}"
            except (httpx.HTTPError, ValueError) as err:
                last_error = type(err).__name__
            time.sleep(0.5)
    raise ServerError(f"{base_url} did not become healthy within {timeout_s:.0f} s ({last_error})")


class ModelServer:
    """A running model server; use as a context manager so it is always stopped."""

    def __init__(self, config: ServerConfig, log_tail_lines: int = 200) -> None:
        self.config = config
        self.port = config.port or free_port(config.host)
        self.command = build_command(config, self.port)
        self.model_name: str | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=log_tail_lines)
        self._reader: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """OpenAI-compatible base URL, e.g. `http://127.0.0.1:8000/v1`."""
        return f"http://{self.config.host}:{self.port}/v1"

    @property
    def pid(self) -> int:
        """The server's process id (started servers only)."""
        if self.process is None:
            raise ServerError("the server is not started")
        return self.process.pid

    @property
    def log_tail(self) -> str:
        """The last lines the server printed."""
        return "\n".join(self._tail)

    def start(self) -> ModelServer:
        """Launch the server and block until it serves the model (or fail with its log tail)."""
        executable = _find_executable(self.command[0])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **server_env(self.config)}
        logger.info("starting %s", " ".join(self.command))
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [executable, *self.command[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Own process group: stop() kills every worker it spawns.
        )
        _LIVE.add(self)
        # The reader thread runs in a copy of this context, so the caller's run context (a Prefect
        # flow run's, say) tags the server's lines and they reach that run's log.
        context = contextvars.copy_context()
        self._reader = threading.Thread(
            target=context.run, args=(self._stream_log,), name="model-server-log", daemon=True
        )
        self._reader.start()
        try:
            self.model_name = wait_until_healthy(self.base_url, self.config.startup_timeout_s, self.process)
        except BaseException as err:
            self.stop()
            if isinstance(err, ServerError):
                logger.warning("last output of %s:\n%s", self.command[0], self.log_tail[-3000:])
            raise
        logger.info(
            "%s serves %s at %s (ready in %.1f s)",
            self.config.backend,
            self.model_name,
            self.base_url,
            time.perf_counter() - started,
        )
        return self

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the server's process group: SIGTERM, then SIGKILL after `grace_s`; return once
        every process of the group is gone (the server exiting does not wait for what it spawned)."""
        process = self.process
        _LIVE.discard(self)
        if process is None:
            return
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace_s)
        _kill_group(process, grace_s)
        if self._reader is not None:
            self._reader.join(timeout=5)
        logger.info("stopped model server on port %d", self.port)

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _stream_log(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self._tail.append(line)
                # Per-request lines (access log, `transformers serve`'s "Request received") would flood
                # the run log and the Prefect API with it; everything else streams.
                per_request = ('" 200' in line and "HTTP/1.1" in line) or "Request received" in line
                level = logging.DEBUG if per_request else logging.INFO
                logger.log(level, "[%s] %s", self.config.backend, line)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal the group the server leads (its pid is the group id: a new session), even once the
    leader itself has exited."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _kill_group(process: subprocess.Popen[bytes], seconds: float) -> None:
    """SIGKILL what is left of the group `process` leads (itself included), reap it, and wait up to
    `seconds` for the group to be empty."""
    _signal_group(process.pid, signal.SIGKILL)
    process.wait(timeout=seconds)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    logger.warning("processes of model server group %d still exist %.0f s after SIGKILL", process.pid, seconds)


def _find_executable(name: str) -> str:
    """Prefer the script next to this interpreter (the venv's), then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        hint = "pip install 'flywheel[gpu]' on a CUDA machine" if name == "vllm" else "pip install transformers"
        raise ServerError(f"'{name}' is not installed: {hint}")
    return found


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=3.0)
