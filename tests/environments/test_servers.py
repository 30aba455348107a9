"""Inference servers: a keyless local server works without an API key (vLLM's docs use "EMPTY")."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from atroposlib.envs.base import APIServerConfig

from environments.custom.file_stats_env import FileStatsEnv, FileStatsEnvConfig
from environments.servers import PLACEHOLDER_API_KEY, server_configs


@pytest.fixture
def keyless_server() -> Iterator[tuple[str, list[str | None]]]:
    """An OpenAI-compatible stub on 127.0.0.1 that checks no key; yields its URL and the auth headers it saw."""
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.headers.get("Authorization"))
            message = {"role": "assistant", "content": "hello"}
            data = json.dumps(
                {
                    "id": "x", "object": "chat.completion", "created": 0, "model": "stub",
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            ).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("api_key", [None, ""])
def test_an_env_whose_config_init_has_no_api_key_talks_to_a_keyless_server(
    keyless_server: tuple[str, list[str | None]], tiny_model: Path, api_key: str | None
) -> None:
    url, seen = keyless_server

    class KeylessEnv(FileStatsEnv):
        @classmethod
        def config_init(cls) -> tuple[FileStatsEnvConfig, list[APIServerConfig]]:
            config = FileStatsEnvConfig(tokenizer_name=str(tiny_model), use_wandb=False)
            return config, [APIServerConfig(base_url=url, model_name="stub", api_key=api_key, health_check=False)]

    env = KeylessEnv()  # The OpenAI SDK refuses to build a client without a key: this raised before.

    async def ask() -> Any:
        try:
            return await env.server.chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        finally:
            await env.close()

    reply = asyncio.run(ask())
    assert reply.choices[0].message.content == "hello"
    assert seen == [f"Bearer {PLACEHOLDER_API_KEY}"]


def test_server_configs_are_keyless_unless_a_key_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert server_configs("http://127.0.0.1:1/v1", "m")[0].api_key == PLACEHOLDER_API_KEY
    monkeypatch.setenv("FLYWHEEL_TEST_KEY", "sk-test")
    assert server_configs("http://127.0.0.1:1/v1", "m", "FLYWHEEL_TEST_KEY")[0].api_key == "sk-test"
    monkeypatch.delenv("FLYWHEEL_TEST_KEY")
    with pytest.raises(ValueError, match="FLYWHEEL_TEST_KEY"):
        server_configs("http://127.0.0.1:1/v1", "m", "FLYWHEEL_TEST_KEY")
