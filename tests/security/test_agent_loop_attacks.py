"""Replies built to break the agent loop, and a hypothesis fuzz of malformed replies.

Each reply plays a model (or a server) gone wrong: numbers the tools cannot take (`Infinity`,
`1e999`), lone surrogates that cannot be UTF-8, a 1 MB reply of thousands of tool calls, deep
nesting. The loop must turn every one into a tool error the model sees, and leave a conversation
that tokenises and writes to JSONL. The tools and the sandbox are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flywheel.environments.agent.policies import ScriptedPolicy
from flywheel.environments.agent.tools import resolve_toolsets
from flywheel.environments.agent_loop import DEFAULT_MAX_TOOL_CALLS_PER_REPLY, AgentResult, HermesAgentLoop
from flywheel.environments.tool_context import ToolContext, live_task_ids, release
from flywheel.environments.tool_use_chain import ToolUseChainEnv

TOOLS = resolve_toolsets(["terminal", "file"])
CAP = DEFAULT_MAX_TOOL_CALLS_PER_REPLY


class _Replies:
    """A chat server that sends `replies` (raw text, or a message with native `tool_calls`), then stops."""

    def __init__(self, *replies: str | SimpleNamespace) -> None:
        self.replies = replies

    async def chat_completion(self, **kwargs: Any) -> Any:
        step = sum(1 for m in kwargs["messages"] if m["role"] == "assistant")
        reply = self.replies[step] if step < len(self.replies) else "Done."
        message = SimpleNamespace(content=reply, tool_calls=None) if isinstance(reply, str) else reply
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")], usage=None)


def _call(name: str, arguments: str) -> str:
    """A Hermes tool call with `arguments` as raw JSON text (so it can hold what json.dumps won't write)."""
    return f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {arguments}}}</tool_call>'


def _run(server: Any, task_id: str, max_turns: int = 4, look: Any = None) -> tuple[AgentResult, Any]:
    """Run the loop in a real sandbox; `look(ctx)` inspects the workspace before it is released."""
    loop = HermesAgentLoop(server, [t.schema() for t in TOOLS], {t.name for t in TOOLS}, max_turns, task_id)
    try:
        result = asyncio.run(loop.run([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]))
        return result, look(ToolContext(task_id)) if look else None
    finally:
        release(task_id)


