"""Speculation statistics as plain dataclasses: per request, and summed over many."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestStats:
    drafted: int = 0  # draft tokens proposed (before scheduling)
    verified: int = 0  # draft tokens sent to the target
    accepted: int = 0  # draft tokens the target accepted
    rounds: int = 0  # target forward passes after prefill
    drafted_rounds: int = 0  # rounds with a draft for this row (the rest skipped drafting)
    emitted: int = 0  # tokens gained from rounds (accepted + one target token per round)
    draft_s: float = 0.0
    verify_s: float = 0.0
    # per draft depth k (index k-1): rounds where depth k was verified with depths < k accepted
    position_attempts: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)  # c of every verified node (for entropy)

    @property
    def rejected(self) -> int:
        return self.verified - self.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0

    @property
    def correction_rate(self) -> float:
        return self.rejected / self.verified if self.verified else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens gained per round, counting the target's own token (AR = 1.0)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def mean_verify_budget(self) -> float:
        return self.verified / self.rounds if self.rounds else 0.0

    @property
    def draft_share(self) -> float:
        """Fraction of rounds that drafted (the rest skipped it: back-off or the draft gate)."""
        return self.drafted_rounds / self.rounds if self.rounds else 0.0

    @property
    def conditional_acceptance(self) -> list[float]:
        return [a / n if n else float("nan") for a, n in zip(self.position_accepts, self.position_attempts)]

    @property
    def confidence_entropy(self) -> float:
        """Mean binary entropy (bits) of verified confidences: near 1 means the confidence head
        cannot tell good drafts from bad ones, near 0 means it is decisive."""
        if not self.confidences:
            return float("nan")
        c = np.clip(np.asarray(self.confidences, dtype=np.float64), 1e-9, 1 - 1e-9)
        return float(np.mean(-(c * np.log2(c) + (1 - c) * np.log2(1 - c))))

    def record_round(self, drafted: int, verified_depths: list[int], accepted_depth: int, confidences: list[float]) -> None:
        """One verification round. verified_depths: depth of every verified node; accepted_depth:
        how many draft tokens were accepted."""
        self.rounds += 1
        self.drafted_rounds += drafted > 0
        self.drafted += drafted
        self.verified += len(verified_depths)
        self.accepted += accepted_depth
        self.emitted += accepted_depth + 1
        self.confidences.extend(confidences)
        max_depth = max(verified_depths, default=0)
        while len(self.position_attempts) < max_depth:
            self.position_attempts.append(0)
            self.position_accepts.append(0)
        # depth k was attempted if verified and depth k-1 accepted; a tree may verify depth k
        # only under a rejected branch, which counts as no attempt on the accepted path.
        for k in range(1, min(max_depth, accepted_depth + 1) + 1):
            self.position_attempts[k - 1] += 1
            if k <= accepted_depth:
                self.position_accepts[k - 1] += 1

    def merge(self, other: "RequestStats") -> None:
        for name in ("drafted", "verified", "accepted", "rounds", "drafted_rounds", "emitted", "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.position_attempts), len(other.position_attempts))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        self.position_attempts = [a + b for a, b in zip(pad(self.position_attempts), pad(other.position_attempts))]
        self.position_accepts = [a + b for a, b in zip(pad(self.position_accepts), pad(other.position_accepts))]
        self.confidences.extend(other.confidences)

    def summary(self) -> dict:
        return {
            "drafted": self.drafted,
            "verified": self.verified,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "rounds": self.rounds,
            "draft_share": self.draft_share,
            "acceptance_rate": self.acceptance_rate,
            "correction_rate": self.correction_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "mean_verify_budget": self.mean_verify_budget,
            "conditional_acceptance": self.conditional_acceptance,
            "confidence_entropy": self.confidence_entropy,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
        }


def aggregate(stats: list[RequestStats]) -> RequestStats:
    total = RequestStats()
    for s in stats:
        total.merge(s)
    return total


def percentile(values: list[float], q: float) -> float:
    """Percentile with linear interpolation; NaN for no values."""
    return float(np.percentile(values, q)) if values else math.nan
