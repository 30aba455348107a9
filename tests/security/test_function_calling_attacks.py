"""Hostile replies to FunctionCallingEnv: deep nesting, numbers of 400 digits, NaN, huge strings, duplicate keys,
a thousand calls, calls to a shell. Each earns reward 0 with no exception and no infra failure, whether it comes
through the agent loop (raw model text) or as a hand-built conversation (`reset`/`step`, a hand-written loop)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from flywheel.environments.agent.policies import ScriptedPolicy, final
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.function_calling import FunctionCallingEnv

Item = dict[str, Any]
DEEP = 100_000


@pytest.fixture(scope="module")
def env(function_calling_env: FunctionCallingEnv) -> FunctionCallingEnv:
    return function_calling_env


@pytest.fixture(scope="module")
def task(env: FunctionCallingEnv) -> Item:
    """A one-call task whose answer has an integer argument (the attacks' target) and a string one."""

    def fits(item: Item) -> bool:
        calls = item["answer"]["calls"]
        types = {json.dumps(v)[0] for v in calls[0]["arguments"].values()} if len(calls) == 1 else set()
        return (
            any(isinstance(v, int) and not isinstance(v, bool) for v in calls[0]["arguments"].values()) and '"' in types
        )

    return next(item for item in env.stream.items(200) if item["category"] == "single" and fits(item))


@pytest.fixture(scope="module")
def refusal(env: FunctionCallingEnv) -> Item:
    return next(item for item in env.stream.items(200) if not item["answer"]["calls"])


def _call(item: Item) -> tuple[str, dict[str, Any]]:
    call = item["answer"]["calls"][0]
    return call["name"], dict(call["arguments"])


def _int_key(item: Item) -> str:
    return next(k for k, v in _call(item)[1].items() if type(v) is int)


def _str_key(item: Item) -> str:
    return next(k for k, v in _call(item)[1].items() if type(v) is str)


def _block(name: str, arguments_json: str) -> str:
    """One Hermes call with its arguments as raw JSON text (so the text can be anything)."""
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments_json}}}\n</tool_call>'


def _with(item: Item, key: str, raw_value: str) -> str:
    """The right call with the argument `key` replaced by the raw JSON text `raw_value`."""
    name, arguments = _call(item)
    others = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in arguments.items() if k != key)
    return _block(name, "{" + (others + ", " if others else "") + f"{json.dumps(key)}: {raw_value}" + "}")


def _right(item: Item) -> str:
    name, arguments = _call(item)
    return _block(name, json.dumps(arguments))


