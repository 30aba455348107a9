"""`flywheel plan`: what each stage of a round would run, as JSON, without running anything.

The plan is built by the same functions the stages call (`work.sft_config`, `work.rl_config`,
`work.server_config`, the trainers' argument builders and `accelerate` / server command lines),
so what it prints is what a round on that device does.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from flywheel.data.store import STORE_ENV
from flywheel.flows import work
from flywheel.flows.env_workers import DEPLOYMENT
from flywheel.flows.infra import H100_TEMPLATE
from flywheel.flows.round_config import RoundConfig
from flywheel.flows.stages import POOLS, STAGES
from flywheel.inference import build_command
from flywheel.training.config import ConfigError
from flywheel.training.device import DeviceSettings, resolve_device
from flywheel.training.grpo_config import grpo_kwargs
from flywheel.training.launch import Machines, launch_command
from flywheel.training.memory import GB, model_shape, serving_memory, summary
from flywheel.training.sft_config import sft_kwargs

RUN_DIR = "logs/run-<stamp>-<name>/checkpoints"


def round_plan(config: RoundConfig, profile: str | None = None) -> dict[str, Any]:
    """Every stage of a round of `config` (`auto` device resolved here); `profile` names it in the output."""
    p = config.model_copy(update={"device": resolve_device(config.device)})
    settings = DeviceSettings.for_device(p.device)
    common: dict[str, Any] = {"round_no": 1, "config": p}
    sft = work.sft_config(work.SFTParams(**common, base=f"model/{p.model}", dataset="<round-1 SFT dataset>"))
    rl = work.rl_config(work.RLParams(**common, policy="<round-1 SFT checkpoint>"))
    server = work.server_config(p, f"<cache>/{p.model}", planned=True)
    stages: dict[str, dict[str, Any]] = {name: _placement(name, p, settings) for name in STAGES}
    stages["generate"] |= {"envs": p.envs, **p.generate.model_dump(), "curriculum": p.curriculum.mode}
    if p.generate.teacher == "policy" or p.curriculum.mode == "mined":  # Learnable slices: the round's model, served.
        stages["generate"] |= _served(server, settings)
    for name, cfg, kwargs, trainer in (
        ("sft", sft, sft_kwargs(sft, RUN_DIR), "trl.SFTTrainer"),
        ("rl", rl, grpo_kwargs(rl, RUN_DIR), "trl.GRPOTrainer"),
    ):
        gpus = p.training_gpus(cfg)
        stages[name] |= {
            "trainer": trainer,
            "dtype": settings.model_kwargs()["dtype"],
            "attn_implementation": settings.attn_implementation,
            "config": cfg.model_dump(mode="json"),
            "trainer_args": kwargs,
            "launch": launch_command(cfg, f"<{name} config>.yaml", gpus) if work.launched(cfg, p) else None,
        }
        if p.device == "cuda":
            stages[name]["gpus"] = gpus
        if p.nodes > 1 and not p.trains_alone(cfg):
            stages[name]["machines"] = _machines(name, cfg, p)
    stages["rl"]["generation"] = f"vllm {rl.vllm_mode}" if rl.vllm() else "in-process (transformers generate)"
    if rl.rl_mode == "atropos":
        endpoint = f"TRL's vllm {rl.vllm_mode} engine" if rl.vllm() else "a transformers copy of the weights"
        stages["rl"]["generation"] = f"atropos: env workers -> run-api -> trainer; the policy endpoint: {endpoint}"
        stages["rl"]["env_workers"] = _env_workers(rl)
    stages["evaluate"] |= _served(server, settings) | {**p.eval.model_dump(), "max_agent_turns": p.max_agent_turns}
    lm_eval = work.lm_eval_config(work.LMEvalParams(**common, model=f"model/{p.model}", name="lm-eval-r1"))
    stages["lm_eval"] |= {"config": lm_eval.model_dump(mode="json")}
    if p.device == "cuda":
        _memory(p, stages, {"sft": sft, "rl": rl}, server)
    return {"profile": profile, "device": p.device, "model": p.model, "gpus": p.gpus, "stages": stages}


def _env_workers(rl: Any) -> dict[str, Any]:
    """Where atropos mode's env workers run and how they reach the trainer."""
    from flywheel.training.grpo import weighted_envs

    where: dict[str, Any] = {"processes": max(rl.env_workers, len(weighted_envs(rl))), "envs": weighted_envs(rl)}
    if rl.env_workers_deployment:
        pool = POOLS["cpu"] if rl.env_workers_deployment == DEPLOYMENT else "the deployment's (prefect.yaml)"
        where |= {"deployment": rl.env_workers_deployment, "pool": pool}
    else:
        where["runs_as"] = "child processes of the trainer"
    return where | {"run_api_and_policy_endpoint_on": rl.serve_host, "max_async_level": rl.max_async_level}


