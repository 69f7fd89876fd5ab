"""Training losses: L = w_ce·CE + w_tv·TV + w_conf·Conf, positions weighted by exp(-(k-1)/gamma).

- CE_k   = -log p_d,k(y_k)                   (next-token cross-entropy on the target's token)
- TV_k   = ||p_d,k - p_t,k||_1               (as in the method notes: the L1 distance)
- Conf_k = BCE(c_k, c*_k), c*_k = 1 - ½||p_d,k - p_t,k||_1, detached: the analytic probability
  that speculative sampling accepts draft position k.
Each term is averaged over valid (block, k) pairs with the position weights:
  term = Σ w_k·m_bk·l_bk / Σ w_k·m_bk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0


@dataclass
class LossOutput:
    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    l1: torch.Tensor  # [B, G] per-position ||p_d - p_t||_1 (detached), for metrics


def position_weights(gamma: int, device: torch.device | None = None) -> torch.Tensor:
    """[G]: w_k = exp(-(k-1)/gamma), k = 1..G."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / gamma)


def weighted_mean(x: torch.Tensor, w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """x [B, G], w [G], valid [B, G] bool -> scalar."""
    ww = w[None, :] * valid.float()
    return (x * ww).sum() / ww.sum().clamp_min(1e-8)


def dspark_loss(
    draft_logits: torch.Tensor,  # [B, G, V], or [B, G, Vd] over `vocab`
    target_logits: torch.Tensor,  # [B, G, V] (no grad)
    labels: torch.Tensor,  # [B, G] target tokens y_k
    conf_logits: torch.Tensor,  # [B, G]
    valid: torch.Tensor,  # [B, G] bool
    weights: LossWeights = LossWeights(),
    vocab: torch.Tensor | None = None,  # [Vd] sorted token ids: the draft covers only these
) -> LossOutput:
    """With `vocab`, p_d is zero outside it: the L1 distance adds the target's mass there,
    and CE skips labels outside it (no draft over those tokens can be right)."""
    g = draft_logits.shape[1]
    w = position_weights(g, draft_logits.device)
    logp_d = F.log_softmax(draft_logits.float(), dim=-1)
    p_d = logp_d.exp()
    p_t = F.softmax(target_logits.float(), dim=-1)
    ce_valid = valid
    if vocab is None:
        l1 = (p_d - p_t).abs().sum(-1)  # [B, G]
    else:
        p_t_in = p_t[..., vocab]  # [B, G, Vd]
        l1 = (p_d - p_t_in).abs().sum(-1) + (1.0 - p_t_in.sum(-1)).clamp_min(0.0)
        column = torch.full((target_logits.shape[-1],), -1, dtype=torch.long, device=labels.device)
        column[vocab] = torch.arange(len(vocab), device=labels.device)
        labels = column[labels.clamp_min(0)]
        ce_valid = valid & (labels >= 0)
    ce = -logp_d.gather(-1, labels.clamp_min(0)[..., None])[..., 0]  # [B, G]
    soft_label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    conf = F.binary_cross_entropy_with_logits(conf_logits.float(), soft_label, reduction="none")
    ce_m = weighted_mean(ce, w, ce_valid)
    tv_m, conf_m = (weighted_mean(x, w, valid) for x in (l1, conf))
    total = weights.ce * ce_m + weights.tv * tv_m + weights.conf * conf_m
    return LossOutput(total, ce_m.detach(), tv_m.detach(), conf_m.detach(), l1.detach())