# name -> (which task, the model's replies): raw text through the agent loop.
LOOP_ATTACKS: dict[str, tuple[str, Callable[[Item], list[str]]]] = {
    "nested_40_deep": ("task", lambda t: [_with(t, _int_key(t), "[" * 40 + "1" + "]" * 40), "Done."]),
    "nested_100000_deep": ("task", lambda t: [_with(t, _int_key(t), "[" * DEEP), "Done."]),
    "objects_100000_deep": ("task", lambda t: [_with(t, _int_key(t), '{"a":' * DEEP), "Done."]),
    "integer_of_400_digits": ("task", lambda t: [_with(t, _int_key(t), "1" + "0" * 400), "Done."]),
    "integer_of_5000_digits": ("task", lambda t: [_with(t, _int_key(t), "-" + "9" * 5000), "Done."]),
    "integer_of_17_digits": ("task", lambda t: [_with(t, _int_key(t), "1" * 17), "Done."]),
    "nan": ("task", lambda t: [_with(t, _int_key(t), "NaN"), "Done."]),
    "infinity": ("task", lambda t: [_with(t, _int_key(t), "-Infinity"), "Done."]),
    "float_overflowing_to_infinity": ("task", lambda t: [_with(t, _int_key(t), "1e400"), "Done."]),
    "string_of_2_mib": ("task", lambda t: [_with(t, _str_key(t), json.dumps("x" * (1 << 21))), "Done."]),
    "nul_in_a_string": (
        "task",
        lambda t: [_with(t, _str_key(t), json.dumps(_call(t)[1][_str_key(t)] + "\x00")), "Done."],
    ),
    "lone_surrogate_in_a_string": ("task", lambda t: [_with(t, _str_key(t), '"\\ud800"'), "Done."]),
    "duplicate_key_last_one_a_string": (
        "task",
        lambda t: [
            _with(t, _int_key(t), f'{_call(t)[1][_int_key(t)]}, "{_int_key(t)}": "{_call(t)[1][_int_key(t)]}"'),
            "Done.",
        ],
    ),
    "boolean_for_an_integer": ("task", lambda t: [_with(t, _int_key(t), "true"), "Done."]),
    "the_right_call_1000_times": ("task", lambda t: ["\n".join([_right(t)] * 1000), "Done."]),
    "1000_unparsable_calls_and_the_right_one": (
        "task",
        lambda t: [_right(t) + "\n" + "<tool_call>{not json</tool_call>\n" * 1000, "Done."],
    ),
    "the_right_call_then_again": ("task", lambda t: [_right(t), _right(t), "Done."]),
    "arguments_a_list": ("task", lambda t: [_block(_call(t)[0], "[1, 2, 3]"), "Done."]),
    "arguments_null": ("task", lambda t: [_block(_call(t)[0], "null"), "Done."]),
    "arguments_a_string_of_a_list": ("task", lambda t: [_block(_call(t)[0], json.dumps("[1]")), "Done."]),
    "a_name_of_10000_characters": ("task", lambda t: [_block("f" * 10_000, json.dumps(_call(t)[1])), "Done."]),
    "a_shell_command_instead": ("task", lambda t: [_block("terminal", '{"command": "touch pwned"}'), "Done."]),
    "unparsable_call_on_an_irrelevance_task": ("refusal", lambda t: ['<tool_call>{"name": "x", "arguments": {', "No."]),
    "empty_reply_on_an_irrelevance_task": ("refusal", lambda t: ["   "]),
    "final_text_of_2_mib_on_an_irrelevance_task": ("refusal", lambda t: ["no " * (1 << 20)]),
}


@pytest.mark.parametrize("name", sorted(LOOP_ATTACKS))
def test_a_hostile_reply_through_the_loop_earns_nothing(
    env: FunctionCallingEnv, task: Item, refusal: Item, name: str
) -> None:
    which, replies = LOOP_ATTACKS[name]
    item = task if which == "task" else refusal
    env.oracle_policy = lambda _: ScriptedPolicy([final(r) for r in replies(item)])  # type: ignore[method-assign]
    before = env.verifier_errors
    try:
        result, reward = asyncio.run(env.run_agent(item, 0.0))
    finally:
        del env.oracle_policy
    assert reward == 0.0 and result.infra_error is None and result.task_completed is False, name
    assert env.verifier_errors == before  # Judged by the verifier itself: nothing raised out of it.


def test_the_attacks_target_a_task_the_right_reply_solves(env: FunctionCallingEnv, task: Item) -> None:
    """The control: the same reply builder with the right value passes, so each attack fails on its own change."""
    key = _int_key(task)
    env.oracle_policy = lambda _: ScriptedPolicy([final(_with(task, key, str(_call(task)[1][key]))), final("Done.")])  # type: ignore[method-assign]
    try:
        result, reward = asyncio.run(env.run_agent(task, 0.0))
    finally:
        del env.oracle_policy
    assert result.task_completed and reward == pytest.approx(0.98)


def test_a_shell_call_runs_nothing(env: FunctionCallingEnv, task: Item) -> None:
    env.oracle_policy = lambda _: ScriptedPolicy([final(_block("terminal", '{"command": "echo hi"}')), final("x")])  # type: ignore[method-assign]
    try:
        result, _ = asyncio.run(env.run_agent(task, 0.0))
    finally:
        del env.oracle_policy
    assert [e.tool_name for e in result.tool_errors] == ["terminal"] and "unknown tool" in result.tool_errors[0].error