def _memory(p: RoundConfig, stages: dict[str, dict[str, Any]], trained: dict[str, Any], server: Any) -> None:
    """Each GPU stage's memory per GPU (training/memory.py); a stage over the GPU's memory fails the plan,
    naming its largest term."""
    shape = model_shape(p.model)
    if shape is None:
        for name in (n for n, s in STAGES.items() if s.gpu):
            stages[name]["memory"] = f"unknown: no config.json for {p.model} (a local HF dir) nor a known shape"
        return
    capacity = p.gpu_memory_gb * GB
    for name, cfg in trained.items():
        stages[name]["memory"] = summary(p.memory_estimate(name, cfg.model_dump(), shape), capacity)
    share = server.gpu_memory_utilization * capacity  # What vLLM takes of the GPU; its weights must leave KV room.
    served = serving_memory(shape, server.tensor_parallel_size, share)
    for name in ("generate", "evaluate", "lm_eval"):  # A vLLM server each (lm-eval's vllm backend alike).
        if "server" in stages[name] or name == "lm_eval":
            stages[name]["memory"] = summary(served, share)
    over = [(name, s["memory"]) for name, s in stages.items() if isinstance(s.get("memory"), dict)
            and not s["memory"]["fits"]]  # fmt: skip
    if over:
        name, memory = over[0]
        raise ConfigError(
            f"{name} needs ~{memory['per_gpu_gb']} GB per GPU of {memory['capacity_gb']} (largest: {memory['largest']} "
            f"{memory['terms_gb'][memory['largest']]} GB): lower its batch_size, spread the model over more GPUs "
            "(gpus, deepspeed: zero3) or pick a smaller one"
        )


def _machines(name: str, cfg: Any, p: RoundConfig) -> dict[str, Any]:
    """A training stage across `p.nodes` machines: each one's launch, and the Kubernetes objects that run
    them (an Indexed Job, a pod per machine whose index is its machine rank, and the headless Service
    that gives pod 0 the address every launcher meets at)."""
    job, config, gpus = f"flywheel-{name}", f"<{name} config>.yaml", p.training_gpus(cfg)
    lines = [launch_command(cfg, config, gpus, machines=Machines(p.nodes, rank, "<machine 0 address>"))
             for rank in range(p.nodes)]  # fmt: skip
    pod = launch_command(cfg, config, gpus, machines=Machines(p.nodes, 0, f"{job}-0.{job}"))
    pod[pod.index("--machine_rank") + 1] = "$JOB_COMPLETION_INDEX"
    shell = " ".join(part if part.startswith("$") else shlex.quote(part) for part in pod)
    variables = json.loads(H100_TEMPLATE.read_text())["variables"]["properties"]  # The h100 pool's pod defaults.
    defaults = {key: variable.get("default") for key, variable in variables.items()}
    resources = {"nvidia.com/gpu": gpus, "cpu": defaults["cpu_request"], "memory": defaults["memory_request"]}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": job},
        "spec": {"clusterIP": "None", "selector": {"job-name": job}, "ports": [{"port": Machines().port}]},
    }  # fmt: skip
    container = {
        "name": "train", "image": defaults["image"], "command": ["sh", "-c", shell],
        "env": [{"name": STORE_ENV, "value": "<store url>"}],
        "resources": {"requests": resources, "limits": resources},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }  # fmt: skip
    pods = {
        "subdomain": job, "restartPolicy": "Never", "containers": [container],
        "nodeSelector": {"nvidia.com/gpu.product": defaults["gpu_product"]},
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": defaults["shm_size"]}}],
    }  # fmt: skip
    indexed = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job},
        "spec": {"completionMode": "Indexed", "completions": p.nodes, "parallelism": p.nodes, "backoffLimit": 0,
                 "template": {"spec": pods}},
    }  # fmt: skip
    return {"count": p.nodes, "gpus_each": gpus, "launch": lines, "kubernetes": [service, indexed]}


def _placement(name: str, p: RoundConfig, settings: DeviceSettings) -> dict[str, Any]:
    """Where a stage runs: its work pool, device and GPUs (CPU stages run on CPU on any profile)."""
    gpu = STAGES[name].gpu
    return {"pool": STAGES[name].pool, "device": settings.device if gpu else "cpu", "gpus": p.gpus if gpu else 0}


def _served(server: Any, settings: DeviceSettings) -> dict[str, Any]:
    return {
        "device": settings.device,
        "server": {"backend": server.backend, "dtype": server.dtype, "command": build_command(server, 8000)},
    }
