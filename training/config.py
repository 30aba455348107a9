"""Training configs: `TrainConfig` (what every run shares) and `RunnerConfig` (RL on the environments).

    flywheel train rl --config training/configs/grpo_tiny.yaml kl_beta=0.05 total_steps=20

Each algorithm's own config lives beside its trainer, TRL-style (`SFTRunConfig` in
`training/sft.py`, `GRPORunConfig` in `training/grpo.py`, `DPORunConfig` in `training/dpo.py`);
`training/registry.py` maps an algorithm name to both. Validation reports every problem at
once and says what to set.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flywheel.environments.registry import ENVIRONMENTS, is_env_spec
from flywheel.training.device import DeviceChoice, DeviceSettings
from flywheel.training.distributed import launched

logger = logging.getLogger(__name__)

MIN_KL_BETA = 0.01
MAX_CONFIG_BYTES = 1024 * 1024  # Configs are a few KiB; a bigger one is a wrong path, not a config.
DEEPSPEED_DIR = Path(__file__).parent / "deepspeed"


class ConfigError(ValueError):
    """A config file or override is invalid; the message lists every problem."""


class TrainConfig(BaseModel):
    """What every training run shares (SFT, GRPO, DPO): the model, the optimiser, the device, the logs.

    Unknown fields are an error. `device` decides precision, attention, memory savers and
    backends (`flywheel.training.device`); `auto` is CUDA when a GPU is visible.
    """

    model_config = ConfigDict(extra="forbid")

    # -- models
    policy_model: str = Field(default="tiny", description="Model to train: smollm2 | tiny | store ref | dir | HF id.")
    algorithm: str = Field(default="sft", description="Training algorithm (flywheel.training.registry).")
    # -- optimisation
    batch_size: int = Field(default=4, ge=1, description="Examples (or completions) per device per micro-batch.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(default=1e-5, gt=0, description="Peak learning rate.")
    warmup_ratio: float = Field(default=0.1, ge=0, lt=1, description="Share of steps spent warming up.")
    total_steps: int = Field(default=10, ge=1, description="Optimizer steps.")
    seed: int = Field(default=0, description="Seed for data order, sampling and initialisation.")
    # -- hardware
    device: DeviceChoice = Field(default="auto", description="cpu | cuda | auto (CUDA when a GPU is visible).")
    num_threads: int = Field(default=1, ge=1, description="cpu: torch threads (one beat two under load).")
    deepspeed: Literal["zero2", "zero3", "zero3_offload"] | None = Field(
        default=None, description="DeepSpeed ZeRO config from training/deepspeed/ (also runs on CPU via gloo)."
    )
    fsdp: bool = Field(default=False, description="Shard with FSDP across the launched GPUs (instead of ZeRO).")
    gradient_checkpointing: bool | None = Field(
        default=None,
        description="Recompute activations in the backward: memory for time (None: the device's default, on for "
        "CUDA, off for CPU).",
    )
    mixed_precision: bool | None = Field(
        default=None,
        description="bf16 autocast over fp32 weights on CPU (None: the device's default, on where the CPU has bf16 "
        "dot products; CUDA always trains in bf16).",
    )
    # -- checkpoints and logging
    save_steps: int = Field(
        default=0, ge=0, description="Step checkpoint every N steps, mirrored to the store (0: off)."
    )
    resume: bool = Field(default=True, description="Continue from this run's last step checkpoint in the store.")
    report_to: list[str] = Field(default_factory=list, description="e.g. ['wandb'] (WANDB_MODE=offline works).")
    logs_root: str = Field(default="logs", description="Where run folders go.")
    output_name: str = Field(default="train", description="Name of the checkpoint artifact.")

    @model_validator(mode="after")
    def _check_sharding(self) -> TrainConfig:
        if self.fsdp and self.deepspeed:
            raise ValueError(f"choose one of fsdp and deepspeed={self.deepspeed}, not both")
        return self

    def settings(self) -> DeviceSettings:
        """What `device` means for this run (dtype, attention, memory savers)."""
        return DeviceSettings.for_device(self.device)

    def trainer_kwargs(self, output_dir: Path | str) -> dict[str, Any]:
        """The fields every TRL trainer's config shares (`TrainingArguments` plus TRL's `model_init_kwargs`: the
        trainers load the model from its path after the args exist, so ZeRO-3 shards it as it loads); pure:
        `flywheel plan` shows them."""
        kwargs: dict[str, Any] = {
            "output_dir": str(output_dir),
            "max_steps": self.total_steps,
            "learning_rate": self.learning_rate,
            "warmup_steps": max(1, int(self.warmup_ratio * self.total_steps)) if self.warmup_ratio else 0,
            "per_device_train_batch_size": self.batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "seed": self.seed,
            "logging_steps": 1,
            "logging_nan_inf_filter": False,  # The NaN guard must see a NaN, not a smoothed stand-in.
            "save_strategy": "steps" if self.save_steps else "no",
            "save_steps": self.save_steps or self.total_steps,
            "save_total_limit": 2,  # The newest step checkpoint, and the one before while it is written.
            "report_to": self.report_to or "none",
            "disable_tqdm": not sys.stderr.isatty(),  # A progress bar on a terminal only.
            "model_init_kwargs": self.settings().model_kwargs(),
            **self.settings().trainer_kwargs(),
        }
        if self.gradient_checkpointing is not None:
            kwargs["gradient_checkpointing"] = self.gradient_checkpointing
        if self.mixed_precision is not None:
            kwargs["bf16"] = self.mixed_precision
        if self.deepspeed:  # DeepSpeed also runs on CPU (gloo), without `use_cpu`, so in fp32 there.
            kwargs["deepspeed"] = str(DEEPSPEED_DIR / f"{self.deepspeed}.json")
            if kwargs.pop("use_cpu", False):
                if self.mixed_precision:
                    raise ValueError("mixed_precision on CPU cannot run under DeepSpeed (it runs without use_cpu)")
                kwargs["bf16"] = False
                if launched():  # Ranks of one CPU launch: see `training_arguments`.
                    kwargs["accelerator_config"] = {"use_configured_state": True}
        if self.fsdp:
            kwargs["fsdp"] = "full_shard auto_wrap"
        return kwargs


class RunnerConfig(TrainConfig):
    """RL / preference training on the environments: the `AtroposRunner` knobs (GRPO and DPO build on it)."""

    algorithm: Literal["grpo", "dpo", "ppo"] = Field(default="grpo", description="RL / preference algorithm.")
    ref_model: str | None = Field(default=None, description="KL reference; None means the initial policy.")
    kl_beta: float = Field(default=0.04, ge=0, description="KL penalty to the reference model.")
    allow_low_kl: bool = Field(default=False, description="Permit kl_beta below 0.01 (with a warning).")
    output_name: str = Field(default="rl", description="Name of the checkpoint artifact.")
    # -- rollouts
    envs: list[str] = Field(default=["tool_use_chain"], description="Environments to train on.")
    num_rollouts_per_task: int = Field(default=4, ge=2, description="Completions per prompt (the group).")
    num_tasks: int = Field(default=64, ge=1, description="Distinct tasks in the training set.")
    difficulty: str | None = Field(default=None, description="Only tasks of this difficulty.")
    categories: list[str] | None = Field(
        default=None, description="Only tasks of these categories, in each env that has them."
    )
    task_mix: dict[str, dict[str, float]] | None = Field(
        default=None, description="Env -> 'category/difficulty' -> task weight (a round's curriculum)."
    )
    max_completion_length: int = Field(default=256, ge=8, description="Tokens per completion, tool output included.")
    max_agent_turns: int = Field(
        default=9, ge=1, description="Agent turns per rollout, capping the env's own (the env config's name)."
    )
    max_token_length: int | None = Field(
        default=None, ge=8, description="Tokens per model reply (None: the env's own; the env config's name)."
    )
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    top_k: int | None = Field(
        default=None,
        ge=0,
        description="Top-k sampling (0: off; None: 10 generating in-process, where small models need it, "
        "0 on vLLM, whose log-probs are taken after top-k).",
    )
    rollouts_every: int = Field(default=5, ge=1, description="Save sampled rollouts every N steps.")

    @model_validator(mode="after")
    def _check(self) -> RunnerConfig:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))
        if self.kl_beta < MIN_KL_BETA:
            logger.warning(
                "kl_beta=%s is below %s: the policy may drift far from the reference", self.kl_beta, MIN_KL_BETA
            )
        return self

    def sampling_top_k(self, on_vllm: bool = False) -> int:
        """`top_k` as set, else 10 in-process and 0 on vLLM."""
        return self.top_k if self.top_k is not None else (0 if on_vllm else 10)

    def problems(self) -> list[str]:
        """Everything wrong with the settings, each with what to set (subclasses add theirs)."""
        problems = []
        if self.kl_beta < MIN_KL_BETA and not self.allow_low_kl:
            problems.append(f"kl_beta={self.kl_beta} is below {MIN_KL_BETA}; raise it or set allow_low_kl=true")
        if (self.batch_size * self.gradient_accumulation_steps) % self.num_rollouts_per_task:
            problems.append(
                f"batch_size={self.batch_size} x gradient_accumulation_steps={self.gradient_accumulation_steps} "
                f"(one step's completions) must be a multiple of num_rollouts_per_task={self.num_rollouts_per_task}"
            )
        unknown = [e for e in self.envs if not is_env_spec(e)]
        if unknown:
            problems.append(
                f"unknown envs {unknown}; known: {', '.join(ENVIRONMENTS)} (or module:Class, or a .py file)"
            )
        return problems


def load_config(model: type[BaseModel], path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Build `model` from a YAML file plus `key=value` overrides (values parsed as YAML)."""
    return validate_config(model, read_config(path, overrides), path)


def read_config(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """The fields a YAML file plus `key=value` overrides give, checked as text (no config class needed, so
    a broken file is reported before any trainer is imported)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(_read_capped(Path(path)).decode("utf-8"))
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
    return data


def _read_capped(path: Path) -> bytes:
    """The file's bytes, at most MAX_CONFIG_BYTES: `/dev/zero` or a huge file is refused, never read whole."""
    with open(path, "rb") as handle:
        data = handle.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path} is larger than {MAX_CONFIG_BYTES / 2**20:g} MiB: not a config file?")
    return data


def validate_config(model: type[BaseModel], data: dict[str, Any], path: str | Path | None = None) -> Any:
    """`model` from `read_config`'s fields; every unknown or invalid field named at once."""
    unknown = sorted(set(data) - set(model.model_fields))
    try:
        if unknown:
            raise ConfigError(f"unknown field(s) {unknown}; known: {', '.join(model.model_fields)}")
        return model.model_validate(data)
    except ValidationError as err:
        lines = [f"{'.'.join(map(str, e['loc'])) or 'config'}: {error_message(e)}" for e in err.errors()]
        raise ConfigError(f"invalid config {path or ''}: " + " | ".join(lines)) from err


def error_message(error: Any) -> str:
    """A pydantic error's message without its "Value error, " prefix."""
    return str(error["msg"]).removeprefix("Value error, ")


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
