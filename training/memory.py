"""Per-GPU memory of a training run, estimated before it meets a GPU (`flywheel plan` prints it).

Mixed-precision Adam keeps 16 bytes a parameter (the ZeRO paper's accounting): fp32 weights 4,
gradients 4 (bf16 2 under DeepSpeed, which adds a 2-byte bf16 copy of the weights), Adam's two
moments 8. ZeRO-2 shards gradients and optimizer state over the GPUs, ZeRO-3 the weights too
(plus the layers gathered for the current forward); offload moves optimizer state and weights to
the CPU. With gradient checkpointing a layer keeps only its input (bf16) for the backward, and one
layer at a time is recomputed: about 34 bytes a token per hidden unit with SDPA or flash attention
(Korthikanti et al., 2022, without the attention-score term those kernels never materialise).
SFT's loss holds the logits (bf16 and fp32); GRPO scores log-probs in chunks (TRL's fused LM
head), so its logits are left out. GRPO adds the KL reference (bf16 weights, sharded like the
policy's under ZeRO-3) and, colocated, vLLM's share of the GPU (its weights and KV cache). A fixed
2.5 GB covers the CUDA context, NCCL buffers and the allocator's slack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9
CUDA_OVERHEAD = 2.5 * GB
RECOMPUTED_BYTES_PER_HIDDEN = 34
RL_PROMPT_TOKENS = 1024  # A rollout's first prompt: system prompt, tool schemas, task.
VLLM_COLOCATED_SHARE = 0.3  # TRL's `vllm_gpu_memory_utilization` default, which GRPO keeps.
FIT_SHARE = 0.9  # A fitted micro-batch leaves a tenth of the GPU for what the estimate leaves out.


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only transformer."""

    params: int
    layers: int
    hidden: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a Llama/Qwen-style `config.json`: parameters counted from its dimensions."""
        hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        kv = config.get("num_key_value_heads", heads) * head_dim
        attention = hidden * heads * head_dim * 2 + hidden * kv * 2
        mlp = 3 * hidden * config["intermediate_size"]
        embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
        return cls(embeddings + layers * (attention + mlp + 2 * hidden) + hidden, layers, hidden, vocab)


# Shapes of the models the h100 profile is meant for (their config.json dimensions), for plans made
# on a machine that has not downloaded them.
KNOWN_SHAPES = {
    name: ModelShape.from_config(config)
    for name, config in {
        "Qwen/Qwen2.5-0.5B-Instruct": dict(hidden_size=896, num_hidden_layers=24, vocab_size=151936,
            num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True),
        "Qwen/Qwen2.5-1.5B-Instruct": dict(hidden_size=1536, num_hidden_layers=28, vocab_size=151936,
            num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
        "Qwen/Qwen2.5-3B-Instruct": dict(hidden_size=2048, num_hidden_layers=36, vocab_size=151936,
            num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008, tie_word_embeddings=True),
        "Qwen/Qwen2.5-7B-Instruct": dict(hidden_size=3584, num_hidden_layers=28, vocab_size=152064,
            num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False),
        "smollm2": dict(hidden_size=576, num_hidden_layers=30, vocab_size=49152, num_attention_heads=9,
            num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True),
    }.items()
}  # fmt: skip


def model_shape(model: str) -> ModelShape | None:
    """The shape of `model`: a local HF directory's config.json, else a known model (None: unknown)."""
    config = Path(model) / "config.json"
    if config.is_file():
        return ModelShape.from_config(json.loads(config.read_text()))
    return KNOWN_SHAPES.get(model)


def training_memory(
    shape: ModelShape,
    *,
    gpus: int,
    zero: str | None,
    micro_batch: int,
    seq_len: int,
    logits: bool,
    reference: bool = False,
    vllm_bytes: float = 0.0,
) -> dict[str, float]:
    """Bytes per GPU, by term, of training `shape` on `gpus` GPUs sharded by `zero` (zero2, zero3,
    zero3_offload or None: each GPU a full copy), `micro_batch` sequences of `seq_len` tokens."""
    p, shards = shape.params, max(1, gpus)
    if zero is None:
        weights, grads, optimizer = 4 * p, 4 * p, 8 * p
    elif zero == "zero2":
        weights, grads, optimizer = 2 * p, 2 * p / shards, 12 * p / shards
    elif zero == "zero3":
        weights, grads, optimizer = 2 * p / shards + _gathered(shape), 2 * p / shards, 12 * p / shards
    elif zero == "zero3_offload":
        weights, grads, optimizer = _gathered(shape), 2 * p / shards, 0.0
    else:
        raise ValueError(f"unknown ZeRO stage {zero}")
    tokens = micro_batch * seq_len
    terms = {
        "weights": weights,
        "gradients": grads,
        "optimizer state": optimizer,
        "checkpointed activations": shape.layers * tokens * shape.hidden * 2,
        "recomputed layer": tokens * shape.hidden * RECOMPUTED_BYTES_PER_HIDDEN,
        "logits": tokens * shape.vocab * 6 if logits else 0.0,
        "KL reference": (2 * p / shards if zero in ("zero3", "zero3_offload") else 2 * p) if reference else 0.0,
        "vLLM (weights and KV cache)": vllm_bytes,
        "CUDA context and allocator": CUDA_OVERHEAD,
    }
    return {term: value for term, value in terms.items() if value}


def _gathered(shape: ModelShape) -> float:
    """ZeRO-3's working set: the bf16 weights of about two layers gathered at a time (one in use, one prefetched)."""
    return 2 * 2 * (shape.params - shape.vocab * shape.hidden) / shape.layers


def summary(terms: dict[str, float], capacity: float) -> dict[str, Any]:
    """The plan's view of an estimate: GB by term, the total, and whether it fits `capacity` bytes."""
    total = sum(terms.values())
    largest = max(terms, key=terms.__getitem__)
    return {
        "per_gpu_gb": round(total / GB, 1),
        "capacity_gb": round(capacity / GB, 1),
        "fits": total <= capacity,
        "largest": largest,
        "terms_gb": {term: round(value / GB, 2) for term, value in terms.items()},
    }


def fit_micro_batch(bytes_at: Any, batch: int, capacity: float) -> int:
    """The largest micro-batch, `batch` halved until `bytes_at(micro_batch)` fits `capacity` (1 at
    least, even if that does not fit: the plan then says so)."""
    micro = batch
    while micro > 1 and bytes_at(micro) > capacity:
        micro //= 2
    return micro


def serving_memory(shape: ModelShape, tensor_parallel: int, share: float) -> dict[str, float]:
    """Bytes per GPU of a vLLM server (and lm-eval on vLLM), within the `share` of the GPU it takes up
    front: its bf16 weights (split over `tensor_parallel` GPUs), the rest KV cache."""
    weights = 2 * shape.params / tensor_parallel
    return {"weights": weights, "KV cache": max(0.0, share - weights)}
