"""GRPO's run config, apart from its trainer (TRL's layout): a round's config, `flywheel plan` and the
CLI read it without importing transformers, TRL or the environments' rollout machinery."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from flywheel.training.config import RunnerConfig


class GRPORunConfig(RunnerConfig):
    """GRPO on the environments: the runner knobs plus where generation runs."""

    algorithm: Literal["grpo"] = Field(default="grpo", description="Always grpo.")
    use_vllm: bool | None = Field(
        default=None,
        description="Generate with vLLM (None: on CUDA yes, on CPU no); in atropos mode the policy endpoint serves "
        "that engine.",
    )
    vllm_mode: Literal["colocate"] = Field(
        default="colocate",
        description="vLLM in each training process. TRL's server mode is not offered: its generate is a collective "
        "call, and the env loops of different ranks call it a different number of times (a hang).",
    )
    screen_tasks: int = Field(
        default=0,
        ge=0,
        description="Screen up to N tasks with the initial policy; train on those whose group rewards differ (0: off).",
    )
    rl_mode: Literal["sync", "atropos"] = Field(
        default="sync",
        description="sync: the trainer rolls each step's tasks itself. atropos: env workers roll against the "
        "trainer's policy endpoint and post groups to atroposlib's run-api, which the trainer consumes "
        "(generation overlaps training).",
    )
    env_workers: int = Field(default=2, ge=1, description="atropos mode: env worker processes (over `envs` in turn).")
    max_async_level: int = Field(
        default=1, ge=0, description="atropos mode: train on groups at most this many steps older than the weights."
    )
    env_workers_deployment: str | None = Field(
        default=None,
        description="atropos mode: run the env workers as a run of this Prefect deployment (env-workers/atropos: "
        "the cpu pool) instead of as the trainer's child processes.",
    )
    serve_host: str = Field(
        default="127.0.0.1",
        description="atropos mode: the interface run-api and the policy endpoint listen on (0.0.0.0: every "
        "interface, reached by this machine's name; for env workers on other machines).",
    )
    drop_flat_groups: bool = Field(
        default=True, description="atropos mode: env workers drop groups whose rollouts all scored alike (no signal)."
    )

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.ref_model not in (None, self.policy_model):
            problems.append("GRPO's KL reference is the initial policy: leave ref_model empty or equal to policy_model")
        if self.rl_mode == "atropos" and self.screen_tasks:
            problems.append("rl_mode=atropos screens nothing (the workers drop flat groups): set screen_tasks=0")
        if self.rl_mode != "atropos" and self.env_workers_deployment:
            problems.append("env_workers_deployment places atropos mode's env workers: set rl_mode=atropos")
        if self.use_vllm and self.device == "cpu":
            problems.append("use_vllm needs device=cuda (vLLM's wheel is CUDA-only)")
        if self.top_k and (self.use_vllm or (self.use_vllm is None and self.device == "cuda")):
            problems.append(
                f"top_k={self.top_k} with vLLM: vLLM's sampling log-probs are renormalised over the top k while the "
                "trainer scores the whole distribution, so the importance correction would discount every rollout; "
                "set top_k=0"
            )
        return problems

    def vllm(self) -> bool:
        """Whether generation runs on vLLM: as set, else wherever the run is on CUDA."""
        return self.use_vllm if self.use_vllm is not None else self.settings().device == "cuda"


def grpo_kwargs(cfg: GRPORunConfig, output_dir: str) -> dict[str, Any]:
    """`GRPOConfig` fields for the run's device (pure, so the CUDA settings are checked on CPU machines)."""
    args: dict[str, Any] = {
        **cfg.trainer_kwargs(output_dir),
        "num_generations": cfg.num_rollouts_per_task,
        "max_completion_length": cfg.max_completion_length,
        "beta": cfg.kl_beta,
        "scale_rewards": "group",
        "temperature": cfg.temperature,
        "top_k": cfg.sampling_top_k(cfg.vllm()),
    }
    if cfg.vllm():
        args.update(use_vllm=True, vllm_mode=cfg.vllm_mode)
        if cfg.rl_mode == "atropos":
            # A group up to max_async_level steps old and thousands of tokens long: TRL's default sequence-level
            # mask would drop it whole for a drift that per-token truncation (TIS) corrects.
            args["vllm_importance_sampling_mode"] = "token_truncate"
    return args
