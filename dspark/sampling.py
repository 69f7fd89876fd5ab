"""Sampling parameters and the logits -> probabilities transform shared by target and drafters."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] the first index of the largest logit, as `argmax` (and transformers'
    greedy search) picks it. `max(-1).indices` is the same index and, on CPU, 2-5x faster than
    `argmax` for a verify round's logits (16 rows x 5 tokens x 49k in bfloat16: 1.5 vs 7.2 ms)."""
    return logits.max(dim=-1).indices


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.

    The same transform defines the target distribution and the drafter's, so rejection
    sampling targets exactly what plain sampling with these parameters would produce.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)
