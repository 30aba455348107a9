"""Inference servers: a keyless local server works without an API key (vLLM's docs use "EMPTY")."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from atroposlib.envs.base import APIServerConfig

from flywheel.environments.agent.servers import PLACEHOLDER_API_KEY, server_configs
from flywheel.environments.custom.file_stats_env import FileStatsEnv, FileStatsEnvConfig
from tests.environments.conftest import chat_reply


@pytest.fixture
def keyless_server(fake_openai: Any) -> tuple[str, list[dict[str, str]]]:
    """A stub that checks no key; its URL and the headers of the requests it saw."""
    seen: list[dict[str, str]] = []
    return fake_openai(lambda path, body: chat_reply("hello"), seen), seen


@pytest.mark.parametrize("api_key", [None, ""])
def test_an_env_whose_config_init_has_no_api_key_talks_to_a_keyless_server(
    keyless_server: tuple[str, list[dict[str, str]]], tiny_model: Path, api_key: str | None
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
    assert [h.get("authorization") for h in seen] == [f"Bearer {PLACEHOLDER_API_KEY}"]


def test_server_configs_are_keyless_unless_a_key_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert server_configs("http://127.0.0.1:1/v1", "m")[0].api_key == PLACEHOLDER_API_KEY
    monkeypatch.setenv("FLYWHEEL_TEST_KEY", "sk-test")
    assert server_configs("http://127.0.0.1:1/v1", "m", "FLYWHEEL_TEST_KEY")[0].api_key == "sk-test"
    monkeypatch.delenv("FLYWHEEL_TEST_KEY")
    with pytest.raises(ValueError, match="FLYWHEEL_TEST_KEY"):
        server_configs("http://127.0.0.1:1/v1", "m", "FLYWHEEL_TEST_KEY")
