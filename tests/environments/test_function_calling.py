"""FunctionCallingEnv: the oracle solves every slice through the real rollout path, near misses earn nothing,
difficulty grows what must be right, teachers stay short, and nothing is shared with the lm-eval suite."""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flywheel.data.curation import CurationConfig, curate
from flywheel.data.text import ngrams
from flywheel.environments.agent.policies import ScriptedPolicy, final
from flywheel.environments.agent.records import content_digest
from flywheel.environments.agent_loop import AgentResult
from flywheel.environments.base import Action
from flywheel.environments.function_calling import FunctionCallingEnv
from flywheel.environments.registry import ENVIRONMENTS, env_class, teacher_turns
from flywheel.environments.task_stream import DIFFICULTIES, TaskStream
from flywheel.environments.tasks import function_calling_tasks as tasks
from flywheel.environments.tool_call_parsers import get_parser
from flywheel.environments.verify.untrusted import Unjudgeable
from flywheel.evaluation.suite import TOOLS, suite_items

Item = dict[str, Any]
HERMES = get_parser("hermes")


@pytest.fixture(scope="module")
def env(function_calling_env: FunctionCallingEnv) -> FunctionCallingEnv:
    return function_calling_env


@pytest.fixture(scope="module")
def items(env: FunctionCallingEnv) -> list[Item]:
    return env.stream.items(360)  # 40 of every slice.


def _rollout(env: FunctionCallingEnv, item: Item, replies: list[str] | None = None) -> tuple[AgentResult, float]:
    """One rollout through `run_agent`: the oracle, or a model that writes `replies` (raw text, one a turn)."""
    if replies is not None:
        env.oracle_policy = lambda _: ScriptedPolicy([final(r) for r in replies])  # type: ignore[method-assign]
    try:
        result, reward = asyncio.run(env.run_agent(item, 0.0))
    finally:
        env.__dict__.pop("oracle_policy", None)
    assert reward is not None, result.infra_error  # A model's answer is never an infra failure.
    return result, reward


def _reply(calls: list[dict[str, Any]]) -> str:
    """The calls as one reply in Hermes text."""
    return "\n".join(HERMES.tool_call_text(c["name"], c["arguments"]) for c in calls)


def _first(items: list[Item], wanted: Callable[[Item], bool]) -> Item:
    return next(item for item in items if wanted(item))


def _schema(item: Item, call: dict[str, Any]) -> dict[str, Any]:
    return next(f["parameters"] for f in item["functions"] if f["name"] == call["name"])


def _keys_of(item: Item, kind: str, **extra: Any) -> list[tuple[int, str]]:
    """(call index, argument) pairs of the answer whose schema has JSON type `kind` (and `extra` fields)."""
    return [
        (index, key)
        for index, call in enumerate(item["answer"]["calls"])
        for key in call["arguments"]
        if _schema(item, call)["properties"][key]["type"] == kind
        and all(k in _schema(item, call)["properties"][key] for k in extra)
    ]


def test_registered_and_without_env_level_tools(env: FunctionCallingEnv) -> None:
    assert ENVIRONMENTS["function_calling"] == "flywheel.environments.function_calling:FunctionCallingEnv"
    assert env_class("function_calling") is FunctionCallingEnv
    assert env._resolve_tools_for_group() == ([], set())  # Nothing in `tools=`: the functions are in the prompt.


@pytest.mark.parametrize("category", tasks.CATEGORIES)
def test_the_oracle_solves_every_slice_in_one_reply(env: FunctionCallingEnv, items: list[Item], category: str) -> None:
    """Three tasks of each difficulty, and a refusal of each difficulty, through the env's rollout path: the
    calls in one reply, each run as a tool (no tool error), then the final words."""
    chosen = [
        i for d in DIFFICULTIES for i in [x for x in items if (x["category"], x["difficulty"]) == (category, d)][:3]
    ]
    if category == "choose_or_refuse":
        chosen += [_first(items, lambda i, d=d: i["category"] == category and i["difficulty"] == d
                          and not i["answer"]["calls"]) for d in DIFFICULTIES]  # fmt: skip
    for item in chosen:
        result, reward = _rollout(env, item)
        replies = [m for m in result.messages if m["role"] == "assistant"]
        expected_turns = 2 if item["answer"]["calls"] else 1
        assert result.task_completed and reward == pytest.approx(1 - 0.01 * expected_turns), item["item_id"]
        made = replies[0].get("tool_calls") or []
        assert len(replies) == expected_turns and len(made) == len(item["answer"]["calls"])
        assert result.tool_errors == [] and result.verify_error is None
        assert all(m["content"] == '{"status": "ok"}' for m in result.messages if m["role"] == "tool")
        unjudged = AgentResult(result.messages, turns_used=result.turns_used)  # Called directly, it verifies first.
        assert asyncio.run(env.compute_reward(item, unjudged, None)) == reward and unjudged.task_completed


