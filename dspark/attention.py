"""transformers' SDPA attention, without copying the KV cache for grouped-query verify blocks.

With an explicit mask and more than one query token (every verify forward: the engine passes
a tree/padding mask), transformers' `sdpa` expands the key/value heads to all query heads with
`repeat_kv`, a copy of the layer's whole KV cache per forward. On CPU, torch's SDPA takes
grouped-query attention with a mask directly (`enable_gqa=True`), so `dspark_sdpa` calls it
that way: the same attention, computed over the KV heads in place, with bit-identical logits
and no copy (SmolLM2-135M has 3 KV heads for 9 query heads, so the copy is three times the
cache). Everything else goes to transformers' own `sdpa`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "dspark_sdpa"

# Every SDPA backend but cuDNN's. cuDNN attention (which torch picks on Hopper GPUs) builds and
# caches an execution plan per exact tensor shape, and decoding lengthens the keys every forward,
# so each step would pay a plan build on the host and the plan cache would keep growing.
SHAPE_AGNOSTIC_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decoding_sdpa(device: torch.device) -> AbstractContextManager:
    """Keeps SDPA off cuDNN's per-shape plans on CUDA; nothing changes elsewhere."""
    return sdpa_kernel(SHAPE_AGNOSTIC_SDPA) if device.type == "cuda" else nullcontext()


def sdpa_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, W, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, W, S] additive or bool
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and dropout == 0.0
    if query.device.type == "cpu" and grouped and plain and attention_mask is not None and query.shape[2] > 1:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )  # [B, H, W, D]
        return out.transpose(1, 2).contiguous(), None
    with decoding_sdpa(query.device):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)


AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_gqa_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
