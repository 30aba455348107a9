"""Round profiles: how big each stage of a flywheel round is (a Pydantic model, a form in the UI)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

ProfileName = Literal["default", "quick", "tiny"]


class RoundProfile(BaseModel):
    """Sizes of one round; `default`, `quick` and `tiny` are the shipped presets."""

    model: str = Field(default="smollm2", description="Base model when there is no champion yet.")
    env: str = Field(default="tool_use_chain", description="Environment of this round.")
    groups: int = Field(default=24, ge=1, description="Teacher groups to generate.")
    sft_steps: int = Field(default=8, ge=1, description="SFT steps.")
    sft_lr: float = Field(default=2e-4, gt=0, description="SFT learning rate.")
    sft_max_length: int = Field(default=1280, ge=64, description="SFT tokens per conversation (whole trajectories).")
    rl_steps: int = Field(default=2, ge=1, description="GRPO steps.")
    rl_max_completion: int = Field(default=128, ge=16, description="GRPO tokens per rollout, tool output included.")
    eval_size: int = Field(default=8, ge=1, description="Held-out agentic tasks.")
    max_tokens: int = Field(default=192, ge=8, description="Tokens per model reply in evaluation.")
    difficulty: str | None = Field(default="easy", description="Task difficulty of this round (training and held-out).")
    categories: list[str] | None = Field(default=None, description="Task categories of this round (None: all).")
    gpus: int = Field(default=1, ge=0, description="Slots of the `gpu` global concurrency limit a GPU stage takes.")
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


PROFILES: dict[str, RoundProfile] = {
    # SmolLM2-135M on CPU: the slice a 135M model can learn in one round (look a product up, copy
    # its id and price) rather than arithmetic or 6+ tool calls, which it fails before and after.
    "default": RoundProfile(
        env="web_navigation",
        categories=["lookup_price"],
        groups=32,
        sft_steps=20,
        rl_max_completion=384,
        eval_size=10,
        max_tokens=128,
    ),
    "quick": RoundProfile(model="tiny", groups=8, sft_steps=4, sft_lr=1e-3, rl_steps=1, eval_size=3, max_tokens=48),
    # The smallest round that still runs every stage for real: tests and the overhead benchmark.
    "tiny": RoundProfile(model="tiny", groups=4, sft_steps=2, sft_lr=1e-3, rl_steps=1, eval_size=2, max_tokens=16),
}