def test_the_calls_made_one_per_reply_pass_too(env: FunctionCallingEnv, items: list[Item]) -> None:
    """The oracle's batch unbatched: the same calls one per reply get the same verdict, one turn dearer per
    extra call (the reward prefers the one reply the request asks for)."""
    item = _first(items, lambda i: i["category"] == "parallel" and len(i["answer"]["calls"]) == 4)
    batch, last = item["oracle"]
    env.oracle_policy = lambda _: ScriptedPolicy([*batch["calls"], last])  # type: ignore[method-assign]
    try:
        result, reward = asyncio.run(env.run_agent(item, 0.0))
    finally:
        del env.oracle_policy
    assert result.task_completed and reward == pytest.approx(0.95)


def _set(item: Item, index: int, key: str, value: Any) -> list[dict[str, Any]]:
    calls = copy.deepcopy(item["answer"]["calls"])
    calls[index]["arguments"][key] = value
    return calls


def _near_miss(name: str, items: list[Item]) -> tuple[Item, list[str]]:
    """A task and replies that are nearly its answer."""

    def one(kind: str, fits: Callable[[Any], bool] = lambda value: True, **extra: Any) -> tuple[Item, int, str]:
        """The first answer argument of JSON type `kind` whose value `fits`."""
        return next(
            (item, index, key)
            for item in items
            for index, key in _keys_of(item, kind, **extra)
            if fits(item["answer"]["calls"][index]["arguments"][key])
        )

    calls_of = lambda i: i["answer"]["calls"]  # noqa: E731
    if name == "integer_as_string":
        item, index, key = one("integer")
        return item, [_reply(_set(item, index, key, str(calls_of(item)[index]["arguments"][key]))), "Done."]
    if name == "integer_as_float":
        item, index, key = one("integer")
        return item, [_reply(_set(item, index, key, float(calls_of(item)[index]["arguments"][key]))), "Done."]
    if name == "number_as_string":
        item, index, key = one("number")
        return item, [_reply(_set(item, index, key, str(calls_of(item)[index]["arguments"][key]))), "Done."]
    if name == "boolean_as_string":
        item, index, key = one("boolean")
        value = calls_of(item)[index]["arguments"][key]
        return item, [_reply(_set(item, index, key, "true" if value else "false")), "Done."]
    if name == "enum_in_other_case":
        item, index, key = one("string", enum=True)
        return item, [_reply(_set(item, index, key, calls_of(item)[index]["arguments"][key].capitalize())), "Done."]
    if name == "array_in_other_order":
        item, index, key = one("array")
        return item, [_reply(_set(item, index, key, calls_of(item)[index]["arguments"][key][::-1])), "Done."]
    if name == "nested_value_mistyped":
        item, index, key = one("object", lambda value: any(isinstance(v, int | float) for v in value.values()))
        nested = dict(calls_of(item)[index]["arguments"][key])
        inner = next(k for k, v in nested.items() if isinstance(v, int | float))
        nested[inner] = str(nested[inner])
        return item, [_reply(_set(item, index, key, nested)), "Done."]
    if name == "nested_extra_key":
        item, index, key = one("object")
        return item, [_reply(_set(item, index, key, {**calls_of(item)[index]["arguments"][key], "extra": 1})), "Done."]
    if name == "missing_required":
        item = _first(items, lambda i: i["category"] == "single")
        calls = copy.deepcopy(calls_of(item))
        calls[0]["arguments"].pop(_schema(item, calls[0])["required"][0])
        return item, [_reply(calls), "Done."]
    if name == "extra_key":
        item = _first(items, lambda i: i["category"] == "single")
        return item, [_reply(_set(item, 0, "colour", "red")), "Done."]
    if name == "optional_left_out_is_set":
        item = _first(items, lambda i: i["category"] == "single" and any(
            k not in calls_of(i)[0]["arguments"] for k in _schema(i, calls_of(i)[0])["properties"]))  # fmt: skip
        schema = _schema(item, calls_of(item)[0])
        key = next(k for k in schema["properties"] if k not in calls_of(item)[0]["arguments"])
        return item, [_reply(_set(item, 0, key, _value_of(key))), "Done."]
    if name == "one_parallel_call_missing":
        item = _first(items, lambda i: i["category"] == "parallel")
        return item, [_reply(calls_of(item)[1:]), "Done."]
    if name == "one_parallel_call_twice":
        item = _first(items, lambda i: i["category"] == "parallel")
        calls = calls_of(item)
        return item, [_reply([calls[0], *calls[:-1]]), "Done."]
    if name == "the_answer_then_one_call_again":
        item = _first(items, lambda i: i["category"] == "parallel")
        calls = calls_of(item)
        return item, [_reply(calls), _reply(calls[:1]), "Done."]
    if name == "a_wrong_call_then_the_right_one":
        item, index, key = one("integer")
        wrong = _reply(_set(item, index, key, str(calls_of(item)[index]["arguments"][key])))
        return item, [wrong, _reply(calls_of(item)), "Done."]
    if name == "a_call_on_an_irrelevance_task":
        item = _first(items, lambda i: i["category"] == "choose_or_refuse" and not calls_of(i))
        function = item["functions"][0]
        arguments = {key: _value_of(key) for key in function["parameters"]["required"]}
        return item, [_reply([{"name": function["name"], "arguments": arguments}]), "Done."]
    if name == "right_arguments_wrong_function":
        item = _first(items, lambda i: i["category"] == "choose_or_refuse" and calls_of(i))
        other = next(f["name"] for f in item["functions"] if f["name"] != calls_of(item)[0]["name"])
        return item, [_reply([{"name": other, "arguments": calls_of(item)[0]["arguments"]}]), "Done."]
    if name == "words_instead_of_calls":
        item = _first(items, lambda i: i["category"] == "single")
        return item, [f"I would call {calls_of(item)[0]['name']} with {calls_of(item)[0]['arguments']}."]
    if name == "empty_reply_on_an_irrelevance_task":
        return _first(items, lambda i: i["category"] == "choose_or_refuse" and not calls_of(i)), [""]
    raise AssertionError(name)


