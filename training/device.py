"""Where a stage runs decides how: one place maps a device to dtype, attention, memory savers and backends.

Every trainer, the inference server and `flywheel plan` read `DeviceSettings`, so no stage
hard-codes a device: on CUDA, bf16 autocast, flash attention when installed (else SDPA), gradient
checkpointing and vLLM serving bf16 weights; on CPU, `use_cpu`, explicit threads and `transformers
serve`, with bf16 autocast where the CPU has bf16 dot products (AVX512-BF16 or AMX;
docs/architecture.md has the measured gain); elsewhere bf16 is emulated, and slower.

Training always loads fp32 weights: AdamW on bf16 weights loses most updates to rounding (at lr
1e-6, 98 % of a model's weights did not move in 10 steps), so the weights the optimizer updates
stay fp32 and the matmuls run in bf16 under autocast (TRL's default); DeepSpeed keeps its own fp32
master copy either way.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any, Literal

Device = Literal["cpu", "cuda"]
DeviceChoice = Literal["auto", "cpu", "cuda"]


@cache
def cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AVX512-BF16 or AMX-BF16)."""
    import torch

    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


def resolve_device(choice: str) -> Device:
    """`auto` is CUDA when torch sees a GPU, else CPU; `cpu` / `cuda` are taken as given."""
    if choice in ("cpu", "cuda"):
        return choice  # type: ignore[return-value]
    if choice != "auto":
        raise ValueError(f"unknown device '{choice}': choose auto, cpu or cuda")
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class DeviceSettings:
    """What running on `device` means for training and serving."""

    device: Device
    dtype: str  # Served weights; training loads fp32 (`model_kwargs`).
    bf16: bool
    gradient_checkpointing: bool
    attn_implementation: str
    server_backend: Literal["transformers", "vllm"]

    @classmethod
    def for_device(cls, choice: str) -> DeviceSettings:
        device = resolve_device(choice)
        if device == "cpu":
            return cls("cpu", "float32", cpu_computes_bf16(), False, "sdpa", "transformers")
        flash = importlib.util.find_spec("flash_attn") is not None
        return cls("cuda", "bfloat16", True, True, "flash_attention_2" if flash else "sdpa", "vllm")

    def trainer_kwargs(self) -> dict[str, Any]:
        """The `transformers.TrainingArguments` fields (shared by TRL's SFT, GRPO and DPO configs)."""
        kwargs: dict[str, Any] = {"bf16": self.bf16, "gradient_checkpointing": self.gradient_checkpointing}
        if self.device == "cpu":
            kwargs["use_cpu"] = True
        return kwargs

    def model_kwargs(self) -> dict[str, Any]:
        """`from_pretrained` keywords for training: fp32 weights (see the module docstring) and the attention kernel."""
        return {"dtype": "float32", "attn_implementation": self.attn_implementation}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def one_gpu_per_process(args: Any) -> Any:
    """`TrainingArguments` of a run not started by a distributed launcher use one GPU however many are
    visible: transformers would wrap the model in `nn.DataParallel` across all of them, which TRL's
    trainers refuse (and Trainer's own model-parallel path sets the count to 1 the same way)."""
    _ = args.device  # Sets `n_gpu` (a cached device set-up that would overwrite it later).
    if args.world_size == 1 and args.n_gpu > 1:
        args._n_gpu = 1
    return args