def _utf8_jsonl(value: Any) -> bytes:
    """What a JSONL writer does (ensure_ascii off, UTF-8 out); raises on a lone surrogate."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("timeout", ["Infinity", "1e999", "-Infinity"])
def test_an_infinite_timeout_is_a_tool_error_not_a_crash(timeout: str) -> None:
    server = _Replies(_call("terminal", f'{{"command": "echo hi", "timeout": {timeout}}}'))
    result, _ = _run(server, "attack-timeout")
    assert result.infra_error is None and result.finished_naturally
    assert [e.tool_name for e in result.tool_errors] == ["terminal"]
    assert "should be integer" in result.tool_errors[0].error
    tool_message = next(m for m in result.messages if m["role"] == "tool")
    assert tool_message["content"].startswith("Error: terminal: argument 'timeout'")


def test_an_infinite_timeout_in_one_item_does_not_abort_the_evaluation(tiny_model: Path, tmp_path: Path) -> None:
    env = ToolUseChainEnv(tokenizer_name=str(tiny_model), teacher="oracle", data_dir_to_save_evals=str(tmp_path))

    async def scenario() -> dict[str, float]:
        await env.setup()
        items = env.eval_items[:3]
        attack = _Replies(_call("terminal", '{"command": "true", "timeout": Infinity}'))

        def policy(item: dict[str, Any]) -> Any:
            return attack if item is items[1] else ScriptedPolicy(item["oracle"])

        env.oracle_policy = policy  # type: ignore[method-assign]
        return await env.run_agentic_eval(items)

    metrics = asyncio.run(scenario())
    assert metrics["eval/n"] == 3 and metrics["eval/infra_failures"] == 0
    assert metrics["eval/success_rate"] == 2 / 3  # The attacked item is the model's failure, scored 0.
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [s["reward"] for s in samples].count(0.0) == 1
    assert live_task_ids() == []


_SURROGATE_REPLIES = (
    "Thinking \ud800 hard",  # What the OpenAI client decodes from a `"\ud800"` escape in the server's JSON.
    _call("write_file", '{"path": "s\\ud800.txt", "content": "x\\udfffy"}'),  # An escape in the model's own JSON.
    _call("terminal", '{"command": "touch $\'\\\\xff\'"}') + _call("list_files", "{}"),  # A surrogate from os.listdir.
)


def test_lone_surrogates_reach_neither_the_tokeniser_nor_the_jsonl(tiny_model: Path) -> None:
    env = ToolUseChainEnv(tokenizer_name=str(tiny_model))
    for index, reply in enumerate(_SURROGATE_REPLIES):
        result, _ = _run(_Replies(reply), f"attack-surrogate-{index}")
        assert result.infra_error is None
        _utf8_jsonl(result.messages)
        _utf8_jsonl([e.__dict__ for e in result.tool_errors])
        assert "\ufffd" in json.dumps(result.messages, ensure_ascii=False)
        tokens, masks = env.tokenize_conversation(result.messages, [t.schema() for t in TOOLS])
        assert len(tokens) == len(masks) and any(m != -100 for m in masks)


def test_lone_surrogates_do_not_break_samples_jsonl(tiny_model: Path, tmp_path: Path) -> None:
    env = ToolUseChainEnv(tokenizer_name=str(tiny_model), teacher="oracle", data_dir_to_save_evals=str(tmp_path))

    async def scenario() -> dict[str, float]:
        await env.setup()
        replies = (_SURROGATE_REPLIES[1], _SURROGATE_REPLIES[0])  # A bad call, then a bad final answer.
        env.oracle_policy = lambda item: _Replies(*replies)  # type: ignore[method-assign]
        return await env.run_agentic_eval(env.eval_items[:2])

    metrics = asyncio.run(scenario())
    assert metrics["eval/n"] == 2 and metrics["eval/infra_failures"] == 0
    lines = (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2 and all("\ufffd" in json.dumps(json.loads(line), ensure_ascii=False) for line in lines)


def test_a_one_megabyte_reply_runs_only_the_capped_number_of_calls() -> None:
    reply = "".join(_call("write_file", f'{{"path": "f{i}.txt", "content": "x"}}') for i in range(14_364))
    assert len(reply) > 1_000_000

    def written(ctx: ToolContext) -> list[str]:
        return ctx.list_files(".")

    result, files = _run(_Replies(reply), "attack-flood", look=written)
    assert sorted(files) == sorted(f"f{i}.txt" for i in range(CAP))
    assistant = next(m for m in result.messages if m["role"] == "assistant")
    assert len(assistant["tool_calls"]) == CAP
    assert sum(1 for m in result.messages if m["role"] == "tool") == CAP
    assert [e.tool_name for e in result.tool_errors] == ["<too many calls>"]
    notice = next(m for m in result.messages if m["role"] == "user" and m["content"].startswith("Tool call error"))
    assert f"only {CAP} tool calls per reply are run; this reply had 14364" in notice["content"]


def test_deep_nesting_and_huge_numbers_are_tool_errors() -> None:
    deep = "[" * 200 + "]" * 200
    server = _Replies(
        _call("write_file", f'{{"path": "a.txt", "content": {deep}}}'),
        _call("write_file", f'{{"path": "a.txt", "content": {"[" * 5000 + "]" * 5000}}}'),
        _call("read_file", f'{{"path": {"9" * 5000}}}'),
    )
    result, _ = _run(server, "attack-deep", max_turns=5)
    assert result.infra_error is None and result.finished_naturally
    assert len(result.tool_errors) == 3 and "nest deeper" in result.tool_errors[0].error
    _utf8_jsonl(result.messages)


# -- the fuzz ------------------------------------------------------------------------------------

_RAW = (
    "Infinity", "-Infinity", "NaN", "1e999", "-0", "9" * 5000, '"\\ud800"', '"a\\udfffb"', '"\\u0000"',
    "null", "true", "[]", "{}", "[" * 40 + "]" * 40, "[" * 3000, '"<tool_call>"', '"../../etc/passwd"',
)  # fmt: skip
_COMMANDS = ("true", "echo hi", "printf '\\xff\\xfe'", "touch $'\\xff'", "ls -la", "echo \ud800")
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
_value = st.one_of(st.sampled_from(_RAW), _json.map(json.dumps))  # Raw JSON text, valid or not.
_path = st.sampled_from(["a.txt", "d/b.txt", "../out.txt", "/etc/passwd", "\ud800.txt", "", "."]).map(json.dumps)
_file_call = st.tuples(
    st.sampled_from(["read_file", "write_file", "list_files"]),
    st.dictionaries(st.sampled_from(["path", "content", "extra"]), _path | _value, max_size=3),
)
_terminal_call = st.tuples(
    st.just("terminal"),
    st.fixed_dictionaries({"command": st.sampled_from(_COMMANDS).map(json.dumps)}, optional={"timeout": _value}),
)
_unknown_call = st.tuples(
    st.text(max_size=12) | st.sampled_from(["", "nope", "\ud800"]), st.dictionaries(st.text(max_size=4), _value)
)
_terminal_calls = st.one_of(st.just([]), st.just([]), st.just([]), st.lists(_terminal_call, min_size=1, max_size=1))
_calls = st.tuples(st.lists(_file_call | _unknown_call, max_size=12), _terminal_calls, st.integers(0, 12)).map(
    lambda parts: parts[0][: parts[2]] + parts[1] + parts[0][parts[2] :]
)  # Commands spawn processes (slow): a terminal call in about one reply in four.


def _arguments_text(arguments: dict[str, str]) -> str:
    return "{" + ", ".join(f"{json.dumps(key)}: {value}" for key, value in arguments.items()) + "}"


@st.composite
def _reply(draw: st.DrawFn) -> str | SimpleNamespace:
    """One malformed reply: text with Hermes calls (whole, cut short, nested) or native tool_calls."""
    calls = draw(_calls)
    shape = draw(st.sampled_from(["text", "text", "cut", "nested", "native"]))
    if shape == "native":
        entries = [
            SimpleNamespace(function=SimpleNamespace(name=name, arguments=_arguments_text(arguments)))
            for name, arguments in calls
        ]
        return SimpleNamespace(content=draw(st.text(max_size=10)), tool_calls=entries)
    prefix = draw(st.text(max_size=20) | st.sampled_from(["\ud800", "ok \udfff"]))
    text = prefix + "".join(_call(name, _arguments_text(arguments)) for name, arguments in calls)
    if shape == "cut":
        return text[: draw(st.integers(0, len(text)))]
    if shape == "nested":
        return _call("write_file", '{"path": "n.txt", "content": ' + text)
    return text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(replies=st.lists(_reply(), min_size=1, max_size=3))
def test_no_malformed_reply_breaks_the_loop(replies: list[str | SimpleNamespace]) -> None:
    task_id = f"fuzz-{uuid.uuid4().hex[:8]}"
    result, _ = _run(_Replies(*replies), task_id, max_turns=4)
    assert result.infra_error is None and 1 <= result.turns_used <= 4
    _utf8_jsonl(result.messages)
    _utf8_jsonl([e.__dict__ for e in result.tool_errors])
    tool_messages = [m["content"] for m in result.messages if m["role"] == "tool"]
    for error in result.tool_errors:
        if not error.tool_name.startswith("<"):  # A failed call: the model saw its error as the result.
            assert f"Error: {error.error}" in tool_messages
    turns = _split_turns(result.messages)
    for assistant, answers in turns:
        assert len(answers) == len(assistant.get("tool_calls", [])) <= CAP
    reported = sum(1 for m in result.messages if m["role"] == "user" and m["content"].startswith("Tool call error"))
    assert reported == len({e.turn for e in result.tool_errors if e.tool_name.startswith("<")})
    assert task_id not in live_task_ids()


def _split_turns(messages: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each assistant message with the tool messages that answer it."""
    turns: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for message in messages:
        if message["role"] == "assistant":
            turns.append((message, []))
        elif message["role"] == "tool":
            turns[-1][1].append(message)
    return turns


