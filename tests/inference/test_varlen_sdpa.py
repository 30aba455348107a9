"""Per-sequence SDPA equals the library's attention over a packed batch, and generates the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flywheel.inference.varlen_sdpa import use_varlen_sdpa, varlen_sdpa_attention

HEADS, KV_HEADS, DIM = 4, 2, 8


class _Attention(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_lens, k_lens) -> torch.Tensor:
    """Each sequence on its own, written out: scores, a bottom-right causal mask, softmax, values."""
    outputs, q_at, k_at = [], 0, 0
    for q_len, k_len in zip(q_lens, k_lens, strict=True):
        q = query[0, :, q_at : q_at + q_len]
        k = key[0, :, k_at : k_at + k_len].repeat_interleave(HEADS // KV_HEADS, dim=0)
        v = value[0, :, k_at : k_at + k_len].repeat_interleave(HEADS // KV_HEADS, dim=0)
        scores = q @ k.transpose(-1, -2) / DIM**0.5
        allowed = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)
        outputs.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v)
        q_at, k_at = q_at + q_len, k_at + k_len
    return torch.cat(outputs, dim=1).transpose(0, 1)  # [tokens, heads, dim]


def _packed(q_lens: list[int], k_lens: list[int]) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, HEADS, sum(q_lens), DIM, generator=generator)
    key = torch.randn(1, KV_HEADS, sum(k_lens), DIM, generator=generator)
    value = torch.randn(1, KV_HEADS, sum(k_lens), DIM, generator=generator)
    cumulative = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return query, key, value, cumulative(q_lens), cumulative(k_lens)


def test_each_sequence_attends_to_its_own_keys_only() -> None:
    # A prefill chunk after a cached prefix, a decode step, a fresh prompt: one continuous-batching step.
    q_lens, k_lens = [5, 1, 4], [12, 7, 4]
    query, key, value, starts_q, starts_k = _packed(q_lens, k_lens)
    out, _ = varlen_sdpa_attention(
        _Attention(), query, key, value, None, scaling=DIM**-0.5, cu_seq_lens_q=starts_q, cu_seq_lens_k=starts_k
    )
    assert out.shape == (1, sum(q_lens), HEADS, DIM)
    torch.testing.assert_close(out[0], _reference(query, key, value, q_lens, k_lens))


def test_padded_queries_come_back_as_zeros() -> None:
    query, key, value, starts_q, starts_k = _packed([3, 1], [3, 5])
    padded = torch.cat([query, torch.randn(1, HEADS, 2, DIM)], dim=2)  # Two padding tokens past the last sequence.
    out, _ = varlen_sdpa_attention(
        _Attention(), padded, key, value, None, scaling=DIM**-0.5, cu_seq_lens_q=starts_q, cu_seq_lens_k=starts_k
    )
    assert out.shape[1] == 6 and not out[0, 4:].any()


def test_an_unpacked_call_is_the_library_sdpa() -> None:
    query, key, value = (torch.randn(2, h, 6, DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    ours, _ = varlen_sdpa_attention(_Attention(), query, key, value, None, scaling=0.3, is_causal=True)
    library, _ = sdpa_attention_forward(_Attention(), query, key, value, None, scaling=0.3, is_causal=True)
    torch.testing.assert_close(ours, library)


def test_continuous_batching_generates_the_same_tokens(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig

    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.generation_config.update(max_new_tokens=12, do_sample=False, eos_token_id=None)
    # Prompts of different lengths, a shared 64-token prefix, prefill chunks of 48 tokens: every kind of step.
    prompts = [list(range(5, 5 + n)) for n in (70, 9, 130, 33)] + [[*range(5, 69), 200, 201]]
    paging = ContinuousBatchingConfig(page_size=16, max_batch_tokens=48, num_blocks=64)

    def generate() -> list[list[int]]:
        with torch.inference_mode():
            outputs = model.generate_batch(prompts, continuous_batching_config=paging)
        return [list(out.generated_tokens) for _, out in sorted(outputs.items())]

    library = generate()
    use_varlen_sdpa()
    assert AttentionInterface._global_mapping["sdpa"] is varlen_sdpa_attention
    packed_calls = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        packed_calls.append(torch.is_tensor(kwargs.get("cu_seq_lens_k")))
        return varlen_sdpa_attention(*args, **kwargs)

    AttentionInterface.register("sdpa", spy)
    assert generate() == library and all(len(tokens) == 12 for tokens in library)
    assert packed_calls and all(packed_calls)  # Every step went through the per-sequence loop.
