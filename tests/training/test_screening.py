"""Task screening: GRPO trains on tasks whose groups carry signal, and step 1 reuses the screened groups."""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from flywheel.environments.registry import env_class
from flywheel.training.grpo import SCREENING_FILE, GRPORunConfig, env_reward, grpo_args, screen_into, task_prompt
from flywheel.training.rollouts import Task, agent_rollout_func, prompt_key
from flywheel.training.run_logs import MetricsCallback, RunDir
from flywheel.training.screening import screen_tasks, slice_of

SOLVE_RATE = {"easy": 1.0, "medium": 0.5, "hard": 0.0}  # Mastered, learnable, unsolved.


def _task(index: int, difficulty: str) -> Task:
    env = SimpleNamespace(name="web")
    item = {"item_id": f"web-0-{index}", "category": "lookup", "difficulty": difficulty}
    return Task(env, item)  # type: ignore[arg-type]


def _scripted(seed: int = 0) -> tuple[Any, Any, list[int]]:
    """Tasks cycling through three slices, and outcomes drawn from each slice's solve rate."""
    rng, drawn, rolled = random.Random(seed), iter(range(10_000)), []

    def draw() -> Task:
        index = next(drawn)
        return _task(index, ("easy", "medium", "hard")[index % 3])

    def roll(batch: list[Task]) -> list[tuple[Any, float, None]]:
        rolled.append(len(batch))
        return [(None, float(rng.random() < SOLVE_RATE[t.item["difficulty"]]), None) for t in batch]

    return draw, roll, rolled


def test_screening_keeps_only_groups_with_differing_rewards_and_drops_flat_slices() -> None:
    draw, roll, rolled = _scripted()
    found = screen_tasks(draw, roll, group_size=4, needed=6, budget=40)
    assert len(found.kept) == 6
    assert all(len({r for _, r, _ in group}) > 1 for _, group in found.kept)
    assert {slice_of(task) for task, _ in found.kept} == {"web/lookup/medium"}
    slices = found.summary()["slices"]
    # Always solved and never solved: two flat groups each, then never rolled again.
    assert slices["web/lookup/easy"] == {"groups": 2, "kept": 0, "mean_reward": 1.0, "dropped": True}
    assert slices["web/lookup/hard"] == {"groups": 2, "kept": 0, "mean_reward": 0.0, "dropped": True}
    assert slices["web/lookup/medium"]["kept"] == 6 and not slices["web/lookup/medium"]["dropped"]

    assert all(size % 4 == 0 for size in rolled)  # Whole groups only.


