"""GRPO the Atropos way: env workers roll against the trainer's policy endpoint and post to a real
`run-api`; the trainer trains on version-checked groups of the ids the policy sampled, refuses
stale and malformed ones with a count, outlives a killed env worker and resumes after its own kill."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from transformers import AutoTokenizer

from flywheel.data import ArtifactStore
from flywheel.environments.errors import ContextFull
from flywheel.training.env_fleet import EnvFleet
from flywheel.training.grpo import GRPORunConfig
from flywheel.training.policy_endpoint import PolicyEndpoint, RemotePolicy
from flywheel.training.trajectory_api import GroupQueue, RunApi, group_problem

os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
ROOT = Path(__file__).resolve().parents[2]


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
        ({"overrides": [{"task_completed": True}]}, "overrides that are not one dict a sequence"),
        ({"inference_logprobs": [[1.0, 1.0, -0.5, -0.1]]}, "sampling log-probs"),
        ({"inference_logprobs": [[1.0, 1.0, -0.5], [1.0, 1.0, -0.2, -0.3]]}, "sampling log-probs"),
        ({"inference_logprobs": [[1.0, 1.0, 0.5, -0.1], [1.0, 1.0, -0.2, -0.3]]}, "sampling log-probs"),
        ({"inference_logprobs": [[1.0, 1.0, "x", -0.1], [1.0, 1.0, -0.2, -0.3]]}, "sampling log-probs"),
    ],
)  # fmt: skip
def test_a_malformed_group_is_named(fields: dict[str, Any], problem: str) -> None:
    assert group_problem(_group(), 2, 1000) is None
    assert group_problem(_group(inference_logprobs=[[1.0, 1.0, -0.5, -0.1], [1.0, 1.0, -0.2, -0.3]]), 2, 1000) is None
    assert problem in (group_problem(_group(**fields), 2, 1000) or "")


def test_the_queue_trains_fresh_groups_and_counts_what_it_refuses(tmp_path: Path) -> None:
    """Through a real run-api: of seven groups posted, the trainer at step 3 (max_async_level 1) takes
    the two of versions 2 and 3; one from version 0 is stale, one from version 9 another run's, three
    are malformed. With nothing left and no progress, waiting ends in an error that names the refusals;
    a fleet that gave up ends it at once."""
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
        with pytest.raises(RuntimeError, match=r"no progress from the env workers in 1 s .*\"stale\": 1"):
            queue.take(1, step=3)
        assert queue.refused == {"stale": 1, "from_another_run": 1, "malformed": 3} and len(queue.ages) == 2
        queue.problem = lambda: "every env worker died 6 times"
        with pytest.raises(RuntimeError, match="every env worker died"):
            queue.take(1, step=3)


def test_a_worker_that_keeps_dying_is_given_up_after_its_restarts(tmp_path: Path) -> None:
    """Restarted after a back-off, each time on items of its own; then given up, and the fleet says why."""
    args = ["--config", str(tmp_path / "missing.json"), "--model-dir", str(tmp_path)]
    with EnvFleet(["tool_use_chain"], 1, args, tmp_path, poll=0.2, max_restarts=1) as fleet:
        fleet.start_workers("http://127.0.0.1:1")
        deadline = time.monotonic() + 120
        while fleet.problem() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert fleet.restarts[0] == 1 and fleet.given_up == {0}
        assert "every env worker died 2 times" in (fleet.problem() or "")
    log = (tmp_path / "env-worker-0.log").read_text()
    assert log.count("FileNotFoundError") == 2  # Two starts, each failing on its missing config.


def test_the_endpoint_serves_the_synced_weights_with_their_version(tiny_model: Path) -> None:
    """The reply to a prompt of ids is ids, sampled from the request's seed (the same seed, the same
    reply), stamped with the version synced last; after a sync the copy holds the new weights."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with PolicyEndpoint.generation_copy(tiny_model, tokenizer, top_k=0, max_new_tokens=8) as endpoint:
        remote = RemotePolicy(endpoint.url)

        async def ask(seed: int) -> tuple[list[int], list[float] | None, int]:
            return await remote.generate([1, 2, 3, 4], 1.0, 6, seed)

        async def twice() -> list[tuple[list[int], list[float] | None, int]]:
            try:
                return [await ask(7), await ask(7)]
            finally:
                await remote.close()

        first, again = asyncio.run(twice())
        assert first == again and 0 < len(first[0]) <= 6
        assert first[1:] == (None, 0)  # No sampling log-probs from the CPU copy; version 0.
        with torch.no_grad():
            for parameter in trained.parameters():
                parameter.add_(0.5)
        endpoint.sync(trained, 3)
        assert torch.equal(endpoint.server.model().lm_head.weight, trained.lm_head.weight)
        assert httpx.get(f"{endpoint.url}/version").json() == {"version": 3}
        remote = RemotePolicy(endpoint.url)
        after = asyncio.run(twice())[0]
        assert after[2] == 3
        for bad in ({"prompt_ids": "x"}, {"prompt_ids": [1, 10**7], "max_tokens": 4, "temperature": 1, "seed": 1}):
            refused = httpx.post(f"{endpoint.url}/generate", json=bad)
            assert refused.status_code == 400 and "bad request" in refused.json()["error"]
        assert asyncio.run(twice())[0] == after  # The generation loop still serves.
        with pytest.raises(TypeError, match="loaded by sync"):
            endpoint.load_into_engine()  # A copy has no engine load to follow.
        endpoint.server.context = 4  # As an engine with a 4-token context: no room for one more.
        refused = httpx.post(f"{endpoint.url}/generate", json={"prompt_ids": [1, 2, 3, 4], "max_tokens": 4,
                                                               "temperature": 1, "seed": 1})  # fmt: skip
        assert refused.status_code == 413 and "a prompt of 4 tokens, over the engine's 3" in refused.json()["error"]
        remote = RemotePolicy(endpoint.url)
        with pytest.raises(ContextFull, match="over the engine's 3"):  # The worker's episode ends there, scored.
            asyncio.run(twice())


