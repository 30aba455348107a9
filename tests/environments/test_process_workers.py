"""`process` mode in several processes: every item written once by the one writer, rollouts counted
from every process; the item a worker held when it died is made by another process."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from atroposlib.envs.base import APIServerConfig

from flywheel.environments.process_mode import ItemPool
from flywheel.environments.tool_use_chain import ToolUseChainEnv
from tests.environments.conftest import chat_reply

PARENT, DIE = "FLYWHEEL_TEST_PARENT_PID", "FLYWHEEL_TEST_WORKER_DIES"


class WorkerMarkingEnv(ToolUseChainEnv):
    """Records which process made each group. The parent makes none until a worker has taken an item
    (a worker's imports take seconds; the parent alone would otherwise finish a short run), and a
    worker exits on its first item when `FLYWHEEL_TEST_WORKER_DIES` is set."""

    async def collect_trajectories(self, item: dict[str, Any]) -> tuple[Any, list]:
        marker = Path(self.config.data_path_to_save_groups).with_suffix(".worker-started")
        if os.getpid() == int(os.environ[PARENT]):
            deadline = time.monotonic() + 180
            while not marker.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        else:
            marker.touch()
            if os.environ.get(DIE):
                os._exit(3)
        group, backlog = await super().collect_trajectories(item)
        group["meta"]["pid"] = os.getpid()
        return group, backlog


def _run(url: str, tiny_model: Path, out: Path, groups: int) -> dict[str, Any]:
    server = APIServerConfig(base_url=url, model_name="fake", api_key="k", health_check=False)
    env = WorkerMarkingEnv(
        server_configs=[server], tokenizer_name=str(tiny_model), group_size=2, total_steps=groups,
        max_agent_turns=1, data_path_to_save_groups=str(out), ensure_scores_are_not_same=False, use_wandb=False,
        process_workers=2, process_concurrency=1,
    )  # fmt: skip
    env.process_mode = True
    env.n_groups_to_process = groups
    asyncio.run(env.process_manager())
    return json.loads(out.with_suffix(".stats.json").read_text())


def _groups(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture
def replies(fake_openai: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(PARENT, str(os.getpid()))
    return fake_openai(lambda path, body: chat_reply("All done."))


def test_two_processes_write_every_item_once(replies: str, tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "groups.jsonl"
    stats = _run(replies, tiny_model, out, groups=6)
    groups = _groups(out)
    ids = [g["meta"]["item_id"] for g in groups]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 6
    pids = {g["meta"]["pid"] for g in groups}
    assert os.getpid() in pids and len(pids) == 2  # The parent and its worker both made groups.
    assert all(len(tokens) == len(masks) for g in groups for tokens, masks in zip(g["tokens"], g["masks"], strict=True))
    assert stats["groups_written"] == 6 and stats["rollouts"] == 12 and stats["process_workers"] == 2
    assert stats["groups_lost"] == stats["groups_failed"] == stats["infra_failures"] == 0


def test_the_item_of_a_worker_that_died_is_made_by_another_process(
    replies: str, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "groups.jsonl"
    monkeypatch.setenv(DIE, "1")
    stats = _run(replies, tiny_model, out, groups=4)
    assert stats["groups_written"] == 4 and stats["groups_requeued"] == 1 and stats["groups_lost"] == 0
    assert {g["meta"]["pid"] for g in _groups(out)} == {os.getpid()}  # The worker made none.
    assert sorted(g["meta"]["item_id"] for g in _groups(out)) == [f"tool_use_chain-0-{i}" for i in range(4)]


def test_an_item_given_back_twice_is_dropped() -> None:
    """An item that killed two processes is not handed out a third time (a resumed run tries it again)."""
    pool = ItemPool([{"item_id": "a"}, {"item_id": "b"}])
    first, second = pool.take(), pool.take()
    assert pool.take() is None
    assert pool.give_back([first]) == 0 and pool.take() == first
    assert pool.give_back([first, second]) == 1  # `a` came back before: dropped; `b` goes round again.
    assert pool.take() == second and pool.take() is None


def test_an_env_class_a_worker_cannot_import_is_refused(replies: str, tiny_model: Path, tmp_path: Path) -> None:
    class Local(ToolUseChainEnv):  # Defined in a function: a spawned worker could not find it by name.
        pass

    server = APIServerConfig(base_url=replies, model_name="fake", api_key="k", health_check=False)
    out = tmp_path / "groups.jsonl"
    env = Local(server_configs=[server], tokenizer_name=str(tiny_model), total_steps=2, process_workers=2,
                data_path_to_save_groups=str(out), use_wandb=False)  # fmt: skip
    env.process_mode = True
    env.n_groups_to_process = 2
    with pytest.raises(ValueError, match="cannot import the env class .*Local.*process_workers=1"):
        asyncio.run(env.process_manager())
    assert not out.exists() or out.read_text() == ""