def _value_of(key: str) -> Any:
    """A value of the right type for parameter `key` (a parameter name has one schema in every task)."""
    stream = TaskStream("function_calling", tasks.make_task, tasks.CATEGORIES, seed=7)
    return next(
        c["arguments"][key] for n in range(900) for c in stream.item(n)["answer"]["calls"] if key in c["arguments"]
    )


NEAR_MISSES = [
    "integer_as_string", "integer_as_float", "number_as_string", "boolean_as_string", "enum_in_other_case",
    "array_in_other_order", "nested_value_mistyped", "nested_extra_key", "missing_required", "extra_key",
    "optional_left_out_is_set", "one_parallel_call_missing", "one_parallel_call_twice",
    "the_answer_then_one_call_again", "a_wrong_call_then_the_right_one", "a_call_on_an_irrelevance_task",
    "right_arguments_wrong_function", "words_instead_of_calls", "empty_reply_on_an_irrelevance_task",
]  # fmt: skip


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_a_near_miss_earns_nothing(env: FunctionCallingEnv, items: list[Item], name: str) -> None:
    item, replies = _near_miss(name, items)
    result, reward = _rollout(env, item, replies)
    assert reward == 0.0 and result.task_completed is False, name


def test_the_answer_itself_passes_as_text_in_any_order(env: FunctionCallingEnv, items: list[Item]) -> None:
    """The control for the near misses: the answer written as Hermes text, parallel calls reversed, passes."""
    for category in tasks.CATEGORIES:
        item = _first(
            items, lambda i, c=category: i["category"] == c and i["difficulty"] == "hard" and i["answer"]["calls"]
        )
        result, reward = _rollout(env, item, [_reply(item["answer"]["calls"][::-1]), "Done."])
        assert result.task_completed and reward == pytest.approx(0.98), category
    refusal = _first(items, lambda i: not i["answer"]["calls"])
    assert _rollout(env, refusal, [tasks.REFUSAL])[1] == pytest.approx(0.99)


