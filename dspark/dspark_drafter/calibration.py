"""Calibration metrics and Sequential Temperature Scaling (STS).

Inputs are per-block arrays: conf_logits [n, G] (raw confidence logits, position k in column
k-1) and accepted [n, G] (1 where draft position k was accepted given 1..k-1 were; entries
after the first rejection are ignored). Prefix survival a_k = prod_{j<=k} sigmoid(z_j / T_j)
is compared with the event "positions 1..k all accepted".

STS fits one temperature per position, as the method describes. With `offsets` it also fits
an offset per position (c_k = sigmoid(z_k / T_k + b_k): sequential Platt scaling), still
monotone in z_k, so each position's ranking is unchanged. The offset matters when the raw
confidences are shifted, not just too sharp: the confidence head learns the sampling
acceptance 1 - TV on the train split, while greedy verification accepts a token only when it is
the target's argmax, and held-out acceptance is lower than the train split's. A temperature
alone can then only flatten the position towards 0.5, which lowers the ECE by throwing the
ranking away.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def prefix_accepted(accepted: np.ndarray) -> np.ndarray:
    """[n, G] per-position acceptance -> [n, G] 1 while every position so far was accepted."""
    return np.cumprod(accepted.astype(np.float64), axis=1)


def survival(
    conf_logits: np.ndarray, temperatures: np.ndarray | list[float] | None = None, offsets: np.ndarray | list[float] | None = None
) -> np.ndarray:
    """[n, G] logits -> [n, G] prefix survival a_k under per-position temperatures and offsets."""
    t = np.ones(conf_logits.shape[1]) if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    b = np.zeros(conf_logits.shape[1]) if offsets is None else np.asarray(offsets, dtype=np.float64)
    return np.cumprod(sigmoid(conf_logits / t[None, :] + b[None, :]), axis=1)


def ece(prob: np.ndarray, label: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error with equal-width bins (flattened inputs)."""
    prob, label = np.ravel(prob).astype(np.float64), np.ravel(label).astype(np.float64)
    if prob.size == 0:
        return 0.0
    idx = np.minimum((prob * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += sel.sum() * abs(prob[sel].mean() - label[sel].mean())
    return float(total / prob.size)


def roc_auc(score: np.ndarray, label: np.ndarray) -> float:
    """Mann-Whitney ROC-AUC with ties counted half; nan when one class is absent."""
    score, label = np.ravel(score).astype(np.float64), np.ravel(label).astype(bool)
    n_pos, n_neg = int(label.sum()), int((~label).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(len(s))
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i : j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    r = np.empty(len(s))
    r[order] = ranks
    return float((r[label].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def reliability(prob: np.ndarray, label: np.ndarray, bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per bin: mean predicted, observed frequency, count (for reliability diagrams)."""
    prob, label = np.ravel(prob), np.ravel(label).astype(np.float64)
    idx = np.minimum((prob * bins).astype(int), bins - 1)
    pred, freq, count = np.full(bins, np.nan), np.full(bins, np.nan), np.zeros(bins, dtype=int)
    for b in range(bins):
        sel = idx == b
        count[b] = int(sel.sum())
        if count[b]:
            pred[b], freq[b] = prob[sel].mean(), label[sel].mean()
    return pred, freq, count


DEFAULT_GRID = np.exp(np.linspace(np.log(0.05), np.log(20.0), 241))
OFFSET_GRID = np.linspace(-3.0, 3.0, 61)
# with offsets the search is 2-D: a coarser temperature grid keeps it to seconds
OFFSET_T_GRID = np.exp(np.linspace(np.log(0.1), np.log(10.0), 61))


@dataclass
class STSResult:
    temperatures: list[float]
    ece_before: float  # ECE of prefix survival over all positions, T = 1
    ece_after: float
    auc_before: float
    auc_after: float
    offsets: list[float] | None = None  # None: temperatures only (the method's STS)


def sequential_temperature_scaling(
    conf_logits: np.ndarray,
    accepted: np.ndarray,
    grid: np.ndarray | None = None,
    bins: int = 15,
    tol: float = 5e-4,
    offsets: np.ndarray | bool | None = None,
) -> STSResult:
    """For k = 1..G in order, choose T_k on `grid` minimising the ECE of a_k (positions < k
    fixed). Positive temperatures keep each c_k's order, so rankings within a position hold.
    Where the ECE is flat (deep positions: a_k is almost always ~0, few positives) any T fits
    equally well; among candidates within `tol` of the minimum, the one closest to the
    identity (T = 1, b = 0) wins, so sparse evidence does not produce extreme values.
    `offsets` (True for OFFSET_GRID, or a grid) searches (T_k, b_k) jointly."""
    conf_logits = np.asarray(conf_logits, dtype=np.float64)
    labels = prefix_accepted(accepted)
    use_offsets = offsets is not None and offsets is not False
    b_grid = (OFFSET_GRID if offsets is True else np.asarray(offsets, dtype=np.float64)) if use_offsets else np.zeros(1)
    t_grid = np.asarray(grid if grid is not None else OFFSET_T_GRID if use_offsets else DEFAULT_GRID, dtype=np.float64)
    cand_t, cand_b = (a.ravel() for a in np.meshgrid(t_grid, b_grid, indexing="ij"))
    distance = np.abs(np.log(cand_t)) + np.abs(cand_b)
    g = conf_logits.shape[1]
    temps, offs = np.ones(g), np.zeros(g)
    prev = np.ones(conf_logits.shape[0])  # a_{k-1} under the chosen parameters
    for k in range(g):
        errs = np.array([ece(prev * sigmoid(conf_logits[:, k] / t + b), labels[:, k], bins) for t, b in zip(cand_t, cand_b)])
        ok = np.flatnonzero(errs <= errs.min() + tol)
        best = ok[np.argmin(distance[ok])]
        temps[k], offs[k] = cand_t[best], cand_b[best]
        prev = prev * sigmoid(conf_logits[:, k] / temps[k] + offs[k])
    before, after = survival(conf_logits), survival(conf_logits, temps, offs)
    return STSResult(
        temperatures=[float(t) for t in temps],
        ece_before=ece(before, labels, bins),
        ece_after=ece(after, labels, bins),
        auc_before=roc_auc(before, labels),
        auc_after=roc_auc(after, labels),
        offsets=[float(b) for b in offs] if use_offsets else None,
    )
