"""Context copy prior: n-gram matches in the sequence so far bias the Markov head's walk.

The drafter sees only the last `context_len` target positions, so it cannot look up a name, a
number or a phrase from further back; summaries, code edits and dialogue turns repeat them.
Prompt lookup decoding copies the token that followed the most recent earlier occurrence of
the last few tokens. Here that match does not replace the drafter: it adds a bonus alpha_o to
the copied token's logit at each Markov step, so the drafter's own belief still decides
between copying and not:

    p_k(v) ∝ exp(U_k(v) + B(x_{k-1}, v) + sum_o alpha_o [v = follow_o(x_<k)])

follow_o(x) is the token that followed the most recent earlier occurrence of x's last o - 1
tokens in the sequence so far: the committed prompt and output, then the drafted path (an
occurrence inside the path is the most recent). How far a match is trusted can depend on its
kind: "u" (the o - 1 tokens occurred once before), "c" (several times, always followed by the
same token) or "a" (followed by different tokens; the latest is copied). A prior may give each
(order, kind) its own bonus: a bigram seen once is weak evidence in code, a bigram always
continued the same way is strong evidence everywhere. A copied token may lie outside the reduced
draft vocabulary (copied names usually do); its logit then comes from its full LM-head row.
The bonuses (`fit_bonuses`) and a confidence correction per match class (`fit_confidence`)
are a few scalars fitted on the calibration split by the calibrate stage, stored in the
checkpoint's config. Verification is unchanged, so outputs are too: only which tokens are
proposed changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

KINDS = ("u", "c", "a")  # unique, consistent, ambiguous earlier occurrences


class Match(NamedTuple):
    token: int  # the follower copied (the latest one)
    kind: str  # one of KINDS


def match_kind(count: int, consistent: bool) -> str:
    return "u" if count == 1 else ("c" if consistent else "a")


@dataclass(frozen=True)
class CopyPrior:
    """Logit bonus per n-gram order (order o matches the last o - 1 tokens, o >= 2), and the
    confidence head's correction per match class: a step whose longest match is of order o
    (class 0: none) has its raw confidence logit z replaced by scale * z + shift. The class
    depends on the path's tokens only, never on the token drafted at that step. `kind_bonuses`
    give single (order, kind) pairs a bonus of their own (see `KINDS`)."""

    bonuses: tuple[tuple[int, float], ...]  # ((order, bonus), ...), orders ascending
    confidence: tuple[tuple[int, float, float], ...] = ()  # ((class, scale, shift), ...); absent: identity
    kind_bonuses: tuple[tuple[int, str, float], ...] = ()  # ((order, kind, bonus), ...): overrides per match kind

    def __post_init__(self) -> None:
        orders = [o for o, _ in self.bonuses]
        if any(o < 2 for o in orders) or len(set(orders)) != len(orders):
            raise ValueError(f"copy prior orders must be distinct and >= 2, got {orders}")
        if any(b < 0 for _, b in self.bonuses) or any(b < 0 for _, _, b in self.kind_bonuses):
            raise ValueError("copy prior bonuses must be >= 0")
        if any(o not in orders or k not in KINDS for o, k, _ in self.kind_bonuses):
            raise ValueError(f"kind bonuses need one of the prior's orders {orders} and a kind in {KINDS}")
        object.__setattr__(self, "bonuses", tuple(sorted((int(o), float(b)) for o, b in self.bonuses)))
        object.__setattr__(self, "confidence", tuple(sorted((int(c), float(a), float(b)) for c, a, b in self.confidence)))
        per_order = dict(self.bonuses)
        kinds = {(int(o), str(k)): float(b) for o, k, b in self.kind_bonuses}
        # an override equal to its order's bonus changes nothing: dropped, so equal priors compare equal
        object.__setattr__(self, "kind_bonuses", tuple((o, k, b) for (o, k), b in sorted(kinds.items()) if b != per_order[o]))

    @cached_property
    def _table(self) -> dict[tuple[int, str], float]:  # (order, kind) -> bonus: looked up per drafted step
        table = {(o, k): b for o, b in self.bonuses for k in KINDS}
        table.update({(o, k): b for o, k, b in self.kind_bonuses})
        return table

    def bonus(self, order: int, kind: str) -> float:
        """The bonus a match of this order and kind gives its copied token."""
        return self._table.get((order, kind), 0.0)

    @cached_property
    def orders(self) -> tuple[int, ...]:
        """The orders that give a bonus to some kind of match."""
        return tuple(o for o, _ in self.bonuses if any(self.bonus(o, k) > 0 for k in KINDS))

    @property
    def orders_all(self) -> tuple[int, ...]:
        """Every order the prior has a bonus for, zero ones included."""
        return tuple(o for o, _ in self.bonuses)

    def with_bonus(self, order: int, bonus: float, kind: str | None = None) -> "CopyPrior":
        """This prior with `order`'s bonus set to `bonus`: for every kind, or for one `kind`."""
        if kind is None:
            kept = tuple(t for t in self.kind_bonuses if t[0] != order)
            return CopyPrior(tuple((o, bonus if o == order else b) for o, b in self.bonuses), self.confidence, kept)
        kept = tuple(t for t in self.kind_bonuses if t[:2] != (order, kind))
        return CopyPrior(self.bonuses, self.confidence, kept + ((order, kind, bonus),))

    def with_confidence(self, confidence: dict[int, tuple[float, float]]) -> "CopyPrior":
        return CopyPrior(self.bonuses, tuple((c, a, b) for c, (a, b) in confidence.items()), self.kind_bonuses)

    @property
    def span(self) -> int:
        """How many trailing tokens a lookup needs."""
        return max(self.orders, default=1) - 1

    @property
    def active(self) -> bool:
        return bool(self.orders)

    def to_dict(self) -> dict:
        out: dict = {"bonuses": {str(o): b for o, b in self.bonuses}}
        if self.kind_bonuses:
            out["kind_bonuses"] = {f"{o}{k}": b for o, k, b in self.kind_bonuses}
        if self.confidence:
            out["confidence"] = {str(c): [a, b] for c, a, b in self.confidence}
        return out

    @staticmethod
    def from_dict(d: dict | None) -> "CopyPrior | None":
        if not d:
            return None
        conf = tuple((int(c), float(a), float(b)) for c, (a, b) in (d.get("confidence") or {}).items())
        kinds = tuple((int(key[:-1]), key[-1], float(b)) for key, b in (d.get("kind_bonuses") or {}).items())
        return CopyPrior(tuple((int(o), float(b)) for o, b in d["bonuses"].items()), conf, kinds)


