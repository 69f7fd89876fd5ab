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

A `CopyScorer` replaces the fixed bonuses with a learned decision. At each Markov step the
options are the drafter's own top-1 and every copy candidate (the latest follower of each
order's match); a candidate c is worth u(c) = w . phi(c) against the top-1, with phi the
evidence for it (the longest order proposing it and that match's kind, how many orders agree,
how often and how recently the n-gram was followed, whether from the prompt, the drafter's
logits of c and of its top-1, the confidence head's logit, the step). Its logit becomes
l_top1 + u(c), so p(c) / p(top-1) = exp(u(c)): the odds a conditional logit fitted on the
calibration split (`fit_copy_scorer`, along the target's own path) gives it. Both rules share
one interface: `lookup` (match class, candidates) and `rescore` (the candidates' new logits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Union

import numpy as np

KINDS = ("u", "c", "a")  # unique, consistent, ambiguous earlier occurrences
MAX_DISTINCT = 5  # distinct followers an index keeps per n-gram (enough for `KINDS` and the scorer's feature)


class Match(NamedTuple):
    token: int  # the follower copied (the latest one)
    kind: str  # one of KINDS


class Candidate(NamedTuple):
    """A copy candidate's evidence, from the longest order proposing it."""

    order: int
    kind: str  # one of KINDS
    count: int  # how often that (order - 1)-gram was followed
    distance: int  # positions from the copied follower to the position being drafted (>= 1)
    agree: int  # orders whose latest follower is this token
    distinct: int  # distinct followers of that (order - 1)-gram (at most MAX_DISTINCT)
    from_prompt: bool  # the copied follower lies in the prompt


class StepView(NamedTuple):
    """One parent's Markov step before copying, as a copy rule sees it."""

    k: int  # depth in the block (0-based)
    top1: int  # the drafter's own choice (token id)
    l_top1: float  # its logit
    lse: float  # log-sum-exp of the step's logits over the draft vocabulary
    z: float  # the confidence head's raw logit at this step


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

    def lookup(self, index: "NgramIndex", suffix: Sequence[int], fresh: int = 0) -> tuple[int, dict[int, float]]:
        """(match class, copied token -> summed bonus) after `suffix` (see `NgramIndex.matches`)."""
        found = index.matches(suffix, self, fresh)
        return match_class(found), candidates_of(found, self)

    def rescore(self, cands: dict[int, float], logits: dict[int, tuple[float, bool]], step: StepView) -> dict[int, float]:
        """Copied token -> its logit plus its bonus. logits: token -> (logit, in the draft vocabulary)."""
        return {t: logits[t][0] + b for t, b in cands.items()}

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
    """For every order o, per (o - 1)-gram of a growing sequence: the token that followed its
    most recent occurrence and that follower's position, how often it was followed, and its
    distinct followers (the first MAX_DISTINCT). `extend` is O(orders) per token. Positions
    before `prompt_len` are the prompt's."""

    def __init__(self, orders: Sequence[int], tokens: Iterable[int] = (), prompt_len: int = 0) -> None:
        self.orders = tuple(sorted(set(orders)))
        # key -> (latest follower, times followed, distinct followers, the latest's position)
        self.follow: dict[int, dict[tuple[int, ...], tuple[int, int, tuple[int, ...], int]]] = {o: {} for o in self.orders}
        self.prompt_len = prompt_len
        self._tail: list[int] = []  # the last max(order) tokens
        self.size = 0  # tokens seen
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        keep = max(self.orders, default=1)
        for t in tokens:
            t = int(t)
            self._tail.append(t)
            for o in self.orders:
                if len(self._tail) >= o:
                    key = tuple(self._tail[-o:-1])
                    _, count, followers, _ = self.follow[o].get(key, (t, 0, (), 0))
                    if t not in followers and len(followers) < MAX_DISTINCT:
                        followers += (t,)
                    self.follow[o][key] = (t, count + 1, followers, self.size)
            self.size += 1
            if len(self._tail) > keep:
                del self._tail[0]

    def _match(self, suffix: Sequence[int], o: int, fresh: int) -> tuple[int, int, tuple[int, ...], int] | None:
        """Order o's match after `suffix` (see `matches`): (latest follower, times followed,
        distinct followers, the latest's position in the sequence), or None."""
        n = len(suffix)
        if o - 1 > n:
            return None
        key = tuple(suffix[n - o + 1 :])
        latest, count, followers, pos = self.follow[o].get(key, (None, 0, (), -1)) if o in self.follow else (None, 0, (), -1)
        first = self.size - (n - fresh)  # the sequence position of suffix[0]
        for i in range(max(n - fresh, o - 1), n):  # followers among the drafted tokens, oldest first
            if tuple(suffix[i - o + 1 : i]) == key:
                latest, count, pos = suffix[i], count + 1, first + i
                if latest not in followers and len(followers) < MAX_DISTINCT:
                    followers += (latest,)
        return None if latest is None else (int(latest), count, followers, pos)

    def matches(self, suffix: Sequence[int], prior: CopyPrior, fresh: int = 0) -> dict[int, Match]:
        """Order -> the token that followed the most recent earlier occurrence of `suffix`'s
        last o - 1 tokens and the match's kind, for the prior's orders that have one whose
        kind the prior gives a bonus. suffix: the sequence's last tokens, of which the last
        `fresh` are drafted ones the index has not seen (give at least `prior.span` tokens
        before them); occurrences among them are the most recent."""
        out: dict[int, Match] = {}
        for o in prior.orders:
            m = self._match(suffix, o, fresh)
            if m is None:
                continue
            found = Match(m[0], match_kind(m[1], len(m[2]) == 1))
            if prior.bonus(o, found.kind) > 0:
                out[o] = found
        return out

    def followers(self, suffix: Sequence[int], orders: Sequence[int], fresh: int = 0) -> set[int]:
        """Every token that followed an earlier occurrence of `suffix`'s last o - 1 tokens, for
        each order o in `orders` (as in `matches`): the latest follower and the first
        MAX_DISTINCT distinct ones. What a rule choosing among all earlier continuations could copy."""
        out: set[int] = set()
        for o in orders:
            m = self._match(suffix, o, fresh)
            if m is not None:
                out.add(m[0])
                out.update(m[2])
        return out

    def candidates(self, suffix: Sequence[int], prior: CopyPrior, fresh: int = 0) -> dict[int, float]:
        """Copy candidates after `suffix` (see `matches`) -> summed bonus."""
        return candidates_of(self.matches(suffix, prior, fresh), prior)

    def evidence(self, suffix: Sequence[int], orders: Sequence[int], fresh: int = 0) -> tuple[int, dict[int, Candidate]]:
        """(the longest matched order (0: none), copied token -> its `Candidate` evidence) over
        every order in `orders` (ascending) that has a match after `suffix` (as in `matches`)."""
        here = self.size + fresh  # the position being drafted
        out: dict[int, Candidate] = {}
        longest = 0
        for o in orders:
            m = self._match(suffix, o, fresh)
            if m is None:
                continue
            token, count, followers, pos = m
            longest = o
            agree = out[token].agree + 1 if token in out else 1
            out[token] = Candidate(o, match_kind(count, len(followers) == 1), count, here - pos, agree, len(followers), pos < self.prompt_len)
        return longest, out


def candidates_of(matches: dict[int, Match], prior: CopyPrior) -> dict[int, float]:
    """`NgramIndex.matches` -> copied token -> summed bonus of the orders proposing it."""
    out: dict[int, float] = {}
    for o, (tok, kind) in matches.items():
        out[tok] = out.get(tok, 0.0) + prior.bonus(o, kind)
    return out


def match_class(matches: dict[int, Match]) -> int:
    """The longest matched order (0: no match): what the confidence correction keys on."""
    return max(matches, default=0)


def adjust_logits(prior: CopyRule, z: np.ndarray, classes: np.ndarray) -> np.ndarray:
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
    logistic regression on one feature (Newton steps). The scale is kept >= 0: a more
    confident head never means a less likely acceptance, so where the head says nothing
    useful about a class (long copies are accepted almost regardless of it) the class gets
    its base rate (scale 0). Classes with fewer than `min_steps` steps keep the identity.
    z, accepted, classes: [n, G]."""
    reached = np.concatenate([np.ones((len(accepted), 1)), np.cumprod(accepted, axis=1)[:, :-1]], axis=1) > 0
    out: dict[int, tuple[float, float]] = {}
    for c in sorted(set(np.unique(classes[reached]).tolist())):
        sel = reached & (classes == c)
        if sel.sum() < min_steps:
            continue
        x, y = z[sel].astype(np.float64), accepted[sel].astype(np.float64)
        scale, shift = _logistic_fit(np.stack([x, np.ones_like(x)], axis=1), y, np.array([1.0, 0.0]))
        if scale < 0:  # the likelihood is concave: the best scale >= 0 is then 0
            scale, (shift,) = 0.0, _logistic_fit(np.ones((len(y), 1)), y, np.zeros(1))
        out[int(c)] = (float(scale), float(shift))
    return out


def _logistic_fit(design: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weights maximising mean log-likelihood of y ~ Bernoulli(sigmoid(design @ w)) minus a
    tiny ridge (separable classes stay finite): damped Newton from `w`. design [m, p]."""
    def objective(w: np.ndarray) -> float:
        t = design @ w
        return float(np.mean(y * t - np.logaddexp(0.0, t)) - 1e-4 * w @ w)

    eye = np.eye(design.shape[1])
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-np.clip(design @ w, -60, 60)))
        grad = design.T @ (y - p) / len(y) - 2e-4 * w
        hess = (design * (p * (1 - p))[:, None]).T @ design / len(y) + 2e-4 * eye
        step = np.linalg.solve(hess, grad)
        t, before = 1.0, objective(w)
        while objective(w + t * step) < before and t > 1e-6:  # never step downhill
            t /= 2
        w = w + t * step
        if np.abs(t * step).max() < 1e-9:
            break
    return w


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


# ------------------------------------------------------------------ learned copy decision


def scorer_features(orders: Sequence[int]) -> tuple[str, ...]:
    """The names of a scorer's features, in `CopyScorer.features` order."""
    return (
        ("bias", "gap") + tuple(f"{o}{k}" for o in orders for k in KINDS)
        + ("agree", "log_count", "log_distance", "step", "top1_logprob", "logprob", "in_vocab", "distinct", "from_prompt", "confidence")
    )


@dataclass(frozen=True)
class CopyScorer:
    """The learned copy decision (module docstring): utility u(c) = w . phi(c) of copying c
    instead of the drafter's top-1, over `scorer_features(orders)`; confidence corrections per
    match class (the longest matched order) as in `CopyPrior`."""

    orders: tuple[int, ...]
    weights: tuple[float, ...]
    confidence: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self) -> None:
        orders = tuple(sorted({int(o) for o in self.orders}))
        if not orders or orders[0] < 2:
            raise ValueError(f"copy scorer orders must be >= 2, got {self.orders}")
        object.__setattr__(self, "orders", orders)
        if len(self.weights) != len(scorer_features(orders)):
            raise ValueError(f"copy scorer over orders {orders} needs {len(scorer_features(orders))} weights, got {len(self.weights)}")
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))
        object.__setattr__(self, "confidence", tuple(sorted((int(c), float(a), float(b)) for c, a, b in self.confidence)))

    @property
    def span(self) -> int:
        return self.orders[-1] - 1

    @property
    def active(self) -> bool:
        return any(self.weights)

    @cached_property
    def _slots(self) -> dict[tuple[int, str], int]:  # (order, kind) -> its one-hot feature
        return {(o, k): 2 + 3 * i + j for i, o in enumerate(self.orders) for j, k in enumerate(KINDS)}

    def features(self, c: Candidate, logit: float, in_vocab: bool, step: StepView) -> list[float]:
        """phi(c): a candidate with its logit (the LM-head row plus the Markov bias) at `step`,
        each feature scaled to about [-1, 1]."""
        phi = [0.0] * len(self.weights)
        phi[0] = 1.0
        phi[1] = min(step.l_top1 - logit, 40.0) / 10.0
        phi[self._slots[c.order, c.kind]] = 1.0
        phi[-10:] = [
            c.agree / 4.0,
            math.log1p(c.count) / 3.0,
            math.log(c.distance) / 5.0,
            step.k / 7.0,
            (step.l_top1 - step.lse) / 5.0,
            max(logit - step.lse, -40.0) / 10.0,
            float(in_vocab),
            min(c.distinct, MAX_DISTINCT) / MAX_DISTINCT,
            float(c.from_prompt),
            max(min(step.z, 10.0), -10.0) / 5.0,
        ]
        return phi

    def utility(self, c: Candidate, logit: float, in_vocab: bool, step: StepView) -> float:
        return sum(w * f for w, f in zip(self.weights, self.features(c, logit, in_vocab, step)) if f)

    def lookup(self, index: NgramIndex, suffix: Sequence[int], fresh: int = 0) -> tuple[int, dict[int, Candidate]]:
        """(match class, copied token -> its evidence) after `suffix` (see `NgramIndex.evidence`)."""
        return index.evidence(suffix, self.orders, fresh)

    def rescore(self, cands: dict[int, Candidate], logits: dict[int, tuple[float, bool]], step: StepView) -> dict[int, float]:
        """Each candidate other than the top-1 -> l_top1 + u(c). logits: token -> (logit, in the draft vocabulary)."""
        return {t: step.l_top1 + self.utility(c, *logits[t], step) for t, c in cands.items() if t != step.top1}

    def with_confidence(self, confidence: dict[int, tuple[float, float]]) -> "CopyScorer":
        return CopyScorer(self.orders, self.weights, tuple((c, a, b) for c, (a, b) in confidence.items()))

    def to_dict(self) -> dict:
        out: dict = {"scorer": {"orders": list(self.orders), "weights": dict(zip(scorer_features(self.orders), self.weights))}}
        if self.confidence:
            out["confidence"] = {str(c): [a, b] for c, a, b in self.confidence}
        return out

    @staticmethod
    def from_dict(d: dict) -> "CopyScorer":
        orders = tuple(int(o) for o in d["scorer"]["orders"])
        weights = d["scorer"]["weights"]
        names = scorer_features(orders)
        if set(weights) != set(names):
            raise ValueError(f"copy scorer weights {sorted(weights)} do not match its features {list(names)}")
        conf = tuple((int(c), float(a), float(b)) for c, (a, b) in (d.get("confidence") or {}).items())
        return CopyScorer(orders, tuple(float(weights[n]) for n in names), conf)


