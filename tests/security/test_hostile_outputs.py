"""Hostile output the verifiers must judge, never crash or stall on: deep nesting, numbers of 400 digits,
NaN and infinities, binary, huge files. Each is a failed task (reward 0, or only the milestones it did not
touch), never an infra failure (reward None), and a slow verification does not hold up other rollouts."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from flywheel.environments.agent.policies import ScriptedPolicy, call, final
from flywheel.environments.hermes_base_env import HermesAgentBaseEnv
from flywheel.environments.long_horizon import LongHorizonEnv
from flywheel.environments.swe_bench import SWEBenchEnv
from flywheel.environments.tasks import tool_use_chain_tasks as tasks
from flywheel.environments.tasks import web_tasks
from flywheel.environments.tool_use_chain import ToolUseChainEnv
from flywheel.environments.verify.untrusted import Unjudgeable, bounded_text, finite_number, load_json, load_toml
from flywheel.environments.web_navigation import WebNavigationEnv

DEEP = 100_000
HOSTILE_JSON = {
    "deep_lists": "[" * DEEP,
    "deep_objects": '{"a":' * DEEP,
    "deep_closed": "[" * 40 + "]" * 40,
    "huge_int": "1" + "0" * 400,
    "huge_negative_int": "-" + "9" * 5000,
    "nan": "NaN",
    "infinity": "Infinity",
    "minus_infinity": "-Infinity",
    "nan_in_object": '{"a": NaN}',
    "binary": '{"a": 1}\x00\x01\x02',
    "too_long": '"' + "x" * (1 << 21) + '"',
    "huge_line_of_numbers": "[" + ",".join(["1" * 17] * 10) + "]",
}
HOSTILE_TOML = {
    "deep_tables": "\n".join("[" + ".".join(["t"] * n) + "]" for n in range(1, 60)),
    "deep_dotted_key": ".".join(["k"] * 5000) + " = 1",
    "deep_inline_tables": "a = " + "{b = " * 200 + "1" + "}" * 200,
    "deep_arrays": "a = " + "[" * 5000 + "]" * 5000,
    "binary": "[project]\nname = 'x'\x00",
    "too_long": "a = '" + "x" * (1 << 21) + "'",
    "not_toml": "[project\nname = ",
}
HOSTILE_NUMBERS = [10**400, -(10**400), float("nan"), float("inf"), -float("inf"), 1e300, True, "12", None, [1]]


@pytest.mark.parametrize("text", HOSTILE_JSON.values(), ids=HOSTILE_JSON.keys())
def test_hostile_json_is_unjudgeable_not_a_crash(text: str) -> None:
    with pytest.raises(Unjudgeable):
        load_json(text)


@pytest.mark.parametrize("text", HOSTILE_TOML.values(), ids=HOSTILE_TOML.keys())
def test_hostile_toml_is_unjudgeable_not_a_crash(text: str) -> None:
    with pytest.raises(Unjudgeable):
        load_toml(text)


@pytest.mark.parametrize("value", HOSTILE_NUMBERS, ids=[repr(v)[:20] for v in HOSTILE_NUMBERS])
def test_hostile_numbers_are_unjudgeable(value: Any) -> None:
    with pytest.raises(Unjudgeable):
        finite_number(value)


def test_honest_answers_still_parse() -> None:
    """The bounds sit far beyond any honest answer file: nesting 2, a 12-digit total, strings with brackets."""
    assert load_json('{"src/a.py": 3, "n": [1, 2.5, -7], "s": "[[[{{{"}') == {"src/a.py": 3, "n": [1, 2.5, -7],
                                                                             "s": "[[[{{{"}  # fmt: skip
    assert finite_number(123456789012.25) == 123456789012.25 and finite_number(-3) == -3.0
    assert load_toml('[project]\nname = "demo"\ndependencies = ["requests>=2"]\n[project.scripts]\ndemo = "d:m"\n') == {
        "project": {"name": "demo", "dependencies": ["requests>=2"], "scripts": {"demo": "d:m"}}
    }


def test_each_bound_is_inclusive_and_a_refusal_names_its_reason() -> None:
    """Exactly at a bound is still judged, one past it is refused; brackets inside strings (after an escaped
    quote too, or in TOML's single-quoted strings) are no nesting."""
    assert load_json("1234567890123456") == 1234567890123456 and load_json("-1234567890123456") == -1234567890123456
    with pytest.raises(Unjudgeable, match="^an integer of 17 digits$"):
        load_json("12345678901234567")
    with pytest.raises(Unjudgeable, match="^NaN is not a JSON number$"):
        load_json("NaN")
    assert finite_number(10**15) == 1e15 and finite_number(-1e15) == -1e15
    with pytest.raises(Unjudgeable, match="^a number larger than 1e15$"):
        finite_number(10**15 + 1)
    with pytest.raises(Unjudgeable, match="^a number that is not finite or larger than 1e15: 1000000100000000.0$"):
        finite_number(1.0000001e15)
    assert load_json("[" * 32 + "]" * 32) is not None
    with pytest.raises(Unjudgeable, match="^nested deeper than 32$"):
        load_json("[" * 33 + "]" * 33)
    assert load_json('["\\"' + "[" * 40 + '"]') == ['"' + "[" * 40]
    assert load_toml("a = '" + "[" * 40 + "'") == {"a": "[" * 40}
    assert bounded_text("x" * 10, max_chars=10) == "x" * 10
    with pytest.raises(Unjudgeable, match="^11 characters, more than 10$"):
        bounded_text("x" * 11, max_chars=10)
    with pytest.raises(Unjudgeable, match=r"^binary data \(a NUL character\)$"):
        bounded_text("a\x00b")
    assert load_toml(".".join(["k"] * 33) + " = 1")  # 32 dots.
    assert load_toml('v="' + "." * 40 + '"') == {"v": "." * 40}  # Dots in a value are no key depth.
    with pytest.raises(Unjudgeable, match="^nested deeper than 32$"):
        load_toml("X = " + "[" * 33 + "]" * 33)  # Only quotes open a string.
    with pytest.raises(Unjudgeable, match="^keys dotted deeper than 32$"):
        load_toml(".".join(["k"] * 34) + " = 1")
    with pytest.raises(Unjudgeable, match="^not TOML: "):
        load_toml("[project\nname = ")


def _rewards(env_cls: type[HermesAgentBaseEnv], tiny_model: Path, actions: Any, items: int = 1, **config: Any) -> list:
    """Rewards of `actions(item)` played on the env's first training items (None: an infra failure)."""
    env = env_cls(tokenizer_name=str(tiny_model), teacher="oracle", **config)
    env.oracle_policy = lambda item: ScriptedPolicy(actions(item))  # type: ignore[method-assign]

    async def run() -> list:
        await env.setup()
        try:
            return [(await env.run_agent(env.stream.item(index), 0.0))[1] for index in range(items)]
        finally:
            await env.teardown()

    return asyncio.run(run())


HOSTILE_VALUES = {
    "huge_int": "1" + "0" * 400,
    "huge_negative_int": "-" + "9" * 400,
    "nan": "NaN",
    "infinity": "Infinity",
    "float_overflow": "1e400",
    "deep_list": "[" * DEEP,
    "deep_object": '{"a":' * DEEP,
    "bool": "true",
    "list": "[1, 2]",
}


@pytest.mark.parametrize("category", ["csv_summary", "line_count"])
@pytest.mark.parametrize("value", HOSTILE_VALUES.values(), ids=HOSTILE_VALUES.keys())
def test_tool_use_chain_hostile_values_under_the_right_keys_score_zero(
    tiny_model: Path, category: str, value: str
) -> None:
    """Every key the answer needs, each holding a hostile value: the verifier reaches the numbers."""

    def hostile(item: dict[str, Any]) -> list[dict[str, Any]]:
        path, key = tasks.JSON_ANSWERS[category]
        content = "{" + ", ".join(f"{json.dumps(k)}: {value}" for k in item["answer"][key]) + "}"
        return [call("write_file", path=path, content=content), final("Written.")]

    assert _rewards(ToolUseChainEnv, tiny_model, hostile, categories=[category]) == [0.0]


@pytest.mark.parametrize(
    "price", [10**400, -(10**400), float("nan"), float("inf")], ids=["huge", "-huge", "nan", "inf"]
)
def test_web_verifier_refuses_a_price_no_shop_has(price: float) -> None:
    """The right ids with a price of 400 digits raised `OverflowError` in the verifier (an infra failure)."""
    item = {**web_tasks.make_task(random.Random(0), "lookup_price", "easy"), "category": "lookup_price"}
    assert web_tasks.verify(item, {"product_ids": item["answer"]["ids"], "price": item["answer"]["price"]})
    assert not web_tasks.verify(item, {"product_ids": item["answer"]["ids"], "price": price})


@pytest.mark.parametrize(
    "command",
    [
        "python3 -c \"print('| a | 1 | b |\\n' * 2_000_000, file=open('report.md', 'w'))\"",  # ~30 MB of rows.
        "head -c 3000000 /dev/urandom > report.md",
        "python3 -c \"open('report.md', 'w').write('|' * 5_000_000)\"",
    ],
    ids=["many_rows", "binary", "one_huge_line"],
)
def test_tool_use_chain_huge_reports_score_zero_quickly(tiny_model: Path, command: str) -> None:
    started = time.monotonic()
    rewards = _rewards(ToolUseChainEnv, tiny_model, lambda item: [call("terminal", command=command), final("Done.")],
                       categories=["todo_report"])  # fmt: skip
    assert rewards == [0.0]
    assert time.monotonic() - started < 60  # Loose: a verifier parsing 30 MB of rows took minutes and 1.5 GB.


@pytest.fixture(scope="module")
def long_horizon_oracle(tiny_model: Path) -> float:
    """The oracle's long-horizon reward: every milestone."""
    (reward,) = _rewards(LongHorizonEnv, tiny_model, lambda item: item["oracle"])
    return reward


@pytest.mark.parametrize(
    "pyproject",
    ["[" + ".".join(["t"] * 5000) + "]", HOSTILE_TOML["deep_arrays"]],
    ids=["table_5000_deep", "deep_arrays"],  # The parser-level variants are the HOSTILE_TOML cases above.
)
def test_long_horizon_hostile_pyproject_costs_only_its_milestone(
    tiny_model: Path, long_horizon_oracle: float, pyproject: str
) -> None:
    """The oracle's project with a hostile pyproject.toml committed: judged, scored below the oracle, not None."""

    def hostile(item: dict[str, Any]) -> list[dict[str, Any]]:
        actions = [a for a in item["oracle"] if "final" not in a]  # Every call and batch.
        return [*actions, call("write_file", path="pyproject.toml", content=pyproject),
                call("terminal", command="git add -A && git commit -qm pyproject"), final("Done.")]  # fmt: skip

    (reward,) = _rewards(LongHorizonEnv, tiny_model, hostile)
    assert reward is not None and 0 < reward < long_horizon_oracle


@pytest.mark.parametrize(
    "price", [10**400, -(10**400), 1e308 * 10, "NaN"], ids=["huge_int", "huge_negative", "inf", "nan_string"]
)
def test_web_navigation_hostile_prices_score_zero(tiny_model: Path, price: Any) -> None:
    """The right ids with a price no shop has: not an answer, and no `OverflowError` in the verifier."""

    def submit(item: dict[str, Any]) -> list[dict[str, Any]]:
        actions = [a for a in item["oracle"] if a.get("tool") != "submit_answer"]
        return [*actions, call("submit_answer", product_ids=item["answer"]["ids"], price=price), final("Done.")]

    assert _rewards(WebNavigationEnv, tiny_model, submit, categories=["lookup_price"]) == [0.0]


class _Paced:
    """A scripted policy that takes `pause` seconds a reply and notes when each reply was asked for."""

    def __init__(self, actions: list[dict[str, Any]], pause: float, times: list[float]) -> None:
        self.policy, self.pause, self.times = ScriptedPolicy(actions), pause, times

    async def chat_completion(self, **kwargs: Any) -> Any:
        self.times.append(time.monotonic())
        await asyncio.sleep(self.pause)
        return await self.policy.chat_completion(**kwargs)


def test_a_slow_verification_does_not_stall_the_other_rollouts(tiny_model: Path) -> None:
    """Rollout A's package sleeps 4 s when the verifier's child process imports it; rollout B keeps asking
    the model for its next step meanwhile (before: every rollout froze while A's verifier ran)."""
    env = SWEBenchEnv(tokenizer_name=str(tiny_model), teacher="oracle")
    slow: list[float] = []
    paced: list[float] = []
    items: list[dict[str, Any]] = []

    def policy(item: dict[str, Any]) -> Any:
        if item is items[0]:
            init = "import time\ntime.sleep(4)\n"
            return _Paced([call("write_file", path=f"{item['answer']['package']}/__init__.py", content=init),
                           final("Fixed.")], 0.0, slow)  # fmt: skip
        steps = [call("read_file", path=f"notes-{n}.txt") for n in range(12)]  # Distinct: not a stuck loop.
        return _Paced([*steps, final("Done.")], 0.5, paced)

    env.oracle_policy = policy  # type: ignore[method-assign]

    async def run() -> list[float | None]:
        await env.setup()
        try:
            items.extend([env.stream.item(0), env.stream.item(1)])
            outcomes = await asyncio.gather(*(env.run_agent(item, 0.0) for item in items))
            return [reward for _, reward in outcomes]
        finally:
            await env.teardown()

    rewards = asyncio.run(run())
    assert rewards[0] == 0.0 and rewards[1] is not None
    gaps = [b - a for a, b in itertools.pairwise(paced)]
    assert slow and paced[-1] - slow[-1] > 4  # B was still asking after A's verification (≥ 4 s) began.
    assert max(gaps) < 2.5, gaps  # Each step takes 0.5 s; a stalled loop would show a ≥ 4 s gap.


def test_a_verifier_bug_on_agent_output_is_a_failed_task_with_its_reason(tiny_model: Path) -> None:
    """The net under every verifier: any exception but the sandbox's becomes verdict False, reason kept."""
    env = ToolUseChainEnv(tokenizer_name=str(tiny_model), teacher="oracle")

    async def broken(item: dict[str, Any], result: Any, ctx: Any) -> bool:
        return json.loads("[" * DEEP)  # RecursionError, as the old verifier raised.

    env.verify = broken  # type: ignore[method-assign]
    env.oracle_policy = lambda item: ScriptedPolicy([final("Done.")])  # type: ignore[method-assign]

    async def run() -> tuple[Any, float | None]:
        await env.setup()
        try:
            return await env.run_agent(env.stream.item(0), 0.0)
        finally:
            await env.teardown()

    result, reward = asyncio.run(run())
    assert reward == 0.0 and result.task_completed is False and env.verifier_errors == 1
    assert result.verify_error.startswith("RecursionError")


@pytest.mark.parametrize(
    "page",
    ["%C2%B2", "%D9%A3", "-1", "0", "1" * 400, "1e3", "%00"],
    ids=["superscript_two", "arabic_three", "negative", "zero", "400_digits", "exponent", "nul"],
)
def test_the_shop_reads_a_hostile_page_number_as_page_one(page: str) -> None:
    """`"²".isdigit()` is true and `int("²")` raises: the shop answered such a query with a traceback."""
    import urllib.request

    from flywheel.environments.web.site import ShopSite, catalog

    shop = ShopSite().start()
    try:
        shelf = catalog("0123456789", "easy")[0].shelf
        url = f"{shop.base_url}/t/0123456789/easy/c/{shelf}?page={page}"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200 and "(page 1)" in response.read().decode()
    finally:
        shop.stop()
