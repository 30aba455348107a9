"""Inference servers of an env: their configs, the tokenizer default, and how their clients are built.

The tokenizer atroposlib's `BaseEnv.__init__` loads eagerly is loaded on first use instead
(`_DeferredTokenizer`, installed when this module is imported).

vLLM and local servers need no API key, but the OpenAI SDK refuses to build a client without one;
a missing key becomes `PLACEHOLDER_API_KEY` ("EMPTY", the value vLLM's docs use) when a server
is built, so an env whose `config_init` leaves `api_key` unset still runs against a keyless server.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import atroposlib.envs.base as atropos_base
from atroposlib.envs.base import APIServerConfig
from atroposlib.envs.server_handling.server_baseline import APIServer, ReasoningConfig
from atroposlib.envs.server_handling.server_manager import OpenAIServer, SGLangServer, TrlVllmServer, VLLMServer

from flywheel.environments.agent.lean_client import LeanOpenAIClient

PLACEHOLDER_API_KEY = "EMPTY"
_SERVER_TYPES: dict[str, type[APIServer]] = {
    "openai": OpenAIServer,
    "trl": TrlVllmServer,
    "sglang": SGLangServer,
    "vllm": VLLMServer,
}


def build_server(config: APIServerConfig, reasoning_config: ReasoningConfig | None = None) -> APIServer:
    """Atroposlib's server for `config.server_type`, a missing API key replaced by the placeholder.

    Used as the env's `server_cls`: atroposlib calls it once per server config.
    """
    if not config.api_key:
        config = config.model_copy(update={"api_key": PLACEHOLDER_API_KEY})
    return _SERVER_TYPES[config.server_type](config, reasoning_config=reasoning_config)


def use_lean_clients(servers: list[Any]) -> None:
    """Replace atroposlib's OpenAI SDK clients with `LeanOpenAIClient` (same calls, same reply types).

    The SDK costs ~4 ms of CPU a request before sending it, and its default httpx pool re-checks
    every open connection on each request; a rollout process then caps near 100 requests/s where
    the server keeps up with several times that (`benchmarks/rollout_throughput.py`). Its retries
    go too: atroposlib retries 3 x 3 times already.
    """
    import openai

    for server in servers:
        client = getattr(server, "openai", None)
        if isinstance(client, openai.AsyncClient):
            server.openai = LeanOpenAIClient(str(client.base_url), client.api_key, float(server.config.timeout))


def default_server_configs() -> list[APIServerConfig]:
    """An OpenAI-compatible server on localhost (`FLYWHEEL_*` variables); override with `--openai.*`."""
    return [
        APIServerConfig(
            model_name=os.environ.get("FLYWHEEL_MODEL_NAME", "smollm2"),
            base_url=os.environ.get("FLYWHEEL_BASE_URL", "http://127.0.0.1:8000/v1"),
            api_key=os.environ.get("FLYWHEEL_API_KEY", PLACEHOLDER_API_KEY),
            server_type="openai",
            health_check=False,
            timeout=600,
        )
    ]


def server_configs(base_url: str, model_name: str, api_key_env: str | None = None) -> list[APIServerConfig]:
    """Atropos server configs for an OpenAI-compatible endpoint; the key is read from `api_key_env`.

    Without `api_key_env` the server is taken to be keyless (vLLM, a local server); a variable that
    is named but unset is an error that names it.
    """
    api_key = PLACEHOLDER_API_KEY
    if api_key_env:
        api_key = os.environ.get(api_key_env, "")
        if not api_key:
            raise ValueError(f"environment variable {api_key_env} (the API key) is not set")
    return [
        APIServerConfig(
            base_url=base_url, model_name=model_name, api_key=api_key, server_type="openai", health_check=False,
            timeout=600,
        )
    ]  # fmt: skip


def default_tokenizer() -> str:
    """A local tokenizer dir (`FLYWHEEL_TOKENIZER`, set by the flows) or the hub id offline caches use."""
    return os.environ.get("FLYWHEEL_TOKENIZER", "HuggingFaceTB/SmolLM2-135M-Instruct")


class _DeferredTokenizer:
    """The tokenizer atroposlib's `BaseEnv.__init__` loads eagerly, loaded on first use instead.

    The gym view (`reset`/`step`) and the oracle never tokenise, so an env must construct offline
    without its tokenizer; a runner may also replace it with the policy's before any use.
    """

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        self._args = (name, args, kwargs)
        self._loaded: Any = None
        self._lock = threading.Lock()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._tokenizer(), attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer()(*args, **kwargs)

    def _tokenizer(self) -> Any:
        with self._lock:  # Rollouts tokenise in worker threads: the first few would each load it.
            if self._loaded is None:
                from transformers import AutoTokenizer

                name, args, kwargs = self._args
                self._loaded = AutoTokenizer.from_pretrained(name, *args, **kwargs)
        return self._loaded


class _DeferredAutoTokenizer:
    from_pretrained = _DeferredTokenizer


atropos_base.AutoTokenizer = _DeferredAutoTokenizer  # type: ignore[attr-defined]