class NgramIndex:
    """For every order o, the token that followed the most recent occurrence of each
    (o - 1)-gram of a growing sequence, how often the (o - 1)-gram was followed, and whether
    always by the same token. `extend` is O(orders) per token."""

    def __init__(self, orders: Sequence[int], tokens: Iterable[int] = ()) -> None:
        self.orders = tuple(sorted(set(orders)))
        self.follow: dict[int, dict[tuple[int, ...], tuple[int, int, bool]]] = {o: {} for o in self.orders}  # key -> (latest, count, consistent)
        self._tail: list[int] = []  # the last max(order) tokens
        self.size = 0  # tokens seen
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        keep = max(self.orders, default=1)
        for t in tokens:
            t = int(t)
            self.size += 1
            self._tail.append(t)
            for o in self.orders:
                if len(self._tail) >= o:
                    key = tuple(self._tail[-o:-1])
                    seen = self.follow[o].get(key)
                    self.follow[o][key] = (t, 1, True) if seen is None else (t, seen[1] + 1, seen[2] and seen[0] == t)
            if len(self._tail) > keep:
                del self._tail[0]

    def matches(self, suffix: Sequence[int], prior: CopyPrior, fresh: int = 0) -> dict[int, Match]:
        """Order -> the token that followed the most recent earlier occurrence of `suffix`'s
        last o - 1 tokens and the match's kind, for the prior's orders that have one whose
        kind the prior gives a bonus. suffix: the sequence's last tokens, of which the last
        `fresh` are drafted ones the index has not seen (give at least `prior.span` tokens
        before them); occurrences among them are the most recent."""
        out: dict[int, Match] = {}
        n = len(suffix)
        for o in prior.orders:
            if o - 1 > n:
                continue
            key = tuple(suffix[n - o + 1 :])
            drafted = [suffix[i] for i in range(n - 1, max(n - fresh, o - 1) - 1, -1) if tuple(suffix[i - o + 1 : i]) == key]
            latest, count, consistent = self.follow[o].get(key, (None, 0, True)) if o in self.follow else (None, 0, True)
            if drafted:  # followers among the drafted tokens, most recent first
                consistent = consistent and all(t == drafted[0] for t in drafted) and (latest is None or latest == drafted[0])
                latest, count = drafted[0], count + len(drafted)
            if latest is None:
                continue
            m = Match(int(latest), match_kind(count, consistent))
            if prior.bonus(o, m.kind) > 0:
                out[o] = m
        return out

    def candidates(self, suffix: Sequence[int], prior: CopyPrior, fresh: int = 0) -> dict[int, float]:
        """Copy candidates after `suffix` (see `matches`) -> summed bonus."""
        return candidates_of(self.matches(suffix, prior, fresh), prior)