def _deep_dict(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def _circular() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["self"] = value
    return value


def _duplicated(item: Item) -> str:
    """The right arguments as JSON text with the integer argument given twice, the same value both times."""
    arguments, key = _call(item)[1], _int_key(item)
    return json.dumps(arguments)[:-1] + f", {json.dumps(key)}: {arguments[key]}}}"


def _message(tool_calls: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": tool_calls}


def _entry(name: Any, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# name -> a conversation built by hand (the gym's `score`, a hand-written loop): never through a parser.
HAND_BUILT: dict[str, Callable[[Item], Any]] = {
    "messages_not_a_list": lambda t: {"role": "assistant"},
    "tool_calls_not_a_list": lambda t: [_message("call everything")],
    "a_call_not_an_object": lambda t: [_message([42])],
    "a_call_without_a_name": lambda t: [_message([_entry(None, "{}")])],
    "arguments_an_integer": lambda t: [_message([_entry(_call(t)[0], 7)])],
    "arguments_text_not_json": lambda t: [_message([_entry(_call(t)[0], "{'a': 1}")])],
    "arguments_text_with_duplicate_keys": lambda t: [_message([_entry(_call(t)[0], _duplicated(t))])],
    "arguments_dict_with_nan": lambda t: [_message([_entry(_call(t)[0], {**_call(t)[1], _int_key(t): float("nan")})])],
    "arguments_dict_with_a_5000_digit_integer": lambda t: [
        _message([_entry(_call(t)[0], {**_call(t)[1], _int_key(t): 10**4000 * 10**1000})])
    ],
    "arguments_dict_100000_deep": lambda t: [_message([_entry(_call(t)[0], _deep_dict(DEEP))])],
    "arguments_dict_circular": lambda t: [_message([_entry(_call(t)[0], _circular())])],
    "arguments_dict_with_a_set": lambda t: [_message([_entry(_call(t)[0], {"a": {1, 2}})])],
    "1000_right_calls": lambda t: [_message([_entry(_call(t)[0], json.dumps(_call(t)[1]))] * 1000)],
    "17_replies_of_the_right_call": lambda t: [_message([_entry(_call(t)[0], json.dumps(_call(t)[1]))])] * 17,
    "a_name_of_1_mib": lambda t: [_message([_entry("f" * (1 << 20), "{}")])],
}


@pytest.mark.parametrize("name", sorted(HAND_BUILT))
def test_a_hostile_conversation_is_unjudgeable_not_a_crash(env: FunctionCallingEnv, task: Item, name: str) -> None:
    result = AgentResult(messages=HAND_BUILT[name](task), turns_used=1)
    before = env.verifier_errors
    reward = asyncio.run(env.score_rollout(task, result, None))  # type: ignore[arg-type]
    assert reward == 0.0 and result.task_completed is False and env.verifier_errors == before, name
    assert result.verify_error and result.verify_error.startswith("Unjudgeable"), (name, result.verify_error)


def test_hostile_arguments_in_the_loop_leave_their_reason(env: FunctionCallingEnv, task: Item) -> None:
    """What the loop passes on but no honest answer holds is named in `verify_error` (1e400 is read as
    infinity, which the conversation writes as `Infinity`)."""
    for raw, reason in [("1" + "0" * 400, "digits"), ("NaN", "NaN"), ("1e400", "Infinity")]:
        env.oracle_policy = lambda _, raw=raw: ScriptedPolicy([final(_with(task, _int_key(task), raw)), final("x")])  # type: ignore[method-assign]
        try:
            result, reward = asyncio.run(env.run_agent(task, 0.0))
        finally:
            del env.oracle_policy
        assert reward == 0.0 and reason in (result.verify_error or ""), (raw, result.verify_error)
