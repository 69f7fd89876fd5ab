"""The evaluation plan's health signals, checked per shard and for the run.

    correction rate      rejected / verified draft tokens          plan: below 15%
    confidence entropy   mean binary entropy (bits) of the verified confidences: near 1 bit the
                         drafter's confidences cannot tell good drafts from bad (bad calibration)
    GPU fragmentation    (reserved - allocated) / reserved at the allocator's peak: plan below 5%

The entropy bound, 0.8 bits: the shipped DSpark drafter measures 0.56 bits on held-out long
reports and 0.64 on dialogue turns (reports/evaluation), and confidences that carry no
information give 1 bit; 0.8 leaves room for a harder night's text and flags a drafter drifting
towards uninformative confidences. A signal that a shard does not have (no drafts verified, no
GPU) is not checked. `run_summary.json` gets the result as its `health` block; the job warns on a
breach, or with `--fail-on-health` exits with status 3.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# signal -> (the metric's name in shard_metrics and run totals, the threshold's field)
SIGNALS = {
    "correction_rate": "max_correction_rate",
    "confidence_entropy": "max_confidence_entropy",
    "gpu_mem_fragmentation_peak": "max_gpu_mem_fragmentation",
}


@dataclass(frozen=True)
class HealthThresholds:
    max_correction_rate: float = 0.15
    max_confidence_entropy: float = 0.8
    max_gpu_mem_fragmentation: float = 0.05


def breaches(values: dict, thresholds: HealthThresholds) -> list[dict]:
    """The signals in `values` (a shard_metrics row or the run totals) above their thresholds."""
    out = []
    for signal, limit_name in SIGNALS.items():
        value, limit = values.get(signal), getattr(thresholds, limit_name)
        if value is not None and value > limit:
            out.append({"signal": signal, "value": value, "limit": limit})
    return out


def check_health(shard_metrics: list[dict], totals: dict, thresholds: HealthThresholds) -> dict:
    """The `health` block: thresholds, the run's breaches, and each breaching shard's."""
    shards = [{"shard": m["shard"], **b} for m in sorted(shard_metrics, key=lambda m: m["shard"]) for b in breaches(m, thresholds)]
    run = breaches(totals, thresholds)
    return {"ok": not run and not shards, "thresholds": asdict(thresholds), "run": run, "shards": shards}


def health_line(health: dict) -> str | None:
    """One log line naming what breached (None when healthy)."""
    if health["ok"]:
        return None
    parts = [f"{b['signal']} {b['value']:.3g} above {b['limit']:g}" for b in health["run"]]
    by_signal: dict[str, int] = {}
    for b in health["shards"]:
        by_signal[b["signal"]] = by_signal.get(b["signal"], 0) + 1
    parts += [f"{signal} on {n} shard(s)" for signal, n in by_signal.items()]
    return "Health: " + "; ".join(parts) + " (thresholds in run_summary.json's health block)"