CopyRule = Union[CopyPrior, CopyScorer]


def copy_rule_from_dict(d: dict | None) -> CopyRule | None:
    """A checkpoint's `copy_prior` entry -> its rule: a scorer when it has one, else bonuses."""
    if not d:
        return None
    return CopyScorer.from_dict(d) if "scorer" in d else CopyPrior.from_dict(d)


def fit_copy_scorer(
    decisions: Sequence[tuple[Sequence[Sequence[float]], int]], orders: Sequence[int], l2: float = 1e-4
) -> tuple[CopyScorer, dict]:
    """Conditional logit over the options of each decision: the top-1 (utility 0) and the
    candidates (features phi, utility w . phi); label 0 = the top-1 was the target's token,
    i >= 1 = candidate i was. Maximum likelihood with an L2 penalty on all weights but the
    bias (L-BFGS). Returns the scorer and a fit record (decisions, share the top-1 was right,
    the fitted rule's decision accuracy on them)."""
    import torch

    names = scorer_features(tuple(sorted(set(orders))))
    if not decisions:
        return CopyScorer(tuple(orders), (0.0,) * len(names)), {"decisions": 0}
    width = max(len(f) for f, _ in decisions)
    x = torch.zeros(len(decisions), width, len(names), dtype=torch.float64)  # [n, m, F]
    valid = torch.zeros(len(decisions), width, dtype=torch.bool)
    for i, (feats, _) in enumerate(decisions):
        x[i, : len(feats)] = torch.tensor(feats, dtype=torch.float64)
        valid[i, : len(feats)] = True
    y = torch.tensor([label for _, label in decisions])
    w = torch.zeros(len(names), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500, line_search_fn="strong_wolfe")

    def option_logits() -> torch.Tensor:  # [n, 1 + m]: the top-1, then the candidates
        u = (x @ w).masked_fill(~valid, float("-inf"))
        return torch.cat([torch.zeros(len(y), 1, dtype=u.dtype), u], dim=1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(option_logits(), y) + l2 * (w[1:] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        accuracy = float((option_logits().argmax(1) == y).double().mean())
    info = {"decisions": len(decisions), "top1_right": float((y == 0).double().mean()), "decision_accuracy": accuracy, "l2": l2}
    return CopyScorer(tuple(orders), tuple(w.detach().tolist())), info