def test_a_mistyped_call_gets_a_tool_error_the_model_sees(env: FunctionCallingEnv, items: list[Item]) -> None:
    item, replies = _near_miss("integer_as_string", items)
    result, _ = _rollout(env, item, replies)
    tool = next(m["content"] for m in result.messages if m["role"] == "tool" and m["content"].startswith("Error"))
    assert "should be integer, got string" in tool and result.num_tool_errors == 1


def _size(item: Item) -> dict[str, float]:
    calls = item["answer"]["calls"]
    return {
        "params": statistics.mean(len(f["parameters"]["properties"]) for f in item["functions"]),
        "calls": len(calls),
        "offered": len(item["functions"]),
    }


def test_difficulty_grows_what_must_be_right() -> None:
    """Per category, the mean of what grows rises from easy to hard: parameters per function (all), calls
    per reply (parallel), functions to choose from (choose_or_refuse)."""
    grows = {"single": ("params",), "parallel": ("params", "calls"), "choose_or_refuse": ("params", "offered")}
    for category, measures in grows.items():
        sizes = {
            d: [_size(tasks.make_task(random.Random(f"g:{d}:{n}"), category, d)) for n in range(80)]
            for d in DIFFICULTIES
        }
        means = {d: {m: statistics.mean(s[m] for s in sizes[d]) for m in measures} for d in DIFFICULTIES}
        for measure in measures:
            levels = [means[d][measure] for d in DIFFICULTIES]
            assert levels == sorted(levels) and levels[0] < levels[-1], (category, measure, levels)
    hard = [tasks.make_task(random.Random(f"h:{n}"), "single", "hard") for n in range(40)]
    kinds = {p["type"] for i in hard for p in i["functions"][0]["parameters"]["properties"].values()}
    assert {"object", "array", "string", "integer", "number", "boolean"} <= kinds
    left_out = [
        i
        for i in hard
        if len(i["answer"]["calls"][0]["arguments"]) < len(i["functions"][0]["parameters"]["properties"])
    ]
    set_optional = [
        i for i in hard if set(i["answer"]["calls"][0]["arguments"]) - set(i["functions"][0]["parameters"]["required"])
    ]
    assert left_out and set_optional  # Optional arguments: some requests leave them out, some set them.


def test_the_functions_are_listed_as_schemas_or_as_signatures(items: list[Item]) -> None:
    """About half the tasks list their functions as JSON schemas, half as one signature a line, required
    arguments bare and optional ones bracketed, every parameter with its JSON type in words."""
    import doctest

    assert doctest.testmod(tasks).failed == 0  # `signature`'s example.
    by_listing = {listing: [i for i in items if i["listing"] == listing] for listing in tasks.LISTINGS}
    assert all(0.35 < len(some) / len(items) < 0.65 for some in by_listing.values())
    for item in by_listing["signatures"]:
        assert "<tools>" not in item["prompt"] and item["prompt"].endswith(f"Request: {item['request']}")
        for function in item["functions"]:
            line = tasks.signature(function)
            assert f"\n{line}\n" in item["prompt"]
            params = function["parameters"]
            for name in params["properties"]:
                assert (f"[{name}: " in line) == (name not in params["required"]) and f"{name}: " in line
    for item in by_listing["schema"]:
        assert all(json.dumps(f["name"]) in item["prompt"] for f in item["functions"]) and "<tools>" in item["prompt"]
    hard = _first(by_listing["signatures"], lambda i: i["category"] == "single" and i["difficulty"] == "hard")
    line = tasks.signature(hard["functions"][0])
    assert "object {" in line and " | " in line and "array of " in line  # Nested object, enum, array.


