"""Calibration metrics and Sequential Temperature Scaling (STS).

Inputs are per-block arrays: conf_logits [n, G] (raw confidence logits, position k in column
k-1) and accepted [n, G] (1 where draft position k was accepted given 1..k-1 were; entries
after the first rejection are ignored). Prefix survival a_k = prod_{j<=k} sigmoid(z_j / T_j)
is compared with the event "positions 1..k all accepted".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def prefix_accepted(accepted: np.ndarray) -> np.ndarray:
    """[n, G] per-position acceptance -> [n, G] 1 while every position so far was accepted."""
    return np.cumprod(accepted.astype(np.float64), axis=1)


def survival(conf_logits: np.ndarray, temperatures: np.ndarray | list[float] | None = None) -> np.ndarray:
    """[n, G] logits -> [n, G] prefix survival a_k under per-position temperatures."""
    t = np.ones(conf_logits.shape[1]) if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    return np.cumprod(sigmoid(conf_logits / t[None, :]), axis=1)


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


@dataclass
class STSResult:
    temperatures: list[float]
    ece_before: float  # ECE of prefix survival over all positions, T = 1
    ece_after: float
    auc_before: float
    auc_after: float


def sequential_temperature_scaling(
    conf_logits: np.ndarray, accepted: np.ndarray, grid: np.ndarray = DEFAULT_GRID, bins: int = 15, tol: float = 5e-4
) -> STSResult:
    """For k = 1..G in order, choose T_k on `grid` minimising the ECE of a_k (positions < k
    fixed). Positive temperatures keep each c_k's order, so rankings within a position hold.
    Where the ECE is flat (deep positions: a_k is almost always ~0, few positives) any T fits
    equally well; among temperatures within `tol` of the minimum, the one closest to 1 wins,
    so sparse evidence does not produce extreme temperatures."""
    conf_logits = np.asarray(conf_logits, dtype=np.float64)
    labels = prefix_accepted(accepted)
    g = conf_logits.shape[1]
    temps = np.ones(g)
    prev = np.ones(conf_logits.shape[0])  # a_{k-1} under the chosen temperatures
    for k in range(g):
        errs = np.array([ece(prev * sigmoid(conf_logits[:, k] / t), labels[:, k], bins) for t in grid])
        ok = np.flatnonzero(errs <= errs.min() + tol)
        best_t = float(grid[ok[np.argmin(np.abs(np.log(grid[ok])))]])
        temps[k] = best_t
        prev = prev * sigmoid(conf_logits[:, k] / best_t)
    before, after = survival(conf_logits), survival(conf_logits, temps)
    return STSResult(
        temperatures=[float(t) for t in temps],
        ece_before=ece(before, labels, bins),
        ece_after=ece(after, labels, bins),
        auc_before=roc_auc(before, labels),
        auc_after=roc_auc(after, labels),
    )