def candidates_of(matches: dict[int, Match], prior: CopyPrior) -> dict[int, float]:
    """`NgramIndex.matches` -> copied token -> summed bonus of the orders proposing it."""
    out: dict[int, float] = {}
    for o, (tok, kind) in matches.items():
        out[tok] = out.get(tok, 0.0) + prior.bonus(o, kind)
    return out


def match_class(matches: dict[int, Match]) -> int:
    """The longest matched order (0: no match): what the confidence correction keys on."""
    return max(matches, default=0)


def adjust_logits(prior: CopyPrior, z: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Raw confidence logits and their steps' match classes (same shape) -> the corrected
    logits: scale * z + shift of each class the prior has a correction for, z otherwise."""
    out = np.array(z, dtype=np.float64, copy=True)
    for c, scale, shift in prior.confidence:
        sel = classes == c
        out[sel] = scale * out[sel] + shift
    return out


def fit_confidence(z: np.ndarray, accepted: np.ndarray, classes: np.ndarray, min_steps: int = 50) -> dict[int, tuple[float, float]]:
    """Per match class, (scale, shift) maximising the likelihood of acceptance given
    sigmoid(scale * z + shift) on the steps a chain reached (every earlier position accepted):
    logistic regression on one feature (Newton steps). Classes with fewer than `min_steps`
    steps keep the identity. z, accepted, classes: [n, G]."""
    reached = np.concatenate([np.ones((len(accepted), 1)), np.cumprod(accepted, axis=1)[:, :-1]], axis=1) > 0
    out: dict[int, tuple[float, float]] = {}
    for c in sorted(set(np.unique(classes[reached]).tolist())):
        sel = reached & (classes == c)
        if sel.sum() < min_steps:
            continue
        x, y = z[sel].astype(np.float64), accepted[sel].astype(np.float64)
        design = np.stack([x, np.ones_like(x)], axis=1)  # [m, 2]

        def objective(w: np.ndarray) -> float:  # mean log-likelihood minus a tiny ridge (separable classes stay finite)
            t = design @ w
            return float(np.mean(y * t - np.logaddexp(0.0, t)) - 1e-4 * w @ w)

        w = np.array([1.0, 0.0])
        for _ in range(100):
            p = 1.0 / (1.0 + np.exp(-np.clip(design @ w, -60, 60)))
            grad = design.T @ (y - p) / len(y) - 2e-4 * w
            hess = (design * (p * (1 - p))[:, None]).T @ design / len(y) + 2e-4 * np.eye(2)
            step = np.linalg.solve(hess, grad)
            t, before = 1.0, objective(w)
            while objective(w + t * step) < before and t > 1e-6:  # damped Newton: never step downhill
                t /= 2
            w = w + t * step
            if np.abs(t * step).max() < 1e-9:
                break
        out[int(c)] = (float(w[0]), float(w[1]))
    return out


def fit_bonuses(
    score: Callable[[list[CopyPrior]], list[float]],
    orders: Sequence[int],
    grid: Sequence[float],
    sweeps: int = 2,
    kinds: Sequence[str] = (),
    start: CopyPrior | None = None,
    scored: dict[CopyPrior, float] | None = None,
) -> tuple[CopyPrior, list[tuple[CopyPrior, float]]]:
    """Coordinate ascent over one bonus per order, or per (order, kind) for the given `kinds`:
    `score` rates candidate priors (higher is better, e.g. held-out tau), all of a coordinate's
    untried grid values in one call so the caller can share work between them; priors in
    `scored` (already rated) are not rated again. Starts from `start` (default: no copying);
    ties keep the smaller bonus. Returns the best prior and every (prior, score) known, each
    once, those of `scored` first."""
    grid = sorted({float(v) for v in grid} | {0.0})
    best = start if start is not None else CopyPrior(tuple((int(o), 0.0) for o in orders))
    coords = [(o, k) for o in sorted(best.orders_all, reverse=True) for k in (kinds or [None])]  # long matches first: the precise ones
    scores = dict(scored or {})
    if best not in scores:
        scores[best] = score([best])[0]
    for _ in range(sweeps):
        changed = False
        for o, k in coords:
            cands = [best.with_bonus(o, v, k) for v in grid]
            new = [p for p in cands if p not in scores]
            scores.update(zip(new, score(new) if new else []))
            i = max(range(len(cands)), key=lambda j: (scores[cands[j]], -grid[j]))
            if scores[cands[i]] > scores[best]:
                best, changed = cands[i], True
        if not changed:
            break
    return best, list(scores.items())
