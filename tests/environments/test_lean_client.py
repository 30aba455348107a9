"""The lean client sends what the OpenAI SDK sends and gives back what the SDK gives back: the same
reply objects, and on an HTTP error the same `status_code`, `message` and `body`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from flywheel.environments.agent.lean_client import APIStatusError, LeanOpenAIClient
from flywheel.environments.agent_loop import HermesAgentLoop
from flywheel.environments.errors import ToolParseError
from flywheel.environments.tool_use_chain import ToolUseChainEnv
from tests.environments.conftest import completion

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "list_files", "arguments": '{"path": "."}'}}
ERRORS = {
    "/v1/chat/completions/json": (400, {"error": {"message": "could not parse tool call", "code": 400}}),
    "/v1/chat/completions/plain": (503, "upstream down"),
    "/v1/chat/completions/nomessage": (422, {"detail": ["bad"]}),
}


def _handle(path: str, body: dict[str, Any]) -> tuple[int, Any]:
    if path in ERRORS:
        return ERRORS[path]
    if path.endswith("/completions") and "prompt" in body:
        return 200, completion("text_completion", {"index": 0, "text": body["prompt"][::-1], "finish_reason": "stop"})
    message = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
    return 200, completion("chat.completion", {"index": 0, "message": message, "finish_reason": "tool_calls"})


async def _both(url: str, call: Any) -> tuple[Any, Any]:
    """`call(client)` through the SDK and through the lean client."""
    sdk = openai.AsyncClient(base_url=url, api_key="k", max_retries=0)
    lean = LeanOpenAIClient(url, "k", 30)
    try:
        results = []
        for client in (sdk, lean):
            try:
                results.append(await call(client))
            except Exception as err:  # Compared below.
                results.append(err)
        return results[0], results[1]
    finally:
        await sdk.close()
        await lean.close()


def test_requests_and_replies_match_the_sdks(fake_openai: Any) -> None:
    seen: list[dict[str, str]] = []
    bodies: list[dict[str, Any]] = []
    url = fake_openai(lambda path, body: bodies.append(body) or _handle(path, body), seen)
    kwargs = {
        "model": "m", "messages": [{"role": "user", "content": "hi ✓"}], "max_tokens": 8, "temperature": 0.5,
        "tools": [{"type": "function", "function": {"name": "list_files", "parameters": {"type": "object"}}}],
        "extra_body": {"top_k": 20},
    }  # fmt: skip
    sdk, lean = asyncio.run(_both(url, lambda c: c.chat.completions.create(**kwargs)))
    assert bodies[0] == bodies[1] and bodies[1]["top_k"] == 20 and "extra_body" not in bodies[1]
    assert seen[1]["authorization"] == seen[0]["authorization"] == "Bearer k"
    assert type(lean) is type(sdk) and lean.model_dump() == sdk.model_dump()
    assert lean.choices[0].message.tool_calls[0].function.name == "list_files"
    sdk, lean = asyncio.run(_both(url, lambda c: c.completions.create(model="m", prompt="abc", max_tokens=3)))
    assert type(lean) is type(sdk) and lean.choices[0].text == sdk.choices[0].text == "cba"


@pytest.mark.parametrize("path", sorted(ERRORS))
def test_http_errors_carry_what_the_sdks_errors_carry(fake_openai: Any, path: str) -> None:
    route, body = path.removeprefix("/v1"), {"model": "m", "messages": []}

    async def call(client: Any) -> Any:  # The SDK's own request path, under its typed `create`.
        if isinstance(client, LeanOpenAIClient):
            return await client.post(route, body)
        return await client.post(route, cast_to=object, body=body)

    sdk, lean = asyncio.run(_both(fake_openai(_handle), call))
    assert isinstance(sdk, openai.APIStatusError) and isinstance(lean, APIStatusError)
    assert (lean.status_code, lean.message, lean.body) == (sdk.status_code, sdk.message, sdk.body)


def test_a_server_that_cannot_parse_the_tool_call_is_the_models_fault(fake_openai: Any, tiny_model: Path) -> None:
    """The agent loop reads the lean client's error as it read the SDK's: a tool-call parse failure is a
    reply the model sees, not an infra failure."""
    url = fake_openai(lambda path, body: ERRORS["/v1/chat/completions/json"])
    env = ToolUseChainEnv(tokenizer_name=str(tiny_model), inference_retries=0)
    client = env.server.servers[0].openai
    assert isinstance(client, LeanOpenAIClient)
    client.base_url = url
    loop = HermesAgentLoop(env.server, [], [], max_turns=1, task_id="lean", inference_retries=0)

    async def complete() -> Any:
        try:
            return await loop._complete([{"role": "user", "content": "hi"}])
        finally:
            await env.close()

    with pytest.raises(ToolParseError, match="could not parse tool call"):
        asyncio.run(complete())
