"""Horizons that grow: every category's easy slice fits the CPU default's turn budget, medium and hard
take more model calls, and an item whose oracle is longer than the budget gets its horizon."""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path

from transformers import AutoTokenizer

from flywheel.environments.agent.policies import ScriptedPolicy, call
from flywheel.environments.long_horizon import LongHorizonEnv
from flywheel.environments.registry import TASK_FAMILIES, env_class, teacher_turns
from flywheel.environments.task_stream import DIFFICULTIES, HORIZON_SLACK, TaskStream
from flywheel.environments.tool_call_parsers import get_parser
from flywheel.environments.tool_context import live_task_ids
from flywheel.flows.round_config import profile

ONE_REPLY = {"function_calling"}  # Difficulty grows the calls of its one reply, not the turns.


def test_every_easy_slice_fits_the_default_budget_and_difficulty_grows_the_horizon() -> None:
    budget = profile("default").max_agent_turns
    for env in TASK_FAMILIES:
        for category in env_class(env).categories:
            easy, medium, hard = (teacher_turns(env, f"{category}/{d}") for d in DIFFICULTIES)
            assert easy <= budget, f"{env} {category}/easy needs {easy} turns, the default allows {budget}"
            grows = easy <= medium <= hard if env in ONE_REPLY else easy < medium < hard
            assert grows, f"{env} {category}: {easy}, {medium}, {hard} turns"


def test_every_oracle_reply_fits_the_default_reply_budget(tiny_model: Path) -> None:
    """A student imitates the oracle reply by reply: none may be longer than the tokens a reply gets (the
    longest: function_calling's hard parallel calls, ~245 tokens)."""
    tokens = profile("default").max_token_length
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)  # SmolLM2's.
    parser = get_parser("hermes")
    for env, difficulty in itertools.product(TASK_FAMILIES, DIFFICULTIES):
        cls = env_class(env)
        mix = {f"{c}/{d}": float(d == difficulty) for c in cls.categories for d in DIFFICULTIES}
        for item in TaskStream(env, cls.make_task, tuple(cls.categories), seed=0, mix=mix).items(12):
            for action in item["oracle"]:
                calls = action.get("calls") or [action]
                text = action.get("final") or parser.tool_calls_text([(c["tool"], c["arguments"]) for c in calls])
                length = len(tokenizer(text)["input_ids"])
                assert length <= tokens, f"{item['item_id']} ({item['category']}): a {length}-token reply"


def _medium_item(env: LongHorizonEnv) -> dict:
    asyncio.run(env.setup())
    return next(item for item in map(env.stream.item, range(20)) if item["difficulty"] == "medium")


def test_an_item_longer_than_the_budget_gets_its_horizon_and_no_more(tiny_model: Path) -> None:
    """A 11-call medium project under `max_agent_turns: 6`: the oracle finishes it (its budget is 1.5 x
    11 = 17 turns), and a policy that never stops is cut off at those 17, not at 6 or never."""
    env = LongHorizonEnv(tokenizer_name=str(tiny_model), teacher="oracle", max_agent_turns=6)
    item = _medium_item(env)
    horizon = math.ceil(HORIZON_SLACK * len(item["oracle"]))
    assert len(item["oracle"]) > 6 and env.turn_budget(item) == horizon
    assert env.turn_budget({**item, "oracle": item["oracle"][:2]}) == 6  # A short task keeps the round's budget.
    result, reward = asyncio.run(env.run_agent(item, 0.0))
    assert result.turns_used == len(item["oracle"]) and reward and reward > 0.9
    endless = [call("list_files", path=f"d{i}") for i in range(3 * horizon)]
    env.oracle_policy = lambda item: ScriptedPolicy(endless)  # type: ignore[method-assign]
    result, _ = asyncio.run(env.run_agent(item, 0.0))
    assert result.turns_used == horizon and not result.finished_naturally
    assert live_task_ids() == []
