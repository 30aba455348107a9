"""Serving models behind an OpenAI-compatible API: `transformers serve` on CPU, `vllm serve` on GPU."""

from flywheel.inference.client import chat
from flywheel.inference.server import (
    ModelServer,
    ServerConfig,
    ServerError,
    build_command,
    free_port,
    reachable_host,
    wait_until_healthy,
)

__all__ = [
    "ModelServer",
    "ServerConfig",
    "ServerError",
    "build_command",
    "chat",
    "free_port",
    "reachable_host",
    "wait_until_healthy",
]