def test_the_trainer_checks_the_sandbox_only_where_its_workers_run(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without isolation an agent's commands would reach run-api: refused where the trainer starts the workers,
    left to the launcher's side (which checks its own machine) where they run elsewhere; and vLLM's sleep mode,
    which loads weights inside generation, is refused for the endpoint's engine."""
    from types import SimpleNamespace

    from flywheel.training import atropos_mode
    from flywheel.training.run_logs import RunDir

    monkeypatch.setattr(atropos_mode, "isolation_available", lambda: False)
    cfg = GRPORunConfig(rl_mode="atropos", logs_root=str(tmp_path), num_rollouts_per_task=2, batch_size=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with pytest.raises(ValueError, match="needs the sandbox's isolation"):
        atropos_mode.AtroposMode(cfg, tiny_model, tokenizer, RunDir(tmp_path, "here"))
    elsewhere = atropos_mode.AtroposMode(cfg, tiny_model, tokenizer, RunDir(tmp_path, "there"), launcher=_Failing())
    assert elsewhere.fleet.workers == 0
    asleep = SimpleNamespace(vllm_generation=SimpleNamespace(enable_sleep_mode=True))
    with pytest.raises(ValueError, match="turn vLLM's sleep mode off"):
        PolicyEndpoint.on_vllm(asleep, max_new_tokens=8)


def test_a_groups_log_probs_travel_with_unknown_ones_as_filler() -> None:
    """A rollout whose reply log-probs the engine gave and one it did not (NaN) share a group: the known
    ones reach the trainer, the unknown ones come back as NaN (no correction), never as a number."""
    import math
    from types import SimpleNamespace

    from flywheel.training.env_worker import scored_group
    from flywheel.training.rollouts import Trajectory
    from flywheel.training.trajectory_api import atropos_rollout_func

    env = SimpleNamespace(name="tool_use_chain", tokenizer=SimpleNamespace(eos_token_id=0))
    result = SimpleNamespace(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                             task_completed=True)  # fmt: skip
    outcomes = [
        (result, 1.0, Trajectory(prompt_ids=[5, 6], completion_ids=[7, 8], mask=[1, 1], logprobs=[-0.5, -0.25],
                                 turns=1, versions=[3])),
        (result, 0.0, Trajectory(prompt_ids=[5, 6], completion_ids=[9, 10], mask=[1, 1],
                                 logprobs=[math.nan, -0.75], turns=1, versions=[2])),
    ]  # fmt: skip
    group = scored_group(env, {"item_id": "i"}, outcomes, limit=16)  # type: ignore[arg-type]
    assert group["inference_logprobs"] == [[1.0, 1.0, -0.5, -0.25], [1.0, 1.0, 1.0, -0.75]]
    assert group["group_overrides"]["policy_version"] == 2 and group_problem(group, 2, 1000) is None
    queue = SimpleNamespace(take=lambda count, step: [group])
    for use_vllm in (True, False):
        trainer = SimpleNamespace(state=SimpleNamespace(global_step=3), use_vllm=use_vllm)
        out = atropos_rollout_func(queue, 2, 16)([None, None], trainer)  # type: ignore[arg-type]
        if not use_vllm:
            assert out["logprobs"] is None  # TRL corrects on vLLM only.
            continue
        first, second = out["logprobs"]
        assert first == [-0.5, -0.25] and math.isnan(second[0]) and second[1] == -0.75
    unknown = [(r, s, Trajectory(prompt_ids=t.prompt_ids, completion_ids=t.completion_ids, mask=t.mask,
                                 logprobs=[math.nan] * 2, turns=1, versions=[2])) for r, s, t in outcomes]  # fmt: skip
    assert "inference_logprobs" not in scored_group(env, {"item_id": "i"}, unknown, limit=16)  # type: ignore[arg-type]


_RUN = """
import os, signal, sys
import psutil
from transformers import TrainerCallback
from flywheel.data import ArtifactStore
from flywheel.environments.errors import ContextFull
from flywheel.training.grpo import GRPORunConfig, run_grpo

class Kills(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):  # An env worker, after step 1.
        if state.global_step == 1:
            workers = [p for p in psutil.Process().children() if "flywheel.training.env_worker" in p.cmdline()]
            os.kill(workers[0].pid, signal.SIGKILL)
    def on_save(self, args, state, control, **kwargs):  # The trainer, after step 2's checkpoint.
        if state.global_step == 2 and sys.argv[3] == "kill":
            with open(sys.argv[4], "w") as out:  # Its fleet: run-api and the workers.
                out.write(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)))
            os.kill(os.getpid(), signal.SIGKILL)

cfg = GRPORunConfig.model_validate_json(sys.argv[1])
run_grpo(cfg, ArtifactStore(sys.argv[2]), callbacks=[Kills()])
"""


def _train(cfg: GRPORunConfig, store: ArtifactStore, kill: bool, fleet: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", _RUN, cfg.model_dump_json(), store.url, "kill" if kill else "no", str(fleet)]
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}  # The env workers import the test's env too.
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environ, timeout=900)


def _left_running(pids: list[int]) -> list[int]:
    """Those of `pids` still alive after 10 s."""
    left = pids
    for _ in range(50):
        left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if not left:
            break
        time.sleep(0.2)
    return left


def test_atropos_grpo_outlives_a_killed_env_worker_and_resumes_after_a_trainer_kill(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Tiny model, 2 env workers, max_async_level 1, an env scored by the share of vowels (rewards that
    differ, so steps move the weights). Run 1: a worker SIGKILLed after step 1 is started again; the
    trainer SIGKILLed after step 2's checkpoint takes its workers and run-api with it. Run 2 resumes
    at step 3 with a fleet of its own, on groups of the step-2 weights or newer: none re-tokenised."""
    cfg = GRPORunConfig(
        policy_model=str(tiny_model), total_steps=3, save_steps=1, batch_size=2, gradient_accumulation_steps=2,
        num_rollouts_per_task=2, max_completion_length=24, num_tasks=4, logs_root=str(tmp_path / "first"),
        output_name="rl-atropos", max_agent_turns=2, envs=["tests.training.test_checkpoints:VowelShareFileStats"],
        rl_mode="atropos", env_workers=2, max_async_level=1, drop_flat_groups=False, device="cpu",
    )  # fmt: skip
    store = ArtifactStore(tmp_path / "store")
    fleet = tmp_path / "fleet.txt"
    first = _train(cfg, store, kill=True, fleet=fleet)
    assert first.returncode == -9, first.stderr[-3000:]
    assert "env worker 0 exited (code -9): restarting it" in first.stderr
    pids = [int(pid) for pid in fleet.read_text().split()]
    assert len(pids) >= 3 and _left_running(pids) == []  # run-api and both workers died with the trainer.
    again = cfg.model_copy(update={"logs_root": str(tmp_path / "again")})
    second = _train(again, store, kill=False, fleet=fleet)
    assert second.returncode == 0, second.stderr[-3000:]
    manifest = store.manifest(store.resolve("checkpoint/rl-atropos"))
    fed = manifest.metrics["atropos"]
    assert manifest.metrics["steps"] == 3 and fed["groups_trained"] == 2 and fed["mean_age_steps"] <= 1
    assert fed["refused"].get("malformed", 0) == 0 and fed["endpoint_replies"] >= 4
    run_dir = next((tmp_path / "again").glob("run-*"))
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").open()) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]  # Steps 1-2 carried over, 3 trained here.
    assert all(m["grad_norm"] > 0 for m in steps) and steps[-1]["reward_std"] > 0
    assert steps[-1]["rollouts_retokenized"] == 0 and steps[-1]["atropos/groups_trained"] == 2
    assert {p.name for p in (run_dir / "envs").iterdir()} == {
        "atropos-run.json",
        "run-api.log",
        "env-worker-0.log",
        "env-worker-1.log",
    }  # The workers' config and logs.


def test_atropos_mode_refuses_env_instances(model_store: ArtifactStore, tiny_model: Path, tmp_path: Path) -> None:
    """Workers build their envs from names: an instance (its own config) would be silently rebuilt."""
    from flywheel.environments.registry import env_class
    from flywheel.training.grpo import run_grpo

    cfg = GRPORunConfig(rl_mode="atropos", logs_root=str(tmp_path), num_rollouts_per_task=2, batch_size=2)
    env = env_class("tool_use_chain")(tokenizer_name=str(tiny_model))
    with pytest.raises(ValueError, match="pass envs by name, module:Class or file path, not instances"):
        run_grpo(cfg, model_store, envs=[env])
    assert not list(tmp_path.glob("run-*/envs"))  # Nothing started.


_SERVE = """
import sys
from pathlib import Path
from flywheel.training.atropos_mode import serve_env_workers
from flywheel.training.grpo import GRPORunConfig

cfg = GRPORunConfig.model_validate_json(sys.argv[1])
serve_env_workers(cfg, Path(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]), poll=0.5)
"""


class WorkersHere:
    """A `WorkerLauncher` as `flows.env_workers.DeployedWorkers` is one, without Prefect: the same
    `serve_env_workers` in a process of this machine (`fail`: starting them raises)."""

    def __init__(self, cfg: GRPORunConfig, log_dir: Path, fail: bool = False) -> None:
        self.cfg, self.log_dir, self.fail = cfg, log_dir, fail
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped = False

    def start(self, api_url: str, policy_url: str) -> None:
        if self.fail:
            raise RuntimeError("no cpu pool")
        command = [sys.executable, "-c", _SERVE, self.cfg.model_dump_json(), self.cfg.policy_model, api_url,
                   policy_url, str(self.log_dir)]  # fmt: skip
        self.process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def problem(self) -> str | None:
        code = self.process.poll() if self.process else None
        return f"the workers' process exited {code}" if code else None

    def stop(self) -> None:
        self.stopped = True
        if self.process is not None:
            self.process.wait(timeout=120)


def test_a_launched_atropos_trainer_hands_its_env_workers_to_the_launching_process(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`accelerate launch` runs the trainer (as on a GPU node, in a runtime without Prefect); the launching
    process starts the env workers with the URLs the trainer handed back, where its launcher puts them
    (here: a process beside it), and they end with the trainer."""
    from flywheel.training.launch import launch

    cfg = GRPORunConfig(
        policy_model=str(tiny_model), total_steps=1, batch_size=2, gradient_accumulation_steps=2,
        num_rollouts_per_task=2, max_completion_length=24, num_tasks=4, logs_root=str(tmp_path / "logs"),
        output_name="rl-launched", max_agent_turns=2, envs=["tests.training.test_checkpoints:VowelShareFileStats"],
        rl_mode="atropos", env_workers=1, drop_flat_groups=False, device="cpu",
    )  # fmt: skip
    workers = WorkersHere(cfg, tmp_path / "workers")
    store = ArtifactStore(tmp_path / "store")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # The launched trainer imports the test's env too.
    manifest = launch(cfg, store, 1, env_workers=workers)
    assert manifest.metrics["steps"] == 1 and manifest.metrics["atropos"]["groups_trained"] == 2
    assert workers.stopped and workers.process is not None and workers.process.returncode == 0
    assert (tmp_path / "workers" / "env-worker-0.log").exists()
    trainer_envs = next((tmp_path / "logs").glob("run-*/envs"))
    assert not list(trainer_envs.glob("env-worker-*.log"))  # The trainer started none of its own.


def test_the_hand_off_passes_back_why_the_workers_cannot_run(tmp_path: Path) -> None:
    """The launching side starts the workers once the trainer's URLs arrive; a failure to start them, or a
    problem they report later, reaches the trainer's `HandOff.problem` (its group queue fails with it)."""
    from flywheel.training.worker_handoff import HandOff, relaying

    cfg = GRPORunConfig()
    for launcher, expected in (
        (WorkersHere(cfg, tmp_path, fail=True), "the env workers could not be started: RuntimeError('no cpu pool')"),
        (_Failing(), "the workers' pool is gone"),
    ):
        folder = tmp_path / type(launcher).__name__
        folder.mkdir()
        with relaying(launcher, folder, poll=0.05) as environ:
            trainer_side = HandOff(Path(environ["FLYWHEEL_ENV_WORKERS_HANDOFF"]))
            assert trainer_side.problem() is None
            trainer_side.start("http://api", "http://policy")
            for _ in range(100):
                if trainer_side.problem():
                    break
                time.sleep(0.05)
            assert trainer_side.problem() == expected
        assert launcher.stopped  # Stopped when the trainer exits, started or not (its failure only logged).


class _Failing:
    """Workers that started, then lost their pool; the first question about them fails (an API hiccup),
    and so does stopping them."""

    def __init__(self) -> None:
        self.started: tuple[str, str] | None = None
        self.asked = 0
        self.stopped = False

    def start(self, api_url: str, policy_url: str) -> None:
        self.started = (api_url, policy_url)

    def problem(self) -> str | None:
        self.asked += 1
        if self.asked == 1:
            raise ConnectionError("the orchestrator did not answer")
        return "the workers' pool is gone" if self.started == ("http://api", "http://policy") else None

    def stop(self) -> None:
        self.stopped = True
        raise ConnectionError("the orchestrator did not answer")
