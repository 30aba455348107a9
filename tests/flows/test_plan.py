"""`flywheel plan`: the h100 plan is a GPU plan, the cpu plan a CPU one, built from the stages' own configs;
a plan across machines shows each machine's launch and the Kubernetes objects, which a round refuses to run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flywheel.flows import work
from flywheel.flows.plan import round_plan
from flywheel.flows.round_config import load_round_config, profile
from flywheel.flows.stages import STAGES
from flywheel.inference.server import vllm_cli
from flywheel.training.config import ConfigError
from flywheel.training.device import cpu_computes_bf16
from flywheel.training.launch import accelerate_cli


def _strings(value: Any) -> list[str]:
    """Every string value in a JSON value, flattened."""
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def plan_of(name: str, device: str | None = None) -> dict[str, Any]:
    """The plan of shipped profile `name`, on `device` (None: the profile's)."""
    return round_plan(load_round_config(name, overrides=[f"device={device}"] if device else []), name)


def test_the_h100_plan_has_no_cpu_setting() -> None:
    plan = plan_of("h100")
    assert plan["device"] == "cuda" and plan["gpus"] == 8 and set(plan["stages"]) == set(STAGES)
    for name in (n for n, s in STAGES.items() if s.gpu):
        stage = plan["stages"][name]
        assert stage["device"] == "cuda" and stage["pool"] == "h100" and stage["gpus"] == 8, name
    for name in ("sft", "rl"):
        stage = plan["stages"][name]
        args = stage["trainer_args"]
        assert "use_cpu" not in args and args["bf16"] and args["gradient_checkpointing"], name
        assert stage["dtype"] == "float32" and args["deepspeed"].endswith("zero3.json"), name  # bf16: autocast.
        assert stage["launch"][:5] == [*accelerate_cli(), "--num_processes", "8"], name
    assert plan["stages"]["rl"]["trainer_args"]["use_vllm"] and plan["stages"]["rl"]["generation"] == "vllm colocate"
    for name in ("generate", "evaluate"):  # Every stage that serves on vLLM is on the GPU pool.
        stage = plan["stages"][name]
        command = stage["server"]["command"]
        assert stage["pool"] == "h100" and stage["gpus"] == 8, name
        assert command[:4] == [*vllm_cli(), "serve"] and command[command.index("--data-parallel-size") + 1] == "8"
        assert command[command.index("--served-model-name") + 1] == "Qwen2.5-1.5B-Instruct"
    assert "bfloat16" in command and not any("transformers" in s for s in _strings(plan["stages"]))


def test_the_cpu_plan_has_no_cuda_setting() -> None:
    plan = plan_of("default", "cpu")
    assert {stage["device"] for stage in plan["stages"].values()} == {"cpu"}
    strings = _strings(plan)
    assert not any("cuda" in s or "vllm" in s or "bfloat16" in s for s in strings)
    for name in ("sft", "rl"):
        args = plan["stages"][name]["trainer_args"]
        assert args["use_cpu"] and plan["stages"][name]["launch"] is None
        assert args["bf16"] == cpu_computes_bf16(), name  # Autocast where the CPU has bf16 dot products.
        assert not any("vllm" in key for key in args), name
        assert args["gradient_checkpointing"], name  # The config's choice over the CPU default (off).
    assert plan["stages"]["evaluate"]["server"]["command"][2:4] == ["flywheel.inference.transformers_serve", "serve"]
    quick = plan_of("quick", "cpu")["stages"]["sft"]["trainer_args"]
    assert quick["gradient_checkpointing"] is False  # No choice in the profile: the device's default.


def test_a_device_override_turns_a_profile_around() -> None:
    """The profile sizes stay, the device settings follow the device: the plan and the stages share one source."""
    on_gpu = plan_of("default", "cuda")
    sft = on_gpu["stages"]["sft"]
    assert sft["trainer_args"]["bf16"] and sft["config"]["total_steps"] == profile("default").sft.total_steps
    p = load_round_config("default", overrides=["device=cuda"])
    cfg = work.sft_config(work.SFTParams(config=p, base="b", dataset="d"))
    assert on_gpu["stages"]["sft"]["config"] == {**cfg.model_dump(mode="json"), "policy_model": "model/smollm2",
                                                 "dataset": "<round-1 SFT dataset>"}  # fmt: skip
    scaled = work.sft_config(work.SFTParams(config=p, base="b", dataset="d", steps=26))  # A round's larger plan.
    assert scaled.total_steps == 26 != p.sft.total_steps


def test_plan_cli_prints_json_and_rejects_unknown_names() -> None:
    from tests.flows.test_cli import assert_one_line_error, run

    result = run("plan", "--profile", "h100", "--device", "cuda")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stages"]["sft"]["device"] == "cuda"
    assert_one_line_error(run("plan", "--profile", "h200"), "unknown profile 'h200'")
    assert_one_line_error(run("plan", "--device", "tpu"), "device: Input should be 'auto', 'cpu' or 'cuda'")
    with pytest.raises(ConfigError, match="unknown profile"):
        load_round_config("laptop")


def test_grpo_accumulates_micro_batches_so_a_group_may_span_them() -> None:
    """The default round trains GRPO one completion at a time (a quarter of the backward's activations):
    the group constraint is on a step's completions, not on a micro-batch."""
    cfg = work.rl_config(work.RLParams(config=profile("default"), policy="b", round_no=1))
    args = cfg.trainer_kwargs("out")
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (1, 4)
    assert cfg.problems() == []
    odd = cfg.model_copy(update={"gradient_accumulation_steps": 3})
    assert any("must be a multiple of num_rollouts_per_task=2" in problem for problem in odd.problems())


def test_grpo_on_vllm_is_launched_in_the_gpu_runtime_even_on_one_gpu() -> None:
    """vLLM cannot live in Prefect's environment: GRPO that generates with it runs as an accelerate child of
    `FLYWHEEL_GPU_PYTHON`, one process on one GPU (no --multi_gpu); SFT on one GPU trains in the stage."""
    plan = plan_of("h100")
    one = round_plan(load_round_config("h100", overrides=["gpus=1"]), "h100")
    assert one["stages"]["sft"]["launch"] is None
    launch = one["stages"]["rl"]["launch"]
    assert launch[:5] == [*accelerate_cli(), "--num_processes", "1"] and "--multi_gpu" not in launch
    assert plan["stages"]["rl"]["launch"][:5] == [*accelerate_cli(), "--num_processes", "8"]
    quick = load_round_config("quick", overrides=["device=cpu"])
    assert not work.launched(work.rl_config(work.RLParams(round_no=1, config=quick, policy="p")), quick)


def test_atropos_mode_on_h100_trains_on_one_gpu_behind_the_trainers_vllm_engine() -> None:
    """Atropos mode is one trainer process behind one policy endpoint: on an 8-GPU round its RL stage is
    planned (memory included) and launched on one GPU, unsharded, its endpoint TRL's vLLM engine."""
    plan = round_plan(load_round_config("h100", overrides=["rl.rl_mode=atropos"]), "h100")
    rl = plan["stages"]["rl"]
    assert rl["gpus"] == 1 and plan["stages"]["sft"]["gpus"] == 8
    assert rl["launch"][:5] == [*accelerate_cli(), "--num_processes", "1"] and "--multi_gpu" not in rl["launch"]
    assert rl["config"]["deepspeed"] is None and rl["trainer_args"]["use_vllm"]
    assert rl["generation"].endswith("the policy endpoint: TRL's vllm colocate engine")
    assert rl["memory"]["fits"]
    cpu = round_plan(load_round_config("default", overrides=["rl.rl_mode=atropos"]), "default")
    assert cpu["stages"]["rl"]["generation"].endswith("a transformers copy of the weights")
    two = round_plan(load_round_config("h100", overrides=["rl.rl_mode=atropos", "nodes=2"]), "h100")["stages"]
    assert "machines" in two["sft"] and "machines" not in two["rl"]  # One machine, whatever the round's.
    assert two["rl"]["launch"][:5] == [*accelerate_cli(), "--num_processes", "1"]


def test_the_atropos_rl_stage_launches_one_process_and_keeps_its_workers_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the stage runs, as the plan says: one process, and the deployment launcher stays with the stage
    (the launched trainer, without Prefect, hands its workers back)."""
    launched: list[tuple[int, Any]] = []
    monkeypatch.setattr(work, "launch", lambda cfg, store, gpus, env_workers=None: launched.append((gpus, env_workers)))
    overrides = ["rl.rl_mode=atropos", "rl.env_workers_deployment=env-workers/atropos"]
    config = load_round_config("h100", overrides=overrides)
    work.rl(work.RLParams(store_url=str(tmp_path), config=config, policy="checkpoint/sft-r1"))
    ((gpus, workers),) = launched
    assert gpus == 1 and workers.cfg.env_workers_deployment == "env-workers/atropos"


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_two_h100_machines_plan_a_launch_per_machine_and_a_kubernetes_job() -> None:
    """2 × 8 H100: each machine's accelerate launch (16 ranks, DeepSpeed's own per-machine launcher), an
    Indexed Job whose pod index is the machine rank, meeting at pod 0 through a headless Service; ZeRO
    shards over 16 GPUs, so each holds less optimizer state than on one machine."""
    one = plan_of("h100")["stages"]["sft"]
    two = round_plan(load_round_config("h100", overrides=["nodes=2"]), "h100")["stages"]["sft"]
    machines = two["machines"]
    assert machines["count"] == 2 and machines["gpus_each"] == 8 and "machines" not in one
    for rank, command in enumerate(machines["launch"]):
        assert command[: len(accelerate_cli())] == accelerate_cli()
        assert (_option(command, "--num_processes"), _option(command, "--num_machines")) == ("16", "2")
        assert _option(command, "--machine_rank") == str(rank)
        assert _option(command, "--deepspeed_multinode_launcher") == "standard"  # Not pdsh over ssh.
    service, job = machines["kubernetes"]
    pods = job["spec"]["template"]["spec"]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert service["spec"]["clusterIP"] == "None" and pods["subdomain"] == service["metadata"]["name"]
    (container,) = pods["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    shell = container["command"][-1]
    assert "--machine_rank $JOB_COMPLETION_INDEX" in shell
    assert f"--main_process_ip {job['metadata']['name']}-0.{service['metadata']['name']}" in shell  # Pod 0's name.
    assert two["memory"]["terms_gb"]["optimizer state"] < one["memory"]["terms_gb"]["optimizer state"]


def test_a_round_refuses_several_machines_before_it_starts(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flywheel.flows.cli", "--store", str(tmp_path), "round", "--profile", "tiny", "nodes=2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1 and result.stderr.startswith("error: nodes=2: a round trains on one machine")
    assert "log:" not in result.stdout  # Refused before any server or log started.
