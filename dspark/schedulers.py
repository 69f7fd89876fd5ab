"""Verify-budget schedulers: how many draft tokens each row sends to the target this round.

Every scheduler returns, per row, a count of nodes; the engine verifies that row's nodes with
the highest prefix survival a = c_1 * ... * c_k (always an ancestor-closed sub-tree).

    ar            no speculation
    fixed:K       K draft tokens per row
    threshold:T   verify while c_k >= T (the static policy; the evaluation plan tries 0.7, 0.9)
    util          the evaluation plan's load rule: x1.5 below 60% utilisation, x0.7 above 80%
    dspark        the hardware-aware prefix scheduler (paper Algorithm 1) over profiled round costs
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dspark.cost_model import RoundCost
from dspark.hardware import UtilizationProbe
from dspark.tree import DraftTree

DEFAULT_MAX_DEPTH = 8


class Scheduler:
    name = "base"
    max_depth = DEFAULT_MAX_DEPTH  # how deep drafters should draft this round
    needs_cost_table = False
    gates_drafting = False  # the engine may skip drafting when it does not pay (dspark/draft_gate.py)

    def budgets(self, trees: Sequence[DraftTree]) -> list[int]:
        raise NotImplementedError


class NoSpeculation(Scheduler):
    name = "ar"
    max_depth = 0

    def budgets(self, trees: Sequence[DraftTree]) -> list[int]:
        return [0 for _ in trees]


@dataclass
class FixedLength(Scheduler):
    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"fixed:K needs K >= 1, got {self.k}")
        self.name = f"fixed:{self.k}"
        self.max_depth = self.k

    def budgets(self, trees: Sequence[DraftTree]) -> list[int]:
        return [min(self.k, len(t)) for t in trees]


def threshold_count(tree: DraftTree, threshold: float) -> int:
    """Nodes whose every confidence on the path from the anchor is >= threshold."""
    ok: list[bool] = []
    for c, p in zip(tree.confidence, tree.parents):
        ok.append(c >= threshold and (p < 0 or ok[p]))
    return sum(ok)


@dataclass
class Threshold(Scheduler):
    threshold: float
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold:T needs 0 <= T <= 1, got {self.threshold}")
        self.name = f"threshold:{self.threshold:g}"

    def budgets(self, trees: Sequence[DraftTree]) -> list[int]:
        return [threshold_count(t, self.threshold) for t in trees]


@dataclass
class UtilizationAdaptive(Scheduler):
    """Fixed-length drafting whose length follows device utilisation (the plan's sample policy)."""

    probe: UtilizationProbe | Callable[[], float | None] = field(default_factory=UtilizationProbe)
    start: float = 4.0
    low: float = 0.6
    high: float = 0.8
    grow: float = 1.5
    shrink: float = 0.7
    min_len: float = 1.0
    max_len: float = float(DEFAULT_MAX_DEPTH)

    def __post_init__(self) -> None:
        self.name = "util"
        self.length = self.start
        self.max_depth = int(math.ceil(self.max_len))
        self.history: list[tuple[float | None, float]] = []  # (utilisation, length)

    def _read(self) -> float | None:
        return self.probe.read() if isinstance(self.probe, UtilizationProbe) else self.probe()

    def budgets(self, trees: Sequence[DraftTree]) -> list[int]:
        util = self._read()
        if util is not None:
            if util < self.low:
                self.length = min(self.max_len, self.length * self.grow)
            elif util > self.high:
                self.length = max(self.min_len, self.length * self.shrink)
        self.history.append((util, self.length))
        k = int(round(self.length))
        return [min(k, len(t)) for t in trees]


def packed_tokens(lengths: Sequence[int]) -> int:
    """B for a packed (ragged) batch: one anchor plus l_r draft tokens per row."""
    return sum(1 + l for l in lengths)


def prefix_schedule(
    survival: Sequence[Sequence[float]],
    sps: Callable[[int], float],
    batch_tokens: Callable[[Sequence[int]], int] = packed_tokens,
) -> list[int]:
    """Paper Algorithm 1: per-row verify lengths maximising tau* x SPS(B).

    survival[r][j] = a_{r,j+1}, non-increasing in j. Candidates are admitted in order of
    falling survival (ties: earlier position, then lower row) and the search stops at the
    first one that does not raise expected throughput, so position j's admission depends only
    on survivals >= its own: its own row's positions <= j and other rows. Outputs never depend
    on the schedule (verification walks the target's own tokens); only speed does.
    """
    rows = len(survival)
    lengths = [0] * rows
    tau = float(rows)
    best = tau * sps(batch_tokens(lengths))
    best_lengths = list(lengths)
    candidates = sorted(
        ((a, j, r) for r, row in enumerate(survival) for j, a in enumerate(row) if a > 0),
        key=lambda e: (-e[0], e[1], e[2]),
    )
    for a, j, r in candidates:
        if j != lengths[r]:  # cannot skip a position (only happens with out-of-order ties)
            break
        lengths[r] = j + 1
        tau += a
        theta = tau * sps(batch_tokens(lengths))
        if theta > best:
            best, best_lengths = theta, list(lengths)
        else:
            break
    return best_lengths


def width_schedule(survival: Sequence[Sequence[float]], round_sps: Callable[[int], float]) -> list[int]:
    """Algorithm 1 for a right-padded batch, where cost depends only on the widest row.

    round_sps(w): rounds per second when every row carries w tokens (anchor + w - 1 drafts).
    Widening the block from w to w+1 tokens costs every row a token whoever uses it, and
    every row's (w+1)-th draft token rides along for free; so candidates are admitted a column
    at a time: column w adds sum_r a_{r,w}. Same objective tau* x SPS, same early stop at the
    first column that does not raise it; admission of position j depends only on survivals
    at positions <= j.
    """
    rows = len(survival)
    if rows == 0:
        return []
    tau = float(rows)
    best, best_width = tau * round_sps(1), 0
    depth = max((len(r) for r in survival), default=0)
    for w in range(1, depth + 1):
        tau += sum(row[w - 1] for row in survival if len(row) >= w)
        theta = tau * round_sps(1 + w)
        if theta > best:
            best, best_width = theta, w
        else:
            break
    return [min(best_width, sum(1 for a in row if a > 0)) for row in survival]


def ragged_width_schedule(survival: Sequence[Sequence[float]], latency: Callable[[list[int]], float]) -> list[int]:
    """Algorithm 1 for a forward that packs ragged rows, a column at a time.

    latency(lengths): seconds of a forward where row r carries lengths[r] tokens (anchor +
    drafts). There a draft token costs its share of the projections and MLPs, and widening
    the block costs attention over every row, so neither a token-by-token search (the first
    token of a new column pays the whole widening and stops it) nor a whole column (rows with
    weak drafts pay for tokens nobody wants) fits. Column w admits the k rows (those verified
    up to w - 1) with the highest survival a_{r,w}, k chosen to maximise tau* x SPS; the
    search stops at the first column that does not raise it. As in `width_schedule`, whether
    position j is verified depends only on survivals at positions <= j.
    """
    rows = len(survival)
    if rows == 0:
        return []
    lengths = [0] * rows
    tau = float(rows)
    best = tau / latency([1] * rows)
    depth = max((len(r) for r in survival), default=0)
    for w in range(1, depth + 1):
        ready = sorted((-row[w - 1], r) for r, row in enumerate(survival) if lengths[r] == w - 1 and len(row) >= w and row[w - 1] > 0)
        if not ready:
            break
        trial, gain = list(lengths), tau
        column_best, column_lengths, column_tau = best, None, tau
        for neg_a, r in ready:
            trial[r] = w
            gain -= neg_a
            theta = gain / latency([1 + n for n in trial])
            if theta > column_best:
                column_best, column_lengths, column_tau = theta, list(trial), gain
        if column_lengths is None:
            break
        best, lengths, tau = column_best, column_lengths, column_tau
    return lengths


@dataclass
class DSparkScheduler(Scheduler):
    """Hardware-aware prefix scheduler over the profiled round costs (dspark/cost_model.py).

    `gate=True` lets the engine skip drafting while it does not pay (dspark/draft_gate.py).
    How a block is priced follows the forward the cost table was measured on (`packed=None`):
    a table that prices ragged rows (the lean forward on CPU packs them) gets
    `ragged_width_schedule`, one of a right-padded forward `width_schedule` (a block costs its
    widest row). `packed=True` forces the paper's accounting B = sum_r (1 + l_r) on the table's
    uniform widths (`prefix_schedule`), `packed=False` the padded one. At batch size 1 they all
    agree.
    """

    cost: RoundCost | None = None
    max_depth: int = DEFAULT_MAX_DEPTH
    packed: bool | None = None
    gate: bool = True

    def __post_init__(self) -> None:
        self.name = "dspark"
        self.needs_cost_table = self.cost is None

    @property
    def gates_drafting(self) -> bool:
        # hardware-aware means deciding whether to draft at all, too: a drafter that costs more
        # than its accepted tokens save is skipped (measured, from past rounds only)
        return self.gate

    def budgets(self, trees: Sequence[DraftTree]) -> list[int]:
        if self.cost is None:
            raise RuntimeError("the dspark scheduler needs a cost table (profiled by the engine at start-up)")
        cost, rows = self.cost, len(trees)
        survival = [sorted(t.survival(), reverse=True) for t in trees]
        if self.packed:  # B tokens over R rows: priced as R rows of B / R tokens
            return prefix_schedule(survival, lambda b: 1.0 / cost.round_latency(rows, b / rows), packed_tokens)
        if self.packed is None and getattr(cost, "prices_ragged_rows", False):
            return ragged_width_schedule(survival, cost.ragged_latency)  # type: ignore[attr-defined]
        return width_schedule(survival, lambda w: 1.0 / cost.round_latency(rows, w))


def make_scheduler(spec: str | Scheduler, cost: RoundCost | None = None) -> Scheduler:
    """Build a scheduler from its name: ar, fixed:K, threshold:T, util, dspark."""
    if isinstance(spec, Scheduler):
        return spec
    name, _, arg = spec.strip().partition(":")
    try:
        if name == "ar":
            return NoSpeculation()
        if name == "fixed":
            return FixedLength(int(arg or 4))
        if name == "threshold":
            return Threshold(float(arg or 0.7))
        if name == "util":
            return UtilizationAdaptive()
        if name == "dspark":
            return DSparkScheduler(cost=cost, max_depth=int(arg) if arg else DEFAULT_MAX_DEPTH)
    except ValueError as e:
        raise ValueError(f"bad scheduler {spec!r}: {e}") from e
    raise ValueError(f"unknown scheduler {spec!r}; choose ar, fixed:K, threshold:T, util or dspark")
