"""Parsers: each format round-trips, and garbage never raises (fuzzed with hypothesis)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flywheel.environments.agent.policies import ScriptedPolicy
from flywheel.environments.agent.tools import TOOLSETS
from flywheel.environments.agent_loop import HermesAgentLoop
from flywheel.environments.tool_call_parsers import PARSERS, get_parser
from flywheel.environments.tool_context import live_task_ids


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_format_round_trips(name: str) -> None:
    parser = get_parser(name)
    arguments = {"path": "a/b.txt", "content": 'quote " and <tags>', "n": 3, "nested": {"x": [1, 2]}}
    parsed = parser.parse(parser.tool_call_text("write_file", arguments))
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("write_file", arguments)]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_format_round_trips_a_batch_of_calls(name: str) -> None:
    """An oracle's batch is written so that its own parser reads back every call, in order."""
    parser = get_parser(name)
    calls = [("write_file", {"path": "a.txt", "content": "x; {y}"}), ("read_file", {"path": "a.txt"}), ("ls", {})]
    parsed = parser.parse(parser.tool_calls_text(calls))
    assert parsed.errors == [] and [(c.name, c.arguments) for c in parsed.tool_calls] == calls


def test_hermes_multiple_calls_and_content() -> None:
    parser = get_parser("hermes")
    text = (
        'Let me look.\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>\n'
        '<tool_call>{"name": "cat", "arguments": "{\\"path\\": \\"x\\"}"}</tool_call>'
    )
    parsed = parser.parse(text)
    assert parsed.content == "Let me look."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("ls", {}), ("cat", {"path": "x"})]


def test_hermes_reports_malformed_calls_without_raising() -> None:
    parsed = get_parser("hermes").parse(
        '<tool_call>{"name": "ls", "arguments": {</tool_call><tool_call>[1]</tool_call>'
    )
    assert parsed.tool_calls == [] and len(parsed.errors) == 2


def test_plain_text_is_content_for_every_parser() -> None:
    for name in PARSERS:
        parsed = get_parser(name).parse("The answer is 42.")
        assert parsed.content == "The answer is 42." and parsed.tool_calls == [] and parsed.errors == []


def test_llama3_json_content_that_is_not_a_call_stays_content() -> None:
    parsed = get_parser("llama3_json").parse('{"answer": 42}')
    assert parsed.tool_calls == [] and parsed.content == '{"answer": 42}'


def test_mistral_list_of_calls() -> None:
    parsed = get_parser("mistral").parse(
        '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 1}}]'
    )
    assert [c.name for c in parsed.tool_calls] == ["a", "b"]


def test_unknown_parser_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


def test_tools_prompt_lists_schemas_and_the_call_format() -> None:
    schemas = [t.schema() for t in TOOLSETS["file"]]
    prompt = get_parser("hermes").render_tools_prompt(schemas)
    assert "<tools>" in prompt and '"read_file"' in prompt and "<tool_call>" in prompt


_fragments = st.sampled_from(
    ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]", '"name"',
     '"arguments"', ":", ",", '"', "null", "1e309", "\\u0000", ";", "\n"]
)  # fmt: skip
_garbage = st.one_of(
    st.text(max_size=300), st.lists(st.one_of(_fragments, st.text(max_size=8)), max_size=40).map("".join)
)


@settings(max_examples=300, deadline=None)
@given(text=_garbage, name=st.sampled_from(sorted(PARSERS)))
def test_garbage_never_raises_from_a_parser(text: str, name: str) -> None:
    parsed = get_parser(name).parse(text)
    assert isinstance(parsed.content, str)
    for call in parsed.tool_calls:
        assert isinstance(call.name, str) and isinstance(call.arguments, dict)


class _Garbage(ScriptedPolicy):
    def __init__(self, texts: list[str]) -> None:
        super().__init__([])
        self.texts = texts

    async def chat_completion(self, **kwargs):  # type: ignore[override]
        reply = await super().chat_completion(**kwargs)
        step = sum(1 for m in kwargs["messages"] if m.get("role") == "assistant")
        reply.choices[0].message.content = self.texts[step % len(self.texts)]
        return reply


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(_garbage, min_size=1, max_size=4), name=st.sampled_from(sorted(PARSERS)))
def test_garbage_never_raises_out_of_a_rollout(texts: list[str], name: str) -> None:
    tools = TOOLSETS["file"]
    loop = HermesAgentLoop(
        _Garbage(texts),
        [t.schema() for t in tools],
        {t.name for t in tools},
        4,
        "fuzz",
        tool_call_parser=name,
    )
    try:
        result = asyncio.run(loop.run([{"role": "user", "content": "go"}]))
    finally:
        from flywheel.environments.tool_context import release

        release("fuzz")
    assert result.infra_error is None and 1 <= result.turns_used <= 4
    assert "fuzz" not in live_task_ids()
