"""The model server: command lines (pure, both backends) and a real `transformers serve` process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flywheel.inference import ModelServer, ServerConfig, ServerError, build_command, chat
from flywheel.inference.server import server_env, vllm_cli


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_vllm_command_carries_gpu_and_tool_flags(tiny_model: Path) -> None:
    config = ServerConfig(
        model=str(tiny_model),
        backend="vllm",
        served_model_name="tiny",
        tensor_parallel_size=8,
        max_model_len=4096,
        gpu_memory_utilization=0.85,
        dtype="bfloat16",
    )
    command = build_command(config, 9000)
    assert command[:5] == [*vllm_cli(), "serve", str(tiny_model)]
    joined = " ".join(command)
    for flag in (
        "--port 9000",
        "--served-model-name tiny",
        "--tensor-parallel-size 8",
        "--max-model-len 4096",
        "--gpu-memory-utilization 0.85",
        "--dtype bfloat16",
        "--enable-auto-tool-choice --tool-call-parser hermes",
        "--enable-prefix-caching",
    ):
        assert flag in joined
    no_tools = build_command(config.model_copy(update={"tool_call_parser": None}), 9000)
    assert "--enable-auto-tool-choice" not in no_tools


def test_transformers_command_caps_kv_cache(tiny_model: Path) -> None:
    command = build_command(ServerConfig(model=str(tiny_model)), 8123)
    # Through the wrapper that gives continuous batching per-sequence attention (inference/varlen_sdpa.py).
    assert command[:5] == ["python", "-m", "flywheel.inference.transformers_serve", "serve", str(tiny_model)]
    assert "--continuous-batching" in command
    assert command[command.index("--cb-max-memory-percent") + 1] == "0.12"
    assert command[command.index("--cb-block-size") + 1] == "64"  # Prefix reuse to the nearest 64 tokens.
    assert command[command.index("--cb-max-batch-tokens") + 1] == "1024"  # Not the library's slow 8192.
    assert command[command.index("--device") + 1] == "cpu"
    plain = build_command(ServerConfig(model=str(tiny_model), continuous_batching=False, varlen_sdpa=False), 8123)
    assert "--continuous-batching" not in plain and plain[:2] == ["transformers", "serve"]


def test_bad_config_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="has no config.json"):
        ServerConfig.checked(model=str(tmp_path))
    with pytest.raises(ServerError, match="gpu_memory_utilization"):
        ServerConfig.checked(model=str(tmp_path), gpu_memory_utilization=2.0)


def test_real_server_answers_and_its_process_group_is_killed(tiny_model: Path) -> None:
    server = ModelServer(ServerConfig(model=str(tiny_model), continuous_batching=False))
    with server:
        assert server.model_name == str(tiny_model)
        reply = chat(
            server.base_url,
            server.model_name,
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0.0,
        )
        assert isinstance(reply, str) and reply
        pid = server.process.pid
        assert _pid_alive(pid)
    assert not _pid_alive(pid)
    assert "Uvicorn running" in server.log_tail or "Application startup complete" in server.log_tail


def test_stop_returns_only_once_every_process_of_the_group_is_gone(tiny_model: Path, tmp_path: Path) -> None:
    """A process the server spawned that ignores SIGTERM outlives the server: stop() kills it too."""
    import signal
    import subprocess

    child = tmp_path / "child.pid"
    script = f"(trap '' TERM; echo $BASHPID > {child}; exec sleep 300) & wait"  # sleep inherits the ignored TERM.
    server = ModelServer(ServerConfig(model=str(tiny_model)))
    server.process = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    while not child.exists() or not child.read_text().strip():
        assert server.process.poll() is None
    server.stop(grace_s=5)
    assert server.process.poll() == -signal.SIGTERM  # The server itself went on SIGTERM.
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)  # And nothing of its group is left.


def test_server_that_dies_at_startup_fails_fast(tiny_model: Path) -> None:
    config = ServerConfig(model=str(tiny_model), extra_args=["--no-such-flag"], startup_timeout_s=120)
    server = ModelServer(config)
    with pytest.raises(ServerError, match="exited with code"):
        server.start()
    assert server.process.poll() is not None
    assert "no-such-flag" in server.log_tail or "No such option" in server.log_tail


def test_startup_timeout_kills_the_server(tiny_model: Path) -> None:
    server = ModelServer(ServerConfig(model=str(tiny_model), startup_timeout_s=0.3))
    with pytest.raises(ServerError, match="did not become healthy"):
        server.start()
    assert server.process.poll() is not None


def test_server_output_streams_to_the_log_but_per_request_lines_only_at_debug(tiny_model: Path, caplog) -> None:
    """A request's lines stay out of the run log (and the Prefect API), startup and errors do not."""
    import logging
    import subprocess

    lines = [
        "INFO:     Uvicorn running on http://127.0.0.1:1",
        '127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        "[transformers] Request received",
        "Traceback (most recent call last):",
    ]
    server = ModelServer(ServerConfig(model=str(tiny_model)))
    server.process = subprocess.Popen(["printf", "%s\\n", *lines], stdout=subprocess.PIPE)
    with caplog.at_level(logging.DEBUG, logger="flywheel.inference.server"):
        server._stream_log()
    levels = {record.getMessage().split("] ", 1)[1]: record.levelno for record in caplog.records}
    assert levels == dict(zip(lines, [logging.INFO, logging.DEBUG, logging.DEBUG, logging.INFO], strict=True))
    assert list(server._tail) == lines  # The failure tail keeps everything.


def test_transformers_serve_gets_grouped_query_attention_unless_turned_off(tiny_model: Path) -> None:
    assert server_env(ServerConfig(model=str(tiny_model))) == {"TRANSFORMERS_SDPA_FORCE_GQA": "1"}
    assert server_env(ServerConfig(model=str(tiny_model), sdpa_gqa=False, env={"A": "1"})) == {"A": "1"}
    assert server_env(ServerConfig(model=str(tiny_model), backend="vllm")) == {}
