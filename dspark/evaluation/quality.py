"""Text quality and distribution comparisons (pure functions).

ROUGE-L is rouge-score's F1 with Porter stemming (summarisation); BLEU is sacrebleu's corpus
BLEU with its default 13a tokenisation (dialogue). Sampled methods are compared with `hf`
sampling by statistics over several seeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 in [0, 1]. Identical strings score 1 even when they hold no word that
    rouge-score tokenises (e.g. only newlines), where the library would give 0."""
    if prediction == reference:
        return 1.0
    return float(_scorer().score(reference, prediction)["rougeL"].fmeasure)


def corpus_bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU in [0, 100] with one reference per prediction."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


def mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return math.nan, math.nan
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def intervals_overlap(a: tuple[float, float], b: tuple[float, float], k: float = 2.0) -> bool:
    """Do mean +- k*sd intervals of two (mean, sd) pairs intersect?"""
    (ma, sa), (mb, sb) = a, b
    return abs(ma - mb) <= k * (sa + sb)


def permutation_p_value(x: Sequence[float], y: Sequence[float], rounds: int = 2000, seed: int = 0) -> float:
    """Two-sided permutation test of equal means. Two samplers of the same distribution give
    p roughly uniform in [0, 1]; a small p says the distributions differ."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size == 0 or y.size == 0:
        return math.nan
    pooled = np.concatenate([x, y])
    observed = abs(x.mean() - y.mean())
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(rounds):
        perm = rng.permutation(pooled)
        hits += abs(perm[: x.size].mean() - perm[x.size :].mean()) >= observed - 1e-12
    return (hits + 1) / (rounds + 1)  # the observed split counts as one permutation


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of y on x; None with fewer than two distinct x."""
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if x.size < 2 or np.ptp(x) == 0:
        return None
    return float(np.polyfit(x, y, 1)[0])