def test_the_teacher_is_short() -> None:
    """The oracle answers in one reply (its parallel calls a `batch`), then says it is done: 2 turns on every
    slice, 1 for a refusal; every easy slice is far under the CPU default's 6."""
    turns = {f"{c}/{d}": teacher_turns("function_calling", f"{c}/{d}") for c in tasks.CATEGORIES for d in DIFFICULTIES}
    assert all(turns[f"{c}/easy"] <= 6 for c in tasks.CATEGORIES), turns
    assert set(turns.values()) == {2}, turns


def test_nothing_is_shared_with_the_lm_eval_suite() -> None:
    """No function or parameter name of the suite's tools, and no task text the project's decontamination
    flags: the only n-grams shared with any suite item are the tool-call syntax."""
    suite = suite_items(60)
    suite_texts = [i["prompt"] for rows in suite.values() for i in rows]
    suite_params = {"command", "timeout", "path", "max_lines", "content", "url", "query", "department",
                    "max_price", "in_stock", "product_ids", "price"}  # fmt: skip
    assert all(f"{p}:" in suite_texts[0] or f"[{p}:" in suite_texts[0] for p in suite_params)  # The suite's own.
    held_out = functools.partial(tasks.make_task, split="held_out")
    ours = [
        *TaskStream("function_calling", tasks.make_task, tasks.CATEGORIES, seed=0).items(450),
        *TaskStream("function_calling", held_out, tasks.CATEGORIES, seed=1_000_000).items(450),
    ]
    names = {f["name"] for i in ours for f in i["functions"]}
    params = {p for i in ours for f in i["functions"] for p in f["parameters"]["properties"]}
    assert not names & set(TOOLS) and not params & suite_params
    n = CurationConfig().contamination_ngram
    syntax = set(ngrams(HERMES.tool_call_text("tool_name", {"argument": "value"}), n))
    suite_grams = {g for text in suite_texts for g in ngrams(text, n)}
    assert {g for i in ours for g in ngrams(i["prompt"], n) if g in suite_grams} <= syntax
    groups = [
        {"messages": [[{"role": "user", "content": i["prompt"]}, {"role": "assistant", "content": "Done."}]],
         "scores": [1.0], "meta": {"item_id": i["item_id"], "content_digest": content_digest(i), "completed": [True]}}
        for i in ours[::5]  # Curation compares every pair for near duplicates: a sample of both streams.
    ]  # fmt: skip
    control = {"messages": [[{"role": "user", "content": suite_texts[0]}, {"role": "assistant", "content": "ok"}]],
               "scores": [1.0], "meta": {"item_id": "control", "completed": [True]}}  # fmt: skip
    result = curate([*groups, control], suite_texts, CurationConfig(near_duplicate_jaccard=1.0))
    assert result.removed["contaminated"] == 1 and len(result.sft) == len(groups)  # Only the control: a suite item.


def test_training_and_held_out_tasks_never_share_an_api_and_request(tiny_model: Path) -> None:
    """Each comes from its own part of the task space (by hash), so no seed can make them meet; on the
    seeds alone they would (the easy slices hold only thousands of tasks: training repeats some already)."""
    env = FunctionCallingEnv(tokenizer_name=str(tiny_model), eval_size=200)
    asyncio.run(env.setup())
    training = env.stream.items(1800)
    assert {tasks.split_of(i["functions"], i["request"]) for i in training} == {"train"}
    assert {tasks.split_of(i["functions"], i["request"]) for i in env.eval_items} == {"held_out"}
    assert {i["category"] for i in env.eval_items} == set(tasks.CATEGORIES)  # Still every slice.
    keys = {repr((i["functions"], i["request"])) for i in training}
    assert not keys & {repr((i["functions"], i["request"])) for i in env.eval_items}
    assert {content_digest(i) for i in env.eval_items}.isdisjoint(content_digest(i) for i in training)
    unsplit = TaskStream("function_calling", tasks.make_task, tasks.CATEGORIES, seed=0)
    assert [i["request"] for i in unsplit.items(9)] == [i["request"] for i in training[:9]]  # teacher_turns' stream.


