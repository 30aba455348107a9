"""SDPA per sequence for transformers' continuous batching on CPU.

Continuous batching packs every request of a step along the token axis, and its `sdpa` path
attends over the whole pack with one mask: each query token is scored against every key any
request of the step reads, and the mask throws all but its own request's away. With 16 requests
of ~1,000 cached tokens each, a decode step scores 16 x 16,000 pairs where 16 x 1,000 are needed,
and a 1,024-token prefill chunk 16 times the pairs it uses. Here each sequence of the pack attends
to its own keys only (the cumulative lengths the batch already carries), so the cost is what the
requests read: 16 first turns of an agentic evaluation generated 1.63x faster on 2 cores, token for
token the same (benchmarks/serve_throughput.py). Flash kernels do this natively on GPUs; on CPU
there is no varlen kernel, hence this loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, packed query tokens, head_dim]
    key: torch.Tensor,  # [1, kv heads, packed key tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of each packed sequence over its own keys; anything else goes to the library's SDPA.

    A sequence's queries are the last tokens of its keys (a prefill chunk after its cached prefix,
    or one decode token), so the causal mask is aligned to the bottom right.
    """
    starts_q, starts_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    per_sequence = (
        torch.is_tensor(starts_q)
        and torch.is_tensor(starts_k)
        and query.shape[0] == 1
        and dropout == 0.0
        and getattr(module, "sliding_window", None) is None  # Its window is a mask this loop does not build.
        and not hasattr(module, "sinks")
    )
    if not per_sequence:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    bounds_q, bounds_k = starts_q.tolist(), starts_k.tolist()
    outputs = []
    for q_start, q_end, k_start, k_end in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:], strict=False):
        q_len, k_len = q_end - q_start, k_end - k_start
        if q_len == 0:  # Padding sequences of a padded batch.
            continue
        causal = None if q_len == 1 else torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, q_start:q_end],
                key[:, :, k_start:k_end],
                value[:, :, k_start:k_end],
                attn_mask=None if causal is None else causal.to(query.device),
                scale=scaling,
                enable_gqa=key.shape[1] != query.shape[1],
            )
        )
    out = torch.cat(outputs, dim=2)
    if out.shape[2] < query.shape[2]:  # Padded query tokens: zeros, as no logit is read there.
        out = F.pad(out, (0, 0, 0, query.shape[2] - out.shape[2]))
    return out.transpose(1, 2).contiguous(), None


def use_varlen_sdpa() -> None:
    """Make `sdpa` attend per packed sequence in this process (idempotent; unpacked calls are unchanged)."""
    AttentionInterface.register("sdpa", varlen_sdpa_attention)
