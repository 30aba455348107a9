"""Honest failure accounting: a reply the model wrote is the model's, whatever the server made of it.

A fake OpenAI-compatible server on 127.0.0.1 plays the model. Like `transformers serve`, it
parses tool calls itself and answers an opaque HTTP 500 when the model's call is malformed, while
its raw `/v1/completions` endpoint returns the text. Only a server that is down or fails
well-formed requests is infra; infra failures count in training rates, never in evaluation's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from flywheel.environments.agent.policies import ScriptedPolicy
from flywheel.environments.agent.tools import TOOLSETS
from flywheel.environments.agent_loop import HermesAgentLoop
from flywheel.environments.tool_context import live_task_ids, release
from flywheel.environments.tool_use_chain import ToolUseChainEnv
from tests.environments.conftest import completion

UNTERMINATED = '<tool_call>{"name": "write_file", "arguments": {"path": "a.txt", "content": "oops}'
PARSE_ERROR = 'json parser could not parse region as JSON.\nContent: \'{"name": "write_file"...\''


# The 400s of a conversation longer than the model's context, as each server words it.
CONTEXT_FULL = {
    "transformers-full": {"detail": "The prompt has 8300 tokens, but the model takes at most 8192, prompt and answer "
                          "(`--max-model-len`)."},
    "vllm-full": {"object": "error", "message": "This model's maximum context length is 8192 tokens. However, you "
                  "requested 8300 tokens (8044 in the messages, 256 in the completion).", "code": 400},
}  # fmt: skip


class _Model:
    """What the fake server answers. `mode`: `transformers` (opaque 500 on a malformed call, raw text
    on /v1/completions), `named` (a 500 whose body names the parse failure), `broken` (500 always),
    or a `CONTEXT_FULL` server (its 400 always)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests: list[str] = []

    def reply(self, assistant_turns: int) -> str:
        return UNTERMINATED if assistant_turns == 0 else "I give up."

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any] | str]:
        self.requests.append(path)
        if self.mode == "broken":
            return 500, "Internal Server Error"
        if self.mode in CONTEXT_FULL:
            return 400, CONTEXT_FULL[self.mode]
        if path.endswith("/chat/completions"):
            text = self.reply(sum(m["role"] == "assistant" for m in body["messages"]))
            if text.startswith("<tool_call>"):  # The server's own tool parser raises on it.
                return (500, "Internal Server Error") if self.mode == "transformers" else (500, {"error": PARSE_ERROR})
            message = {"role": "assistant", "content": text}
            return 200, completion("chat.completion", {"index": 0, "message": message, "finish_reason": "stop"})
        if path.endswith("/completions") and self.mode == "transformers":
            text = self.reply(body["prompt"].count("<|im_start|>assistant") - 1)
            return 200, completion("text_completion", {"index": 0, "text": text, "finish_reason": "stop"})
        return 404, {"error": "not found"}


@pytest.fixture
def serve(fake_openai: Any) -> Any:
    """`serve(mode)` -> (base_url, model); servers stop after the test."""

    def start(mode: str) -> tuple[str, _Model]:
        model = _Model(mode)
        return fake_openai(model.handle), model

    return start


class _Client:
    """atroposlib's server surface (`chat_completion`, `completion`) over a real OpenAI client."""

    def __init__(self, base_url: str) -> None:
        self.client = openai.AsyncClient(base_url=base_url, api_key="x", max_retries=0, timeout=10)
        self.servers: list[Any] = []  # The ServerManager attribute evaluation logging reads.

    async def chat_completion(self, **kwargs: Any) -> Any:
        return await self.client.chat.completions.create(model="fake", **kwargs)

    async def completion(self, **kwargs: Any) -> Any:
        return await self.client.completions.create(model="fake", **kwargs)


def _chatml(messages: list[dict[str, Any]]) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _run(base_url: str, render: bool = True) -> Any:
    tools = TOOLSETS["file"]
    loop = HermesAgentLoop(
        _Client(base_url), [t.schema() for t in tools], {t.name for t in tools}, 4, "accounting-test", tools=tools,
        temperature=0.0, inference_retries=1, render_prompt=_chatml if render else None,
    )  # fmt: skip
    try:
        return asyncio.run(loop.run([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]))
    finally:
        release("accounting-test")


