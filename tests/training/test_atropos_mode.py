"""GRPO the Atropos way: env workers roll against the trainer's policy endpoint and post to a real
`run-api`; the trainer trains on version-checked groups of the ids the policy sampled, refuses
stale and malformed ones with a count, and outlives a killed env worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from transformers import AutoTokenizer, TrainerCallback

from flywheel.data import ArtifactStore
from flywheel.training.env_fleet import EnvFleet
from flywheel.training.grpo import GRPORunConfig, run_grpo
from flywheel.training.policy_endpoint import PolicyEndpoint, RemotePolicy
from flywheel.training.trajectory_api import GroupQueue, RunApi, group_problem

os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"


def _group(version: Any = 2, tokens: list[list[int]] | None = None, **fields: Any) -> dict[str, Any]:
    tokens = tokens or [[5, 6, 7, 8], [5, 6, 9, 10]]
    group = {
        "tokens": tokens,
        "masks": [[-100, -100, *ids[2:]] for ids in tokens],
        "scores": [1.0, 0.0],
        "group_overrides": {"policy_version": version, "env": "tool_use_chain"},
    }
    return group | fields


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"scores": [1.0]}, "not a group of 2"),
        ({"masks": [[-100, -100, 7, 8], [-100, -100, 9]]}, "a mask that does not cover its sequence"),
        ({"masks": [[-100, -100, 7, 99], [-100, -100, 9, 10]]}, "trains other ids"),
        ({"masks": [[-100] * 4, [-100, -100, 9, 10]]}, "nothing to train on"),
        ({"tokens": [[5, 6, 7, 8], [5, 6, 9, 10**6]], "masks": [[-100, -100, 7, 8], [-100, -100, 9, 10**6]]},
         "outside the vocabulary"),
        ({"scores": [float("nan"), 0.0]}, "not a finite number"),
        ({"scores": [True, 0.0]}, "not a finite number"),
        ({"group_overrides": {"env": "tool_use_chain"}}, "no policy version"),
        ({"group_overrides": None}, "no policy version"),
    ],
)  # fmt: skip
def test_a_malformed_group_is_named(fields: dict[str, Any], problem: str) -> None:
    assert group_problem(_group(), 2, 1000) is None
    assert problem in (group_problem(_group(**fields), 2, 1000) or "")


def test_the_queue_trains_fresh_groups_and_counts_what_it_refuses(tmp_path: Path) -> None:
    """Through a real run-api: of seven groups posted, the trainer at step 3 (max_async_level 1) takes
    the two of versions 2 and 3; one from version 0 is stale, one from version 9 another run's, three
    are malformed. With nothing left, waiting ends in an error that names the refusals."""
    with EnvFleet([], 0, [], tmp_path) as fleet:
        api = RunApi(fleet.api_url)
        api.wait_until_up()
        api.register(batch_size=2, max_token_len=4096, num_steps=10, starting_step=0, checkpoint_dir=str(tmp_path))
        posted = [
            _group(0), _group(2), _group(9), _group(scores=[1.0]), _group(group_overrides={}),
            _group(masks=[[-100, -100, 7, 99], [-100, -100, 9, 10]]), _group(3, scores=[0.0, 0.5]),
        ]  # fmt: skip
        httpx.post(f"{fleet.api_url}/scored_data_list", json=posted, timeout=10).raise_for_status()
        queue = GroupQueue(api, group_size=2, max_async_level=1, vocab_size=1000, wait=1)
        taken = {g["group_overrides"]["policy_version"]: g for g in queue.take(2, step=3)}  # run-api's order: LIFO.
        assert sorted(taken) == [2, 3] and sorted(queue.ages) == [0, 1]
        assert taken[3]["scores"] == [0.0, 0.5] and taken[2]["tokens"] == posted[1]["tokens"]
        with pytest.raises(TimeoutError, match=r"no group from run-api .* env workers running.*\"stale\": 1"):
            queue.take(1, step=3)
        assert queue.refused == {"stale": 1, "from_another_run": 1, "malformed": 3} and len(queue.ages) == 2


def test_the_endpoint_serves_the_synced_weights_with_their_version(tiny_model: Path) -> None:
    """The reply to a prompt of ids is ids, sampled from the request's seed (the same seed, the same
    reply), stamped with the version synced last; after a sync the copy holds the new weights."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with PolicyEndpoint(tiny_model, tokenizer, top_k=0, max_new_tokens=8) as endpoint:
        remote = RemotePolicy(endpoint.url)

        async def ask(seed: int) -> tuple[list[int], int]:
            return await remote.generate([1, 2, 3, 4], 1.0, 6, seed)

        async def twice() -> list[tuple[list[int], int]]:
            try:
                return [await ask(7), await ask(7)]
            finally:
                await remote.close()

        first, again = asyncio.run(twice())
        assert first == again and first[1] == 0 and 0 < len(first[0]) <= 6
        with torch.no_grad():
            for parameter in trained.parameters():
                parameter.add_(0.5)
        endpoint.sync(trained, 3)
        assert torch.equal(endpoint.generator.lm_head.weight, trained.lm_head.weight)
        assert httpx.get(f"{endpoint.url}/version").json() == {"version": 3}
        remote = RemotePolicy(endpoint.url)
        after = asyncio.run(twice())[0]
        assert after[1] == 3
        bad = httpx.post(f"{endpoint.url}/generate", json={"prompt_ids": "x"})
        assert bad.status_code == 400 and "bad request" in bad.json()["error"]


class KillAWorker(TrainerCallback):
    """SIGKILLs one env worker after the first step."""

    def __init__(self) -> None:
        self.killed: int | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.killed is None:
            workers = [p for p in psutil.Process().children() if "flywheel.training.env_worker" in p.cmdline()]
            self.killed = workers[0].pid
            os.kill(self.killed, signal.SIGKILL)


def test_grpo_trains_on_groups_from_env_workers_and_outlives_a_killed_one(
    model_store: ArtifactStore, tiny_model: Path, tmp_path: Path
) -> None:
    """Tiny model, 2 env workers, max_async_level 1: three steps on six groups, none older than a
    step, none re-tokenised; a worker SIGKILLed after step 1 is started again and the run goes on."""
    cfg = GRPORunConfig(
        total_steps=3, batch_size=2, gradient_accumulation_steps=2, num_rollouts_per_task=2,
        max_completion_length=24, num_tasks=4, logs_root=str(tmp_path), output_name="rl-atropos",
        difficulty="easy", max_agent_turns=2, rl_mode="atropos", env_workers=2, max_async_level=1,
        drop_flat_groups=False,  # The tiny model scores 0 everywhere: every group is flat.
    )  # fmt: skip
    kill = KillAWorker()
    manifest = run_grpo(cfg, model_store, callbacks=[kill])
    fed = manifest.metrics["atropos"]
    assert manifest.metrics["steps"] == 3 and fed["groups_trained"] == 6
    assert fed["worker_restarts"] >= 1 and kill.killed is not None
    assert fed["mean_age_steps"] <= 1 and fed["endpoint_replies"] >= 12
    run_dir = next(tmp_path.glob("run-*"))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if "reward" in json.loads(line)]
    assert len(steps) == 3 and all(step["rollouts_retokenized"] == 0 for step in steps)
    assert steps[-1]["atropos/groups_trained"] == 6 and "rewards/tool_use_chain/mean" in steps[-1]
    assert {p.name for p in (run_dir / "envs").iterdir()} == {"run-api.log", "env-worker-0.log", "env-worker-1.log"}
    assert not [p for p in psutil.Process().children(recursive=True) if "env_worker" in " ".join(p.cmdline())]
