"""Round profiles: how big each stage of a flywheel round is (a Pydantic model, a form in the UI)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from environments.registry import TASK_FAMILIES, categories_of, env_class, task_categories
from evaluation.curriculum import CurriculumConfig
from evaluation.suite import SUITE_TASKS
from training.device import DeviceChoice

ProfileName = Literal["default", "quick", "tiny", "h100"]


class RoundProfile(BaseModel):
    """Sizes of one round; `default`, `quick` and `tiny` are the shipped presets."""

    model: str = Field(default="smollm2", description="Base model when there is no champion yet.")
    envs: list[str] = Field(
        default=list(TASK_FAMILIES), min_length=1, description="Environments of the round: generation, GRPO, held-out."
    )
    groups: int = Field(
        default=24,
        ge=1,
        description="Groups to generate, split over the slices to teach; mastered slices' replay comes on top.",
    )
    group_size: int = Field(
        default=2, ge=1, description="Rollouts per generated task (best vs worst of a group: preference pairs)."
    )
    sft_steps: int = Field(
        default=8, ge=1, description="SFT steps for a plan of `groups` (a round with replay on top scales them)."
    )
    sft_lr: float = Field(default=2e-4, gt=0, description="SFT learning rate.")
    sft_max_length: int = Field(
        default=2048, ge=64, description="SFT tokens per conversation (a longer one is left out, not cut)."
    )
    rl_steps: int = Field(default=2, ge=1, description="GRPO steps.")
    rl_max_completion: int = Field(default=128, ge=16, description="GRPO tokens per rollout, tool output included.")
    eval_size: int = Field(default=8, ge=1, description="Held-out agentic tasks per env (stratified over slices).")
    max_tokens: int = Field(default=192, ge=8, description="Tokens per model reply, in GRPO and evaluation alike.")
    difficulty: str | None = Field(
        default=None,
        description="One task difficulty for the whole round (None: all held out; the curriculum "
        "trains easy first and unlocks the next difficulty of a category once its easier one is mastered).",
    )
    categories: list[str] | None = Field(
        default=None, description="Only these task categories, in each env that has them (None: all)."
    )
    curriculum: Literal["mined", "uniform"] = Field(
        default="mined",
        description="mined: slices classed from the champion's held-out results; uniform: "
        "every unlocked slice alike, all by the teacher (the ablation's baseline).",
    )
    curriculum_config: CurriculumConfig = Field(default_factory=CurriculumConfig, description="Curriculum thresholds.")
    lm_eval_tasks: list[str] = Field(
        default=list(SUITE_TASKS), description="lm-eval tasks of every round (shipped suite, bundled or include_path)."
    )
    lm_eval_include_path: str | None = Field(default=None, description="A folder of lm-eval task YAML.")
    lm_eval_size: int = Field(default=30, ge=1, description="Items per shipped lm-eval suite task.")
    lm_eval_limit: int | None = Field(default=None, ge=1, description="Docs per lm-eval task (None: all).")
    lm_eval_batch_size: int = Field(default=32, ge=1, description="lm-eval requests per batch (hf backend).")
    device: DeviceChoice = Field(
        default="auto", description="Where GPU stages run: auto (CUDA when visible), cpu, cuda."
    )
    gpus: int = Field(
        default=1,
        ge=0,
        description="GPUs a GPU stage uses (slots of the `gpu` concurrency limit; >1 launches accelerate).",
    )
    sharding: Literal["zero2", "zero3", "zero3_offload", "fsdp"] = Field(
        default="zero3", description="How SFT and GRPO shard across `gpus` > 1 (DeepSpeed ZeRO or FSDP)."
    )
    threads: int = Field(default=2, ge=1, description="CPU training: torch threads.")
    gradient_checkpointing: bool | None = Field(
        default=None,
        description="SFT and GRPO recompute activations in the backward (None: the device's default, on for CUDA).",
    )
    mixed_precision: bool | None = Field(
        default=None,
        description="SFT and GRPO on CPU: bf16 autocast over fp32 weights (None: where the CPU has bf16 dot products).",
    )
    sft_batch_size: int = Field(default=4, ge=1, description="SFT conversations per device per micro-batch.")
    sft_gradient_accumulation: int = Field(
        default=1, ge=1, description="SFT micro-batches per step (a step sees batch size x this conversations)."
    )
    rl_batch_size: int = Field(default=4, ge=1, description="GRPO completions per device per micro-batch.")
    rl_gradient_accumulation: int = Field(
        default=1, ge=1, description="GRPO micro-batches per step (a step trains on batch size x this completions)."
    )
    rl_group_size: int = Field(default=2, ge=2, description="GRPO rollouts per task (the group).")
    rl_tasks: int = Field(default=16, ge=1, description="Distinct GRPO training tasks.")
    rl_screen: int = Field(
        default=0,
        ge=0,
        description="GRPO: screen up to N tasks with the SFT policy, train on those whose group rewards differ "
        "(0: off; single-process runs only, so off when gpus > 1).",
    )
    max_turns: int = Field(default=6, ge=1, description="Agent turns per task, in GRPO and evaluation alike.")
    eval_concurrency: int = Field(
        default=16, ge=1, description="Evaluation rollouts in flight at once over all envs (the server batches them)."
    )
    max_infra_failure_rate: float = Field(
        default=0.05, ge=0, le=1, description="Evaluation fails (no success rate) above this infra-failure share."
    )
    save_steps: int = Field(default=0, ge=0, description="SFT / GRPO step checkpoint every N steps (a re-run resumes).")
    teacher: Literal["oracle", "policy", "endpoint"] = Field(
        default="oracle",
        description="Who generates: the envs' oracles, the round's base model (served), or `teacher_url`.",
    )
    teacher_url: str | None = Field(default=None, description="OpenAI-compatible base URL (teacher=endpoint).")
    teacher_model: str | None = Field(default=None, description="Model name at `teacher_url`.")
    teacher_api_key_env: str | None = Field(default=None, description="Environment variable holding its API key.")

    @model_validator(mode="after")
    def _endpoint_is_complete(self) -> RoundProfile:
        if self.teacher == "endpoint" and not (self.teacher_url and self.teacher_model):
            raise ValueError("teacher=endpoint needs teacher_url and teacher_model")
        return self

    @model_validator(mode="after")
    def _every_env_has_a_category(self) -> RoundProfile:
        for env in self.envs:
            self.env_categories(env)
        return self

    def env_categories(self, env: str) -> list[str] | None:
        """The categories of `env` this round covers (None: all of them, or an env without categories)."""
        return categories_of(env_class(env), self.categories)

    def families(self) -> dict[str, tuple[str, ...]]:
        """Env -> the categories the curriculum covers (an env without task categories: none, one slice)."""
        return {env: tuple(self.env_categories(env) or task_categories(env) or ()) for env in self.envs}


# CPU rounds hold out about two items per slice: 68 % intervals (z = 1) let 3 of 3 master a slice
# and 0 of 3 mark it unsolved, where 95 % would need 9 of 9. From the base model, which solves
# nothing, three slices are taught (`focus`: four scored 0.17 against 0.25, docs/runs.md); once the
# champion solves some, every unsolved slice in reach (a focus of 3 there taught one swe_bench
# category and lost all three to a uniform mix that taught them thinly; README, Benchmarks).
CPU_CURRICULUM = CurriculumConfig(z=1.0, focus=3)

PROFILES: dict[str, RoundProfile] = {
    # SmolLM2-135M on CPU: the slice a 135M model can learn in one round (look a product up, copy
    # its id and price) rather than arithmetic or 6+ tool calls, which it fails before and after.
    "default": RoundProfile(
        curriculum_config=CPU_CURRICULUM,
        groups=32,
        sft_batch_size=1,  # 4 conversations a step, one at a time: a quarter of the activation memory, no padding.
        sft_gradient_accumulation=4,
        # 16 steps (~2 epochs of ~32 rows): the taught script is memorised (loss 1.30 -> 0.01) and
        # the round promotes; at 6 steps (loss 0.30) the candidate garbled it and solved nothing.
        sft_steps=16,
        # Whole conversations of up to 2,048 tokens: recomputing activations in the backward keeps
        # SFT's peak under 6 GB (without it, one 1,825-token conversation took ~6 GB on its own).
        gradient_checkpointing=True,
        rl_batch_size=1,  # 4 completions a step, one at a time: the backward's activations of one, not four.
        rl_gradient_accumulation=4,
        rl_screen=8,  # After SFT, GRPO trains on the tasks the policy solves only sometimes.
        rl_max_completion=384,
        # Two held-out items per env x category x difficulty (72 in all): with one, a real +7.5-point
        # round (4 items won, 1 lost of 40) reached only P(better) 0.88 and the gate kept it out.
        eval_size=18,
        # 40 held-out rollouts in flight at once: 1.22x faster than 16 on 2 cores (decode steps are
        # bound by per-step overhead; benchmarks/serve_throughput.py --agentic 10 --concurrency 16 40);
        # more would grow the server's KV cache (~45 MB a 1,000-token rollout) past the 6 GB budget.
        eval_concurrency=40,
        max_tokens=128,
    ),
    "quick": RoundProfile(
        model="tiny",
        curriculum_config=CPU_CURRICULUM,
        groups=8,
        sft_steps=4,
        sft_lr=1e-3,
        sft_batch_size=1,
        sft_gradient_accumulation=4,
        rl_steps=1,
        eval_size=3,
        max_tokens=48,
        lm_eval_size=6,
    ),
    # The smallest round that still runs every stage for real: tests and the overhead benchmark.
    "tiny": RoundProfile(
        model="tiny",
        curriculum_config=CPU_CURRICULUM,
        envs=["tool_use_chain"],
        groups=4,
        sft_steps=2,
        sft_lr=1e-3,
        rl_steps=1,
        eval_size=2,
        max_tokens=16,
        lm_eval_size=3,
    ),
    # One 8xH100 node: a 0.5-8B model by HF id (from the local HF cache) or a local directory.
    "h100": RoundProfile(
        model="Qwen/Qwen2.5-1.5B-Instruct",
        device="cuda",
        gpus=8,
        difficulty=None,
        groups=512,
        sft_steps=500,
        sft_lr=2e-5,
        sft_max_length=4096,
        sft_batch_size=8,
        rl_steps=200,
        rl_batch_size=64,
        rl_group_size=8,
        rl_tasks=2048,
        rl_max_completion=2048,
        eval_size=200,
        max_turns=16,
        max_tokens=1024,
        eval_concurrency=256,  # vLLM batches hundreds of requests.
        save_steps=50,
    ),
}
