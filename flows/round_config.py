"""A round as data: `RoundConfig`, nested sections owned by the stage that reads them.

    flywheel round --profile quick sft.total_steps=8
    flywheel round --config my_round.yaml rl.kl_beta=0.05

A section's field has the name, type, bounds and description of the run-config field it becomes
(`sft` -> `SFTRunConfig`, `rl` -> `GRPORunConfig`, `eval` -> `AgenticEvalConfig`, `lm_eval` ->
`LMEvalConfig`, `gate` -> `GateConfig`, `curriculum` -> `CurriculumConfig`): the section is built
from that class's own fields, so a knob has one name from the YAML to the trainer. The knobs
every env stage shares (`max_agent_turns`, `max_token_length`: the env config's names) sit at the
top. The shipped profiles are the YAML files in `flows/profiles/`; a user's file is layered over a
profile (`default` unless `--profile` names another), then the `key=value` overrides (dotted keys
reach into sections).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from flywheel.environments.registry import ENVIRONMENTS, TASK_FAMILIES, categories_of, env_class, task_categories
from flywheel.evaluation.agentic import AgenticEvalConfig
from flywheel.evaluation.curriculum import CurriculumConfig
from flywheel.evaluation.gate import GateConfig
from flywheel.evaluation.lm_eval_runner import LMEvalConfig
from flywheel.training.config import ConfigError, error_message, read_config, validate_config
from flywheel.training.device import DeviceChoice
from flywheel.training.grpo_config import GRPORunConfig
from flywheel.training.memory import (
    FIT_SHARE,
    GB,
    RL_PROMPT_TOKENS,
    VLLM_COLOCATED_SHARE,
    ModelShape,
    fit_micro_batch,
    model_shape,
    training_memory,
)
from flywheel.training.sft_config import SFTRunConfig

PROFILES_DIR = Path(__file__).parent / "profiles"
_FORBID = ConfigDict(extra="forbid")


def profile_names() -> list[str]:
    """The shipped profiles: `flows/profiles/<name>.yaml`."""
    return sorted(path.stem for path in PROFILES_DIR.glob("*.yaml"))


def _section(name: str, source: type[BaseModel], doc: str, **defaults: Any) -> type[BaseModel]:
    """A section model holding `source`'s fields named in `defaults`, with the round's defaults
    (type, bounds and description are `source`'s: written once, passed on unchanged)."""
    fields: dict[str, Any] = {}
    for field, default in defaults.items():
        info = copy.copy(source.model_fields[field])
        info.default, info.default_factory = default, None
        fields[field] = (info.annotation, info)
    return create_model(name, __config__=_FORBID, __doc__=doc, __module__=__name__, **fields)


# Training fields SFT and RL both take; `deepspeed` / `fsdp` apply when `gpus` > 1.
_TRAINING = {
    "learning_rate": 2e-4,
    "batch_size": 4,
    "gradient_accumulation_steps": 1,
    "num_threads": 2,
    "gradient_checkpointing": None,
    "mixed_precision": None,
    "save_steps": 0,
    "deepspeed": "zero3",
    "fsdp": False,
}

SFTSection = _section(
    "SFTSection", SFTRunConfig, "The SFT stage: `SFTRunConfig` fields.", total_steps=8, max_length=2048, **_TRAINING
)
RLSection = _section(
    "RLSection",
    GRPORunConfig,
    "The RL stage: `GRPORunConfig` fields.",
    total_steps=2,
    max_completion_length=128,
    num_rollouts_per_task=2,
    num_tasks=16,
    screen_tasks=0,
    rl_mode="sync",
    env_workers=2,
    env_workers_deployment=None,
    serve_host="127.0.0.1",
    max_async_level=1,
    drop_flat_groups=True,
    kl_beta=GRPORunConfig.model_fields["kl_beta"].default,
    allow_low_kl=False,
    top_k=None,
    **_TRAINING | {"learning_rate": GRPORunConfig.model_fields["learning_rate"].default},
)
EvalSection = _section(
    "EvalSection",
    AgenticEvalConfig,
    "The evaluate stage: `AgenticEvalConfig` fields.",
    eval_size=8,
    concurrency=16,
    max_infra_failure_rate=0.05,
)
LMEvalSection = _section(
    "LMEvalSection",
    LMEvalConfig,
    "The lm_eval stage: `LMEvalConfig` fields.",
    tasks=LMEvalConfig.model_fields["tasks"].default,
    include_path=None,
    suite_size=30,
    limit=None,
    batch_size=32,
)


class TeacherEndpoint(BaseModel):
    """An OpenAI-compatible teacher (`generate.teacher: endpoint`); the fields of a generation part."""

    model_config = _FORBID

    base_url: str = Field(description="OpenAI-compatible base URL.")
    model_name: str = Field(description="Model name at `base_url`.")
    api_key_env: str | None = Field(default=None, description="Environment variable holding its API key.")


class GenerateSection(BaseModel):
    """The generate stage: how many rollouts, and who acts on the slices the curriculum teaches."""

    model_config = _FORBID

    groups: int = Field(
        default=24,
        ge=1,
        description="Groups to generate, split over the slices to teach; mastered slices' replay on top.",
    )
    group_size: int = Field(
        default=2, ge=1, description="Rollouts per generated task (best vs worst of a group: preference pairs)."
    )
    teacher: Literal["oracle", "policy", "endpoint"] = Field(
        default="oracle",
        description="Who generates on unsolved slices: the envs' oracles, the round's model, or `endpoint`.",
    )
    endpoint: TeacherEndpoint | None = Field(default=None, description="The teacher when `teacher: endpoint`.")

    @model_validator(mode="after")
    def _endpoint_given(self) -> GenerateSection:
        if self.teacher == "endpoint" and self.endpoint is None:
            raise ValueError("teacher: endpoint needs endpoint.base_url and endpoint.model_name")
        return self


class DataSection(BaseModel):
    """Where generation and curation run: in the stage's process, or in shards on a Dask cluster."""

    model_config = _FORBID

    runner: Literal["process", "dask"] = Field(
        default="process",
        description="process: in the stage's own process; dask: generation and curation shards as Prefect tasks "
        "on a Dask cluster (prefect-dask), merged by the store into the same artifacts.",
    )
    address: str | None = Field(
        default=None,
        description="A running Dask scheduler (`tcp://host:8786`) whose workers reach the store (and a served "
        "model's URL); None: a local cluster of `workers` processes, started for the stage.",
    )
    workers: int = Field(default=2, ge=1, description="Processes of the local Dask cluster.")
    shard_groups: int = Field(
        default=64, ge=1, description="Generation groups a shard (with `runner: dask`; a bigger part is cut)."
    )


class CurriculumSection(CurriculumConfig):
    """The mine stage's curriculum: `CurriculumConfig` plus how the next round's data is chosen."""

    model_config = _FORBID

    mode: Literal["mined", "uniform"] = Field(
        default="mined",
        description="mined: slices classed from the champion's held-out results; uniform: every unlocked slice "
        "alike, all by the teacher (the ablation's baseline).",
    )


class GateSection(GateConfig):
    """The gate stage: `GateConfig`."""

    model_config = _FORBID


class RoundConfig(BaseModel):
    """One round, every stage: the shipped profiles are YAML files of this (`flows/profiles/`)."""

    model_config = _FORBID

    # -- what the round trains and on what
    model: str = Field(
        default="smollm2",
        description="Base model when there is no champion yet: smollm2 | tiny | a local HF dir | an HF id in the "
        "local cache.",
    )
    envs: list[str] = Field(
        default=list(TASK_FAMILIES),
        min_length=1,
        description="Environments (registered name, module:Class, or a .py file): generation, RL, held-out.",
    )
    difficulty: str | None = Field(
        default=None,
        description="One task difficulty for the whole round (None: all held out; the curriculum trains easy first "
        "and unlocks the next difficulty of a category once its easier one is mastered).",
    )
    categories: list[str] | None = Field(
        default=None, description="Only these task categories, in each env that has them (None: all)."
    )
    # -- what every agent loop of the round gets (generation by a served model, RL, evaluation)
    max_agent_turns: int = Field(default=6, ge=1, description="Agent turns per task.")
    max_token_length: int = Field(default=192, ge=8, description="Tokens per model reply.")
    # -- hardware
    device: DeviceChoice = Field(
        default="auto", description="Where GPU stages run: auto (CUDA when visible), cpu, cuda."
    )
    gpus: int = Field(
        default=1,
        ge=0,
        description="GPUs a GPU stage uses (slots of the `gpu` concurrency limit; >1 launches accelerate).",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        description="Machines a training stage spans, `gpus` GPUs each. Above 1 it is a plan: `flywheel plan` "
        "prints each machine's `flywheel train --nodes` launch and a Kubernetes Job for them; a round refuses it.",
    )
    gpu_memory_gb: float = Field(
        default=80.0,
        gt=0,
        description="Memory of one GPU (GB). On CUDA each training stage runs the largest micro-batch (its "
        "section's batch_size, halved) whose estimate fits, with the accumulation raised to keep the batch per "
        "step (training/memory.py); `flywheel plan` refuses a stage that cannot fit.",
    )
    # -- the stages
    generate: GenerateSection = Field(default_factory=GenerateSection, description="The generate stage.")
    sft: SFTSection = Field(default_factory=SFTSection, description="The SFT stage (SFTRunConfig fields).")
    rl: RLSection = Field(default_factory=RLSection, description="The RL stage (GRPORunConfig fields).")
    eval: EvalSection = Field(default_factory=EvalSection, description="Agentic evaluation (AgenticEvalConfig fields).")
    lm_eval: LMEvalSection = Field(
        default_factory=LMEvalSection, description="lm-eval benchmarks (LMEvalConfig fields)."
    )
    gate: GateSection = Field(default_factory=GateSection, description="Promotion gate (GateConfig fields).")
    curriculum: CurriculumSection = Field(default_factory=CurriculumSection, description="The next round's curriculum.")
    data: DataSection = Field(default_factory=DataSection, description="Where generation and curation run.")

    @model_validator(mode="after")
    def _every_env_has_a_category(self) -> RoundConfig:
        for env in self.envs:
            self.env_categories(env)
        return self

    @model_validator(mode="after")
    def _run_configs_valid(self) -> RoundConfig:
        """What the trainers would refuse (kl_beta, batch vs group size, ...) is refused here, at load."""
        for section, build in (
            ("sft", lambda: self.sft_run_config(policy_model="<base>", dataset="<dataset>", output_name="sft")),
            ("rl", lambda: self.rl_run_config(policy_model="<policy>", output_name="rl")),
        ):
            try:
                build()
            except ValidationError as err:  # One line per problem, named by its section.
                raise ValueError("; ".join(f"{section}: {error_message(e)}" for e in err.errors())) from None
        return self

    def sft_run_config(
        self, *, policy_model: str, dataset: str, output_name: str, total_steps: int | None = None
    ) -> SFTRunConfig:
        """The SFT stage's run config: the `sft` section as it is, on the round's hardware."""
        fields = self._on_hardware(self.sft.model_dump(), "sft")
        if total_steps is not None:
            fields["total_steps"] = total_steps
        return SFTRunConfig(**fields, policy_model=policy_model, dataset=dataset, output_name=output_name)

    def rl_run_config(
        self, *, policy_model: str, output_name: str, task_mix: dict[str, dict[str, float]] | None = None
    ) -> GRPORunConfig:
        """The RL stage's run config: the `rl` section, the round's envs and the agent loop's caps (train as judged)."""
        fields = self._on_hardware(self.rl.model_dump(), "rl")
        if self.gpus > 1 or fields["rl_mode"] == "atropos":
            fields["screen_tasks"] = 0  # Screening runs in one process; atropos workers drop flat groups instead.
        return GRPORunConfig(
            **fields,
            policy_model=policy_model,
            envs=self.envs,
            difficulty=self.difficulty,
            categories=self.categories,
            task_mix=task_mix,
            max_agent_turns=self.max_agent_turns,
            max_token_length=self.max_token_length,
            output_name=output_name,
        )

    def eval_config(self, *, base_url: str, model_name: str, tokenizer: str, name: str) -> AgenticEvalConfig:
        """The evaluate stage's config: the `eval` section against a served model."""
        return AgenticEvalConfig(
            **self.eval.model_dump(),
            envs=self.envs,
            difficulty=self.difficulty,
            categories=self.categories,
            max_agent_turns=self.max_agent_turns,
            max_token_length=self.max_token_length,
            base_url=base_url,
            model_name=model_name,
            tokenizer=tokenizer,
            name=name,
        )

    def lm_eval_config(self, *, backend: str, name: str) -> LMEvalConfig:
        """The lm_eval stage's config: the `lm_eval` section on `backend`."""
        return LMEvalConfig(**self.lm_eval.model_dump(), backend=backend, name=name)

    @staticmethod
    def trains_alone(section: Any) -> bool:
        """Whether a training stage (its run config, or its fields) runs one process on one GPU of one machine
        whatever the round's hardware: atropos-mode GRPO, one trainer behind one policy endpoint."""
        rl_mode = section.get("rl_mode") if isinstance(section, dict) else getattr(section, "rl_mode", None)
        return rl_mode == "atropos"

    def training_gpus(self, section: Any) -> int:
        """GPUs a training stage (its run config, or its fields) runs on, on each machine."""
        return 1 if self.trains_alone(section) else max(1, self.gpus)

    def _on_hardware(self, fields: dict[str, Any], stage: str) -> dict[str, Any]:
        """A training section on the round's device; its sharding only where several GPUs share the work;
        on CUDA its micro-batch fitted to the GPU's memory."""
        fields["device"] = self.device
        if self.training_gpus(fields) <= 1:
            fields["deepspeed"], fields["fsdp"] = None, False
        elif fields["fsdp"]:
            fields["deepspeed"] = None
        shape = model_shape(self.model) if self.device == "cuda" else None
        if shape is not None:
            batch = fields["batch_size"]
            micro = fit_micro_batch(
                lambda mb: sum(self.memory_estimate(stage, fields | {"batch_size": mb}, shape).values()),
                batch,
                FIT_SHARE * self.gpu_memory_gb * GB,
            )
            fields["batch_size"], fields["gradient_accumulation_steps"] = (
                micro,
                fields["gradient_accumulation_steps"] * (batch // micro),
            )
        return fields

    def memory_estimate(self, stage: str, fields: dict[str, Any], shape: ModelShape) -> dict[str, float]:
        """Bytes per GPU, by term, of the `sft` or `rl` stage run with these run-config fields on CUDA,
        for a model of `shape` (`training.memory.model_shape` of the round's model)."""
        ranks = 1 if self.trains_alone(fields) else max(1, self.gpus) * self.nodes  # ZeRO shards over every GPU.
        common = {"gpus": ranks, "zero": fields["deepspeed"], "micro_batch": fields["batch_size"]}
        if stage == "sft":
            return training_memory(shape, **common, seq_len=fields["max_length"], logits=True)
        return training_memory(
            shape, **common, seq_len=fields["max_completion_length"] + RL_PROMPT_TOKENS, logits=False,
            reference=fields["kl_beta"] > 0, vllm_bytes=VLLM_COLOCATED_SHARE * self.gpu_memory_gb * GB,
        )  # fmt: skip

    def check_one_machine(self) -> None:
        """A round runs its stages on one machine each: `nodes` above 1 is for `flywheel plan` (ConfigError)."""
        if self.nodes > 1:
            raise ConfigError(
                f"nodes={self.nodes}: a round trains on one machine; train across machines with `flywheel train "
                "<algorithm> --nodes N --node-rank R --main-address ADDR` on each (`flywheel plan` prints the "
                "lines and a Kubernetes Job)"
            )

    def env_categories(self, env: str) -> list[str] | None:
        """The categories of `env` this round covers (None: all of them, or an env without categories).
        A registered env with no categories to pick is not loaded (atroposlib with it) until a stage runs it;
        a user's env always is, so that a broken one fails here."""
        if self.categories is None and env in ENVIRONMENTS:
            return None
        return categories_of(env_class(env), self.categories)

    def families(self) -> dict[str, tuple[str, ...]]:
        """Env -> the categories the curriculum covers (an env without task categories: none, one slice)."""
        return {env: tuple(self.env_categories(env) or task_categories(env) or ()) for env in self.envs}


def load_round_config(
    profile: str | None = None, path: str | Path | None = None, overrides: list[str] | None = None
) -> RoundConfig:
    """A round's config: profile `profile`, then the YAML at `path`, then `key=value` overrides
    (`sft.total_steps=8`), each layer merged into the one before; every problem named at once.
    Without `path` the profile defaults to `default`; with it, the file stands on the field defaults
    unless a profile is named (a copied profile means what it says)."""
    if profile is None and path is None:
        profile = "default"
    data: dict[str, Any] = {}
    if profile is not None:
        if profile not in profile_names():
            raise ConfigError(f"unknown profile '{profile}': choose {', '.join(profile_names())}")
        data = read_config(PROFILES_DIR / f"{profile}.yaml")
    for layer in (read_config(path) if path is not None else {}, read_config(None, overrides)):
        data = _merged(data, _nested(layer))
    return validate_config(RoundConfig, _absolute_paths(data), path or PROFILES_DIR / f"{profile}.yaml")


def profile(name: str) -> RoundConfig:
    """A shipped profile as it is."""
    return load_round_config(name)


def _absolute_paths(data: dict[str, Any]) -> dict[str, Any]:
    """Env files and the lm-eval include path made absolute (from the working directory): the config
    is resolved once, then read by stages that may run in other folders (deployments, workers)."""
    envs = data.get("envs")
    if isinstance(envs, list):
        data["envs"] = [_absolute(e) if isinstance(e, str) and e.split(":")[0].endswith(".py") else e for e in envs]
    lm_eval = data.get("lm_eval")
    if isinstance(lm_eval, dict) and isinstance(lm_eval.get("include_path"), str):
        lm_eval["include_path"] = str(Path(lm_eval["include_path"]).expanduser().resolve())
    return data


def _absolute(spec: str) -> str:
    """`my_env.py[:Class]` with the file's absolute path."""
    file, colon, name = spec.partition(":")
    return str(Path(file).expanduser().resolve()) + colon + name


def overridden(config: RoundConfig, changes: dict[str, Any]) -> RoundConfig:
    """`config` with `changes` (dotted keys as in `key=value` overrides: `{"sft.total_steps": 4}`), validated again."""
    return validate_config(RoundConfig, _merged(config.model_dump(), _nested(changes)))


def config_yaml(config: BaseModel, indent: str = "") -> str:
    """`config` as YAML that `--config` reads back, each field with its description as a comment."""
    lines = []
    for name, info in type(config).model_fields.items():
        value = getattr(config, name)
        comment = f"  # {info.description}" if info.description else ""
        if isinstance(value, BaseModel):
            lines += ["", f"{indent}{name}:{comment}", config_yaml(value, indent + "  ")]
        else:
            dumped = yaml.safe_dump(_plain(value), default_flow_style=True, width=1_000_000).strip()
            lines.append(f"{indent}{name}: {dumped.removesuffix(chr(10) + '...')}{comment}")
    return "\n".join(lines).lstrip("\n") if not indent else "\n".join(lines)


def _plain(value: Any) -> Any:
    """A field value as plain YAML data (models as mappings)."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """`{"sft.total_steps": 8}` -> `{"sft": {"total_steps": 8}}` (keys without dots as they are)."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *sections, field = key.split(".")
        target = nested
        for section in sections:
            target = target.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(f"'{key}': '{section}' is a value, not a section")
        target[field] = _nested(value) if isinstance(value, dict) else value
    return nested


def _merged(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """`layer` over `base`: sections merge field by field, anything else is replaced."""
    merged = dict(base)
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged
