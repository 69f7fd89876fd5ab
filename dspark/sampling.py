"""Sampling parameters, the logits -> probabilities transform shared by target and drafters,
and the per-row noise every sampled token is drawn with.

Sampled rows draw token t as argmax(log p_t + G_t) (the Gumbel-max trick), where G_t is
Gumbel noise fixed by the row's seed and t, the token's index in prompt + output (computed
as argmax(p_t / E_t) with E_t = exp(-G_t) exponential). Each
token is then an exact sample of the target's distribution given the tokens before it, and
the whole output is a function of the seed and the target alone: it does not depend on what
was drafted, how much was verified, the batch, the order or earlier calls, so sampled
speculative output equals plain sampled decoding with the same seed, token for token.
Drafters draw their proposals with the same noise (argmax(q_t / E_t)), which is what
makes a good draft likely to be the token the target draws (drafter-invariant speculative
decoding, Daliri, Musco and Suresh, 2024).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] the first index of the largest logit, as `argmax` (and transformers'
    greedy search) picks it. `max(-1).indices` is the same index and, on CPU, several times
    faster than `argmax` for a verify round's logits."""
    return logits.max(dim=-1).indices


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.

    The same transform defines the target distribution and the drafter's, so a verified token
    is exactly what plain sampling with these parameters would produce.
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


def is_int(x: object) -> bool:
    """An integer, not a bool (True is an int to Python, never a token id or a count here)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


class SamplingNoise:
    """The noise of one sampled row: `exponential(t)` is [V] float32 i.i.d. Exp(1), fixed by
    (seed, t), and the row draws token t as argmax(p_t / E_t), the Gumbel-max trick in
    exponential form (argmax(log p - log E), with -log E a Gumbel variable).

    t is the drawn token's index in prompt + output. Noise is made on the CPU (the same seed
    gives the same tokens on every device) and kept for the few indices a round can touch."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed = int(seed)
        self.vocab_size = vocab_size
        self._cache: dict[int, torch.Tensor] = {}

    def exponential(self, index: int) -> torch.Tensor:
        e = self._cache.get(index)
        if e is None:
            key = int(np.random.SeedSequence([self.seed & (2**64 - 1), index]).generate_state(1, np.uint64)[0])
            e = torch.rand(self.vocab_size, generator=torch.Generator().manual_seed(key)).log_().neg_()
            self._cache[index] = e  # u == 0 gives inf: that token is not drawn (probability 2^-24)
        return e

    def forget_before(self, index: int) -> None:
        """Drop noise of tokens already drawn (indices below `index`)."""
        for t in [t for t in self._cache if t < index]:
            del self._cache[t]

    def draw(self, probs: torch.Tensor, index: int, token_ids: torch.Tensor | None = None) -> int:
        """argmax(probs / E_index): an exact sample of `probs` [n].

        token_ids [n]: the vocabulary id of each entry, for a distribution over a subset of the
        vocabulary (a reduced draft vocabulary); default entry i is token i."""
        e = self.exponential(index)
        if token_ids is not None:
            e = e[token_ids.cpu()]
        elif probs.shape[-1] != e.shape[0]:  # a draft model's vocabulary may be padded differently
            n = probs.shape[-1]
            e = e[:n] if n <= e.shape[0] else torch.cat([e, e.new_full((n - e.shape[0],), math.inf)])
        return int((probs.float().cpu() / e).argmax())


def draw_tokens(probs: torch.Tensor, noise: SamplingNoise, indices: list[int]) -> list[int]:
    """[N, V] distributions, one per token index -> the N tokens the row's noise draws."""
    e = torch.stack([noise.exponential(t) for t in indices])  # [N, V]
    return (probs.float().cpu() / e).argmax(-1).tolist()