def test_a_tool_call_the_server_cannot_parse_is_the_models_reply_and_only_a_failing_server_is_infra(
    serve: Any,
) -> None:
    url, model = serve("transformers")  # Opaque 500: the raw endpoint shows the reply was the model's.
    result = _run(url)
    assert result.infra_error is None and result.finished_naturally
    assert [e.tool_name for e in result.tool_errors] == ["<parse>"]  # Our parser read the raw text.
    assert "could not parse tool call JSON" in result.tool_errors[0].error and '"oops}' in result.tool_errors[0].error
    assert result.messages[3]["content"].startswith("Tool call error:")
    assert result.messages[-1] == {"role": "assistant", "content": "I give up."}

    url, model = serve("named")  # The body names the parse failure: no retry, no raw request needed.
    result = _run(url, render=False)
    assert result.infra_error is None and result.finished_naturally
    assert "could not parse region" in result.tool_errors[0].error
    assert result.messages[3]["content"].startswith("Tool call error: the server could not parse your tool call")
    assert model.requests == ["/v1/chat/completions"] * 2

    url, model = serve("broken")  # Chat and raw both fail a well-formed request: the server's fault.
    result = _run(url)
    assert result.infra_error and "500" in result.infra_error and result.turns_used == 0
    assert model.requests == ["/v1/chat/completions", "/v1/completions"] * 2

    down = _run(url.replace(url.split(":")[-1].split("/")[0], "9"))  # Nothing listens on port 9.
    assert down.infra_error and "Connection" in down.infra_error


@pytest.mark.parametrize("server", sorted(CONTEXT_FULL))
def test_a_conversation_over_the_models_context_ends_the_episode_not_as_infra(serve: Any, server: str) -> None:
    """A policy must not escape a failing score by talking past its context: the episode ends there and is
    judged, with no retry (the same request would fail the same way)."""
    url, model = serve(server)
    result = _run(url)
    assert result.infra_error is None and result.context_full and not result.finished_naturally
    assert result.turns_used == 0 and model.requests == ["/v1/chat/completions"]


def test_a_model_that_writes_an_unterminated_tool_call_scores_0_not_none(
    serve: Any, tiny_model: Path, tmp_path: Path
) -> None:
    url, _ = serve("transformers")
    env = ToolUseChainEnv(tokenizer_name=str(tiny_model), data_dir_to_save_evals=str(tmp_path), inference_retries=0)

    async def scenario() -> dict[str, float]:
        await env.setup()
        env.server = _Client(url)  # type: ignore[assignment]
        return await env.run_agentic_eval(env.eval_items[:2])

    metrics = asyncio.run(scenario())
    assert metrics["eval/infra_failures"] == 0 and metrics["eval/n"] == 2 and metrics["eval/mean_reward"] == 0.0
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [s["reward"] for s in samples] == [0.0, 0.0]
    assert all(s["tool_errors"][0]["tool_name"] == "<parse>" for s in samples)
    assert live_task_ids() == []


class _DownOnce:
    """The first request fails for good (that rollout is an infra failure); the rest get the oracle."""

    def __init__(self, oracle: list[dict[str, Any]]) -> None:
        self.oracle = oracle
        self.calls = 0
        self.servers: list[Any] = []

    async def chat_completion(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise ConnectionError("connection refused")
        return await ScriptedPolicy(self.oracle).chat_completion(**kwargs)


def test_a_group_keeps_its_scored_rollout_and_only_training_counts_infra_failures(
    tiny_model: Path, tmp_path: Path
) -> None:
    env = ToolUseChainEnv(
        tokenizer_name=str(tiny_model), data_dir_to_save_evals=str(tmp_path), group_size=2, inference_retries=0
    )

    async def scenario() -> Any:
        await env.setup()
        item = env.stream.item(0)
        env.server = _DownOnce(item["oracle"])  # type: ignore[assignment]
        group, _ = await env.collect_trajectories(item)
        assert (env._rollouts, env._infra_failures) == (2, 1)
        items = [dict(i) for i in env.eval_items[:2]]
        items[0]["setup_commands"] = ["exit 3"]  # An evaluation infra failure.
        metrics = await env.run_agentic_eval(items)
        assert (env._rollouts, env._infra_failures) == (2, 1)  # Evaluation left the training counters alone.
        return group, metrics

    group, metrics = asyncio.run(scenario())
    assert group["meta"]["completed"] == [True] and len(group["tokens"]) == 1
    assert group["scores"] == [1.0 - 0.01 * group["meta"]["turns_used"][0]]  # tool_use_chain's efficiency term.
    assert group["group_overrides"] == {"group_size": 1} and group["meta"]["infra_failures"] == 1
    assert metrics["eval/infra_failures"] == 1 and metrics["eval/infra_failure_rate"] == 0.5
    assert live_task_ids() == []
