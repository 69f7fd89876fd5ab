"""Speculation statistics as plain dataclasses: per request, and summed over many.

Every figure counts what the request kept. A round may verify and even accept draft tokens
past the request's end (max_new_tokens, EOS, a stop string, the context); those tokens are
thrown away, so they count neither as accepted nor as verified, and no attempt past the end
counts towards per-position acceptance. The glossary with the invariants is in
docs/metrics.md; `round_counts` is the one place a verified round becomes numbers, and
`speculation_rates` the one place counters become ratios.

Invariants (tested against a recount from the verified trees):
  emitted == num_output_tokens                  (the prefill's first token included)
  tau == emitted / (prefills + rounds)          (tokens per target forward; plain decoding: 1.0)
  accepted <= verified,  rejected == verified - accepted
  sum(position_accepts) == accepted,  position_accepts[k] <= position_attempts[k]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RoundCounts:
    """What one verify round of one request contributes, after the request's end is applied."""

    verified: int  # draft nodes the target checked, within the request
    accepted: int  # draft tokens accepted and kept
    emitted: int  # tokens the request kept from this round (accepted + the target's own, or fewer at the end)
    attempted_depths: tuple[int, ...]  # depths d where a child of the accepted depth-(d-1) node was verified
    counted_nodes: tuple[int, ...]  # node indices within the request (their confidences feed the entropy)


def round_counts(parents: list[int], accepted_nodes: list[int], kept: int) -> RoundCounts:
    """parents: the verified tree's parent indices (-1 = anchor); accepted_nodes: the accepted
    path, root first; kept: how many of the round's len(accepted_nodes) + 1 tokens the request
    kept (fewer when it ended inside the round).

    When the request ends on an accepted draft token (kept <= accepted), everything deeper than
    `kept` lies past the end: the nodes there were verified for nothing and count as nothing."""
    n_acc = len(accepted_nodes)
    if not 0 <= kept <= n_acc + 1:
        raise ValueError(f"kept={kept} outside [0, {n_acc + 1}]")
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    window = kept if kept <= n_acc else math.inf  # deepest depth inside the request
    counted = tuple(i for i, d in enumerate(depth) if d <= window)
    with_children = {parents[i] for i in counted}  # -1 (the anchor) or node index
    path = [-1] + list(accepted_nodes)
    attempted = tuple(d for d in range(1, n_acc + 2) if d <= window and path[d - 1] in with_children)
    return RoundCounts(
        verified=len(counted),
        accepted=min(n_acc, kept),
        emitted=kept,
        attempted_depths=attempted,
        counted_nodes=counted,
    )


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def speculation_rates(*, verified: int, accepted: int, rounds: int, emitted: int, prefills: int) -> dict:
    """The ratios every output reports, from summed counters (None where undefined)."""
    return {
        "mean_accepted_length": ratio(emitted, prefills + rounds),  # tau
        "acceptance_rate": ratio(accepted, verified),
        "correction_rate": ratio(verified - accepted, verified),
        "mean_verify_budget": ratio(verified, rounds),
    }


def add_counts(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Per-depth counts summed elementwise, the shorter list padded with zeros."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip([*a, *[0] * (n - len(a))], [*b, *[0] * (n - len(b))])]


def entropy_bits(confidences: Sequence[float]) -> float:
    """Summed binary entropy (bits) of confidences; divided by their count it is the mean the
    evaluation plan watches (near 1: the confidence head cannot tell good drafts from bad)."""
    if len(confidences) == 0:
        return 0.0
    c = np.clip(np.asarray(confidences, dtype=np.float64), 1e-9, 1 - 1e-9)
    return float(np.sum(-(c * np.log2(c) + (1 - c) * np.log2(1 - c))))


@dataclass
class RequestStats:
    drafted: int = 0  # draft tokens proposed (before scheduling)
    verified: int = 0  # draft tokens the target checked, within the request
    accepted: int = 0  # draft tokens accepted and kept
    rounds: int = 0  # verify rounds (target forwards after the prefill)
    prefills: int = 0  # 1 once the request's prompt was prefilled (it yields the first token)
    drafted_rounds: int = 0  # rounds with a draft for this row (the rest skipped drafting)
    emitted: int = 0  # output tokens kept: the prefill's first token plus every round's
    draft_s: float = 0.0
    verify_s: float = 0.0
    # per draft depth k (index k-1): rounds where a node at depth k was verified under the
    # accepted depth-(k-1) node (a real attempt), and those where one was accepted and kept
    position_attempts: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)  # c of every counted verified node (for entropy)

    @property
    def rejected(self) -> int:
        return self.verified - self.accepted

    def _rate(self, name: str) -> float:
        value = speculation_rates(verified=self.verified, accepted=self.accepted, rounds=self.rounds,
                                  emitted=self.emitted, prefills=self.prefills)[name]
        return 0.0 if value is None else value

    @property
    def acceptance_rate(self) -> float:
        return self._rate("acceptance_rate")

    @property
    def correction_rate(self) -> float:
        return self._rate("correction_rate")

    @property
    def mean_accepted_length(self) -> float:
        """tau: output tokens per target forward, the prefill counted as one forward that
        yields the first token (plain decoding: exactly 1.0)."""
        return self._rate("mean_accepted_length")

    @property
    def mean_verify_budget(self) -> float:
        return self._rate("mean_verify_budget")

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
        return entropy_bits(self.confidences) / len(self.confidences)

    def record_prefill(self) -> None:
        """The prompt's forward, which yields the first output token."""
        self.prefills += 1
        self.emitted += 1

    def record_round(self, drafted: int, counts: RoundCounts, confidences: list[float]) -> None:
        """One verify round. drafted: nodes proposed before scheduling; confidences: c of every
        verified node (only those `counts` kept inside the request are recorded)."""
        self.rounds += 1
        self.drafted_rounds += drafted > 0
        self.drafted += drafted
        self.verified += counts.verified
        self.accepted += counts.accepted
        self.emitted += counts.emitted
        self.confidences.extend(confidences[i] for i in counts.counted_nodes)
        deepest = max(counts.attempted_depths, default=0)
        while len(self.position_attempts) < deepest:
            self.position_attempts.append(0)
            self.position_accepts.append(0)
        for d in counts.attempted_depths:
            self.position_attempts[d - 1] += 1
            self.position_accepts[d - 1] += d <= counts.accepted

    def merge(self, other: "RequestStats") -> None:
        for name in ("drafted", "verified", "accepted", "rounds", "prefills", "drafted_rounds", "emitted", "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.position_attempts = add_counts(self.position_attempts, other.position_attempts)
        self.position_accepts = add_counts(self.position_accepts, other.position_accepts)
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
