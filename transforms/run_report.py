"""`OUT/report.md`: the morning check at a glance. The run's closing line and health, a small
per-shard table and two plots (tokens/s and tau per shard; acceptance by draft position), made
from `shard_metrics` and the run summary. Written through Beam's filesystems, so gs:// works.
Plots need matplotlib (the `eval` extra); without it the report holds the tables alone.
"""

from __future__ import annotations

import io
import logging
from typing import Any

from apache_beam.io.filesystems import FileSystems

from transforms.outputs import inside

LOG = logging.getLogger(__name__)
REPORT_FILE = "report.md"
SHARDS_PLOT = "report_shards.png"
POSITIONS_PLOT = "report_acceptance_by_position.png"
REPORT_FILES = (REPORT_FILE, SHARDS_PLOT, POSITIONS_PLOT)
TABLE_ROWS = 20  # shards listed: those breaching a health threshold first, then the slowest


def short_name(shard: str) -> str:
    return shard.rstrip("/").rsplit("/", 1)[-1]


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def shards_to_list(metrics: list[dict], health: dict) -> list[dict]:
    breaching = {b["shard"] for b in health.get("shards", [])}
    ranked = sorted(metrics, key=lambda m: (m["shard"] not in breaching, m["tokens_per_s"] or 0.0, m["shard"]))
    return ranked[:TABLE_ROWS]


def shard_table(metrics: list[dict], health: dict) -> str:
    breaches: dict[str, list[str]] = {}
    for b in health.get("shards", []):
        breaches.setdefault(b["shard"], []).append(b["signal"])
    lines = ["| shard | rows | ok | failed | tokens/s | tau | acceptance | correction | conf. entropy | health |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in shards_to_list(metrics, health):
        lines.append(" | ".join([
            f"| `{short_name(m['shard'])}`", str(m["num_records"]), str(m["num_ok"]), str(m["num_failed"]),
            fmt(m["tokens_per_s"], ".1f"), fmt(m["mean_accepted_length"], ".2f"), fmt(m["acceptance_rate"], ".0%"),
            fmt(m["correction_rate"], ".0%"), fmt(m["confidence_entropy"], ".2f"),
            ", ".join(breaches.get(m["shard"], [])) or "ok",
        ]) + " |")
    return "\n".join(lines)


def plots(metrics: list[dict], totals: dict) -> dict[str, bytes] | None:
    """PNG bytes of the two plots; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    ordered = sorted(metrics, key=lambda m: m["shard"])
    x = list(range(len(ordered)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    left.bar(x, [m["tokens_per_s"] or 0.0 for m in ordered], color="tab:blue")
    left.set_ylabel("output tokens per second", fontsize=8)
    left.set_title("generation speed per shard", fontsize=9)
    right.plot(x, [m["mean_accepted_length"] or 0.0 for m in ordered], "o", color="tab:green")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="plain decoding")
    right.set_ylabel("tau (tokens per target forward)", fontsize=8)
    right.set_title("tau per shard", fontsize=9)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.set_xlabel("shard (in path order)", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    out = {SHARDS_PLOT: _png(fig, plt)}

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m in ordered[:TABLE_ROWS]:
        values = m.get("acceptance_by_position") or []
        if any(v is not None for v in values):
            ax.plot(range(1, len(values) + 1), values, ".-", linewidth=0.8, alpha=0.6, label=short_name(m["shard"]))
    run = totals.get("acceptance_by_position") or []
    if run:
        ax.plot(range(1, len(run) + 1), run, "k-", linewidth=2.4, label="whole run")
    ax.set_xlabel("draft depth k", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("acceptance at depth k, given 1..k-1 accepted", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by draft position", fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    out[POSITIONS_PLOT] = _png(fig, plt)
    return out


def _png(fig, plt) -> bytes:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def render(summary: dict, metrics: list[dict], closing_line: str, with_plots: bool) -> str:
    t, health = summary["totals"], summary["health"]
    if health["ok"]:
        status = "healthy: every signal within its threshold"
    else:
        status = "; ".join([f"run: {b['signal']} {b['value']:.3g} above {b['limit']:g}" for b in health["run"]]
                           + [f"{len({b['shard'] for b in health['shards']})} shard(s) above a threshold"])
    parts = [
        "# DSpark run report",
        closing_line + ".",
        f"**Health**: {status} (thresholds: {', '.join(f'{k} {v:g}' for k, v in health['thresholds'].items())}).",
        f"Run totals: tau {fmt(t['mean_accepted_length'], '.2f')}, acceptance {fmt(t['acceptance_rate'], '.0%')}, "
        f"correction {fmt(t['correction_rate'], '.0%')}, confidence entropy {fmt(t['confidence_entropy'], '.2f')} bits, "
        f"dtype {t['dtype']}.",
        f"## Shards ({min(len(metrics), TABLE_ROWS)} of {len(metrics)}: those above a threshold first, then the slowest)",
        shard_table(metrics, health),
    ]
    if with_plots:
        parts += [f"![tokens/s and tau per shard]({SHARDS_PLOT})", f"![acceptance by draft position]({POSITIONS_PLOT})"]
    else:
        parts.append("Plots need matplotlib (`pip install \"dspark[eval]\"`).")
    parts.append("Columns and signals: docs/pipeline.md (Outputs, Health signals); every number here comes from "
                 "`shard_metrics/` and `run_summary.json`.")
    return "\n\n".join(parts) + "\n"


def write_run_report(output: str, summary: dict, metrics: list[dict], closing_line: str) -> str:
    """Write report.md (and its plots) into `output`; returns the report's path."""
    images = plots(metrics, summary["totals"]) if metrics else None
    for name, data in (images or {}).items():
        with FileSystems.create(inside(output, name), mime_type="image/png") as f:
            f.write(data)
    path = inside(output, REPORT_FILE)
    with FileSystems.create(path, mime_type="text/markdown") as f:
        f.write(render(summary, metrics, closing_line, images is not None).encode("utf-8"))
    return path