def test_a_flood_of_unparsable_calls_records_a_capped_number_of_errors() -> None:
    """100,000 `<tool_call>x</tool_call>` in one reply: the cap's worth of parse errors and one line for the rest."""
    result, _ = _run(_Replies("<tool_call>x</tool_call>" * 100_000), "attack-parse-flood", max_turns=2)
    parse_errors = [e for e in result.tool_errors if e.tool_name == "<parse>"]
    assert len(parse_errors) == CAP + 1 and "and 99" in parse_errors[-1].error
    assert len(_utf8_jsonl([e.error for e in result.tool_errors])) < 100_000  # Was a 10 MB rollout line.


def test_the_gym_view_refuses_a_step_after_done_and_sanitises_observations() -> None:
    """After done a step raises (it ran tools and scored again); a file name that is not UTF-8 reaches the
    observation as U+FFFD, so `json.dumps(...).encode()` of it works."""
    env = ToolUseChainEnv(num_tasks=10)
    try:
        env.reset(0)
        env.step({"tool": "terminal", "arguments": {"command": "touch \"$(printf 'bad\\377name')\""}})
        listed = env.step({"tool": "list_files", "arguments": {"path": "."}})
        assert "\ufffd" in listed.next_state.observation
        json.dumps(listed.next_state.messages).encode()
        assert env.step("Done.").done
        with pytest.raises(RuntimeError, match="the episode is over"):
            env.step({"tool": "write_file", "arguments": {"path": "late.txt", "content": "x"}})
        env.reset(1)  # A new episode steps again.
        assert not env.step({"tool": "list_files", "arguments": {"path": "."}}).done
    finally:
        env.shutdown()
    assert live_task_ids() == []
