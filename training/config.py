"""`RunnerConfig`: the runner knobs as one validated, YAML-loadable config.

    flywheel train rl --config training/configs/grpo_tiny.yaml kl_beta=0.05 total_steps=20

Validation reports every problem at once and says what to set.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from environments.registry import ENVIRONMENTS, is_env_spec

logger = logging.getLogger(__name__)

MIN_KL_BETA = 0.01


class ConfigError(ValueError):
    """A config file or override is invalid; the message lists every problem."""


class RunnerConfig(BaseModel):
    """One training run (RL or preference) with the runner knobs; unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")

    # -- models
    policy_model: str = Field(default="tiny", description="Model to train: smollm2 | tiny | ref | dir.")
    ref_model: str | None = Field(default=None, description="KL reference; None means the initial policy.")
    algorithm: Literal["grpo", "dpo", "ppo"] = Field(default="grpo", description="RL / preference algorithm.")
    # -- optimisation
    batch_size: int = Field(default=4, ge=1, description="Completions per optimizer step (per device).")
    learning_rate: float = Field(default=1e-5, gt=0, description="Peak learning rate.")
    warmup_ratio: float = Field(default=0.1, ge=0, lt=1, description="Share of steps spent warming up.")
    kl_beta: float = Field(default=0.04, ge=0, description="KL penalty to the reference model.")
    allow_low_kl: bool = Field(default=False, description="Permit kl_beta below 0.01 (with a warning).")
    total_steps: int = Field(default=10, ge=1, description="Optimizer steps.")
    seed: int = Field(default=0, description="Seed.")
    # -- rollouts
    envs: list[str] = Field(default=["tool_use_chain"], description="Environments to train on.")
    num_rollouts_per_task: int = Field(default=4, ge=2, description="Completions per prompt (the GRPO group).")
    num_tasks: int = Field(default=64, ge=1, description="Distinct tasks in the training set.")
    difficulty: str | None = Field(default=None, description="Only tasks of this difficulty.")
    categories: list[str] | None = Field(default=None, description="Only tasks of these categories.")
    max_completion_length: int = Field(default=256, ge=8, description="Tokens per completion, tool output included.")
    max_tool_calls: int = Field(default=8, ge=0, description="Tool-calling turns per rollout (env turns: this + 1).")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    top_k: int = Field(default=10, ge=0, description="Top-k sampling (0: off); small models need it.")
    # -- data (DPO)
    dataset: str | None = Field(default=None, description="Preference pairs artifact (DPO).")
    # -- hardware and logging
    profile: Literal["cpu", "h100"] = Field(default="cpu", description="Hardware profile.")
    num_threads: int = Field(default=1, ge=1, description="cpu profile: torch threads.")
    use_vllm: bool = Field(default=False, description="h100: generate with vLLM.")
    vllm_mode: Literal["server", "colocate"] = Field(default="colocate", description="vLLM beside or in-process.")
    vllm_server_base_url: str | None = Field(default=None, description="server mode: the `vllm serve` URL.")
    rollouts_every: int = Field(default=5, ge=1, description="Save sampled rollouts every N steps.")
    report_to: list[str] = Field(default_factory=list, description="e.g. ['wandb'] (WANDB_MODE=offline works).")
    logs_root: str = Field(default="logs", description="Where run folders go.")
    output_name: str = Field(default="rl", description="Name of the checkpoint artifact.")

    @model_validator(mode="after")
    def _check(self) -> RunnerConfig:
        problems = []
        if self.kl_beta < MIN_KL_BETA and not self.allow_low_kl:
            problems.append(f"kl_beta={self.kl_beta} is below {MIN_KL_BETA}; raise it or set allow_low_kl=true")
        if self.batch_size % self.num_rollouts_per_task:
            problems.append(
                f"batch_size={self.batch_size} must be a multiple of num_rollouts_per_task={self.num_rollouts_per_task}"
            )
        unknown = [e for e in self.envs if not is_env_spec(e)]
        if unknown:
            problems.append(
                f"unknown envs {unknown}; known: {', '.join(ENVIRONMENTS)} (or module:Class, or a .py file)"
            )
        if self.algorithm == "grpo" and self.ref_model not in (None, self.policy_model):
            problems.append("GRPO's KL reference is the initial policy: leave ref_model empty or equal to policy_model")
        if self.algorithm == "dpo" and not self.dataset:
            problems.append("algorithm=dpo needs dataset (a preference-pairs artifact)")
        if self.use_vllm and self.vllm_mode == "server" and not self.vllm_server_base_url:
            problems.append("vllm_mode=server needs vllm_server_base_url")
        if self.use_vllm and self.profile == "cpu":
            problems.append("use_vllm needs the h100 profile (vLLM's wheel is CUDA-only)")
        if problems:
            raise ValueError("; ".join(problems))
        if self.kl_beta < MIN_KL_BETA:
            logger.warning(
                "kl_beta=%s is below %s: the policy may drift far from the reference", self.kl_beta, MIN_KL_BETA
            )
        return self


def load_config(model: type[BaseModel], path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Build `model` from a YAML file plus `key=value` overrides (values parsed as YAML)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"config {path} is not UTF-8 text (a binary file?)") from err
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read config {path}: {_first_line(err)}") from err
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path} must be a mapping of field: value")
        data.update(loaded)
    for override in overrides or []:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{override}' must look like key=value")
        try:
            data[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"override '{override}': the value is not valid YAML ({_first_line(err)})") from err
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        raise ConfigError(f"config {path}: field names must be strings, got {bad_keys!r:.120}")
    unknown = sorted(set(data) - set(model.model_fields))
    try:
        if unknown:
            raise ConfigError(f"unknown field(s) {unknown}; known: {', '.join(model.model_fields)}")
        return model.model_validate(data)
    except ValidationError as err:
        lines = [f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in err.errors()]
        raise ConfigError(f"invalid config {path or ''}: " + " | ".join(lines)) from err


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