def test_a_slice_that_ever_varied_is_never_dropped() -> None:
    groups = iter(
        [
            [(None, 0.0, None), (None, 1.0, None)],
            *[[(None, 1.0, None), (None, 1.0, None)]] * 5,
            [(None, 0.0, None), (None, 1.0, None)],
        ]
    )

    def roll(batch: list[Task]) -> list[tuple[Any, float, None]]:
        return [outcome for _ in range(len(batch) // 2) for outcome in next(groups)]

    found = screen_tasks(lambda: _task(0, "medium"), roll, group_size=2, needed=2, budget=7)
    assert len(found.kept) == 2 and len(found.flat) == 5  # Five flat groups in a row, and still drawn.
    assert not found.summary()["slices"]["web/lookup/medium"]["dropped"]


def test_screening_stops_at_its_budget_when_nothing_is_learnable() -> None:
    rolled: list[int] = []

    def roll(batch: list[Task]) -> list[tuple[Any, float, None]]:
        rolled.append(len(batch))
        return [(None, 0.0, None)] * len(batch)

    found = screen_tasks(lambda: _task(0, "hard"), roll, group_size=2, needed=4, budget=10)
    assert found.kept == [] and len(found.flat) == 4  # One batch of 4, all flat: the slice is dropped...
    assert rolled == [8] and found.draws == 200  # ...never rolled again, and drawing gave up (20 x budget).
    found = screen_tasks(lambda: _task(0, "hard"), roll, group_size=2, needed=4, budget=10, drop_after=99)
    assert len(found.flat) == 10  # Never more than the budget.


def test_screening_counts_only_scored_rollouts() -> None:
    outcomes = iter([[(None, None, None), (None, 1.0, None)], [(None, 0.0, None), (None, 1.0, None)]])
    found = screen_tasks(lambda: _task(0, "medium"), lambda batch: next(outcomes), group_size=2, needed=1, budget=5)
    assert len(found.flat) == 1 and len(found.kept) == 1  # One scored rollout shows no variance: flat.
    assert found.summary()["slices"]["web/lookup/medium"]["mean_reward"] == 2 / 3  # The infra failure left out.


def _count_lines_by_coin(rng: random.Random):  # type: ignore[no-untyped-def]
    """file_stats' oracle that writes the right count or one off, by a coin flip: learnable by design."""

    def reply(conversation: str) -> str:
        responses = conversation.split("<tool_response>")[1:]
        if not responses:
            return '<tool_call>\n{"name": "terminal", "arguments": {"command": "wc -l notes.txt"}}\n</tool_call>'
        if len(responses) == 1:
            count = int(re.search(r"(\d+) notes.txt", responses[0]).group(1)) + rng.choice([0, 1])
            call = {"name": "write_file", "arguments": {"path": "answer.txt", "content": str(count)}}
            return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return "Done."

    return reply


def test_grpo_step_one_trains_on_the_screened_groups(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from flywheel.training.grpo import policy_envs, task_dataset
    from tests.training.test_grpo import _script_generation

    tokenizer = AutoTokenizer.from_pretrained(tiny_model, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    scripted = _script_generation(model, tokenizer, _count_lines_by_coin(random.Random(3)))
    cfg = GRPORunConfig(envs=["file_stats"], total_steps=1, batch_size=4, num_rollouts_per_task=2, device="cpu",
                        max_agent_turns=4, max_completion_length=512, temperature=0.7, screen_tasks=12)  # fmt: skip
    envs = policy_envs(cfg, None, tiny_model, tokenizer)
    run, tasks, screened = RunDir(tmp_path, "screen"), {}, {}
    dataset, _ = task_dataset(envs, 1)
    rollout = agent_rollout_func(tasks, cfg.temperature, cfg.max_completion_length, screened)
    args = grpo_args(cfg, str(run.checkpoints))
    trainer = GRPOTrainer(model=model, reward_funcs=[env_reward(run, every=1)], args=args,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[MetricsCallback(run)],
                          rollout_func=rollout)  # fmt: skip

    summary = screen_into(trainer, cfg, envs, tasks, screened, run, resume=None)
    assert summary["kept"] == 2 and 2 <= summary["screened"] <= 12
    assert len(trainer.train_dataset) == 2 and set(tasks) == set(screened)
    asked = len(scripted.prompts)
    assert asked > 0  # Screening generated with the policy (its rollouts concurrently)...
    assert scripted.most_in_flight > 1
    trainer.train()
    assert len(scripted.prompts) == asked  # ...and step 1 reused those groups instead of generating again.
    step = next(m for m in run.read_metrics() if "reward" in m)
    assert step["frac_reward_zero_std"] == 0.0  # Every group of the step carries signal.
    assert step["completions/clipped_ratio"] == 0.0  # Conversations end at their last end-of-turn token.
    saved = json.loads((run.path / SCREENING_FILE).read_text())
    assert [t["item"]["item_id"] for t in saved["tasks"]] == [r["item_id"] for r in trainer.train_dataset]


def test_a_resumed_run_trains_on_the_tasks_it_screened(tiny_model: Path, tmp_path: Path) -> None:
    env = env_class("file_stats")(tokenizer_name=str(tiny_model))
    asyncio.run(env.setup())
    items = env.stream.items(3)
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    saved = {"summary": {"kept": 2}, "tasks": [{"env": "file_stats", "item": item} for item in items[1:]]}
    (checkpoint / SCREENING_FILE).write_text(json.dumps(saved))
    trainer, tasks = SimpleNamespace(train_dataset=None), {}
    cfg = GRPORunConfig(envs=["file_stats"], screen_tasks=8)
    run = RunDir(tmp_path, "resumed")
    summary = screen_into(trainer, cfg, [env], tasks, {}, run, resume=checkpoint)
    assert summary == {"kept": 2}  # No screening ran: the trainer was never asked to generate.
    assert json.loads((run.path / SCREENING_FILE).read_text()) == saved  # The next step checkpoints carry it on.
    assert [r["item_id"] for r in trainer.train_dataset] == [i["item_id"] for i in items[1:]]
    assert set(tasks) == {prompt_key(task_prompt(env, item)) for item in items[1:]}