def test_tasks_are_deterministic_and_typed_as_their_schemas(env: FunctionCallingEnv, items: list[Item]) -> None:
    again = TaskStream("function_calling", tasks.make_task, tasks.CATEGORIES, seed=0).items(len(items))
    assert again == items
    for item in items:
        tools = {t.name: t for t in tasks.function_tools(item)}
        for call in item["answer"]["calls"]:  # Every answer is a call its tool accepts.
            assert tools[call["name"]](None, call["arguments"]) == '{"status": "ok"}'  # type: ignore[arg-type]
        assert tasks.verify(item, [{"role": "assistant", "content": "",
                                    "tool_calls": [{"function": {"name": c["name"], "arguments": c["arguments"]}}
                                                   for c in item["answer"]["calls"]]},
                                   {"role": "assistant", "content": "Done."}])  # fmt: skip


def test_the_prompt_follows_the_tool_call_parser(tiny_model: Path) -> None:
    """With the mistral parser the functions and the call format are mistral's, and a mistral reply of
    parallel calls (one list) passes."""
    env = FunctionCallingEnv(tokenizer_name=str(tiny_model), teacher="oracle", tool_call_parser="mistral")
    asyncio.run(env.setup())
    item = _first(env.stream.items(30), lambda i: i["category"] == "parallel")
    prompt = env.format_prompt(item)
    assert "[TOOL_CALLS]" in prompt and "<tool_call>" not in prompt and item["request"] in prompt
    text = "[TOOL_CALLS] " + json.dumps(
        [{"name": c["name"], "arguments": c["arguments"]} for c in item["answer"]["calls"]]
    )
    assert len(get_parser("mistral").parse(text).tool_calls) == len(item["answer"]["calls"]) > 1
    result, reward = _rollout(env, item, [text, "Done."])
    assert result.task_completed and reward == pytest.approx(0.98)
    single = _first(env.stream.items(30), lambda i: i["category"] == "single")
    assert _rollout(env, single)[1] == pytest.approx(0.98)  # The oracle writes its call in mistral's format.


def test_an_episode_by_hand_runs_the_tasks_functions(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_TOKENIZER", "/nonexistent/tokenizer")  # reset/step need none.
    env = FunctionCallingEnv(num_tasks=10, difficulty="easy")
    try:
        state = env.reset(0)
        item = env.stream.item(0)
        assert state.tools == [] and item["request"] in state.prompt
        call = item["answer"]["calls"][0]
        step = env.step(Action.call(call["name"], **call["arguments"]))
        assert not step.done and step.next_state.observation == '{"status": "ok"}'
        done = env.step(Action(text="Done."))
        assert done.done and done.info["task_completed"] and done.reward == pytest.approx(0.98)
    finally:
        env.shutdown()


def test_a_process_group_is_tokenised_with_the_functions_in_the_prompt(
    env: FunctionCallingEnv, items: list[Item]
) -> None:
    """`process` mode's group: scored rollouts, no `tools=` (the functions are in the user turn the template
    renders), and a loss mask on the assistant's tokens only."""
    item = _first(items, lambda i: i["category"] == "parallel" and i["difficulty"] == "hard")
    group, _ = asyncio.run(env.collect_trajectories(item))
    assert group is not None and group["scores"] == [pytest.approx(0.98)] * env.config.group_size
    assert group["meta"]["tools"] == [] and group["meta"]["completed"] == [True] * env.config.group_size
    tokens, masks = group["tokens"][0], group["masks"][0]
    trained = env.tokenizer.decode([t for t, m in zip(tokens, masks, strict=True) if m != -100])
    untrained = env.tokenizer.decode([t for t, m in zip(tokens, masks, strict=True) if m == -100])
    calls = item["answer"]["calls"]
    assert all(c["name"] in trained for c in calls) and "Done." in trained  # The replies: trained on.
    assert item["request"] in untrained and '"status": "ok"' in untrained  # The prompt and tool results: not.


def test_every_number_in_the_arguments_is_bounded_however_deep() -> None:
    tasks._check_numbers({"a": [1, {"b": [2.5, True]}], "c": "1e400"})  # Bounded numbers, a bool, a string.
    for hostile in ({"a": [1, [10**16]]}, {"a": {"b": [float("nan")]}}, [float("inf")]):
        with pytest.raises(Unjudgeable):
            tasks._check_numbers(hostile)
