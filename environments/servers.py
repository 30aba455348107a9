"""Inference servers of an env: their configs, the tokenizer default, and how their clients are built."""

from __future__ import annotations

import os
from typing import Any

from atroposlib.envs.base import APIServerConfig


def use_aiohttp_clients(servers: list[Any]) -> None:
    """Give atroposlib's OpenAI clients the SDK's aiohttp transport.

    The default httpx pool re-checks every open connection on each request, which caps a CPU
    machine near 100 requests/s at 64 in flight; aiohttp keeps up with the server (the openai SDK
    documents `DefaultAioHttpClient` for high concurrency).
    """
    import openai

    for server in servers:
        client = getattr(server, "openai", None)
        if isinstance(client, openai.AsyncClient):
            server.openai = openai.AsyncClient(
                api_key=client.api_key,
                base_url=client.base_url,
                timeout=client.timeout,
                max_retries=0,  # atroposlib retries 3 x 3 times already; the SDK's 3 more made that 27.
                http_client=openai.DefaultAioHttpClient(timeout=client.timeout),
            )


def default_server_configs() -> list[APIServerConfig]:
    """An OpenAI-compatible server on localhost (`FLYWHEEL_*` variables); override with `--openai.*`."""
    return [
        APIServerConfig(
            model_name=os.environ.get("FLYWHEEL_MODEL_NAME", "smollm2"),
            base_url=os.environ.get("FLYWHEEL_BASE_URL", "http://127.0.0.1:8000/v1"),
            api_key=os.environ.get("FLYWHEEL_API_KEY", "local"),
            server_type="openai",
            health_check=False,
            timeout=600,
        )
    ]


def server_configs(base_url: str, model_name: str, api_key_env: str | None = None) -> list[APIServerConfig]:
    """Atropos server configs for an OpenAI-compatible endpoint; the key is read from `api_key_env`."""
    api_key = os.environ.get(api_key_env, "") if api_key_env else "local"
    return [
        APIServerConfig(
            base_url=base_url, model_name=model_name, api_key=api_key, server_type="openai", health_check=False,
            timeout=600,
        )
    ]  # fmt: skip


def default_tokenizer() -> str:
    """A local tokenizer dir (`FLYWHEEL_TOKENIZER`, set by the flows) or the hub id offline caches use."""
    return os.environ.get("FLYWHEEL_TOKENIZER", "HuggingFaceTB/SmolLM2-135M-Instruct")
