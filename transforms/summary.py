"""`run_summary.json`: written by the launcher once the job has finished, from the job's own
outputs (read back through Beam's filesystems, so gs:// works) and its metric counters."""

from __future__ import annotations

import json
import platform
from collections import Counter
from collections.abc import Collection
from dataclasses import fields
from importlib import metadata
from typing import Any

import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from dspark.metrics import ratio
from transforms import schema as S
from transforms.health import HealthThresholds, check_health
from transforms.outputs import Marker, literal, read_markers, write_text_atomically
from transforms.preflight import open_binary
from transforms.records import SpecStats

VERSIONED_PACKAGES = ("dspark", "apache-beam", "torch", "transformers", "pyarrow", "numpy")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def read_output_table(output: str, folder: str) -> list[dict]:
    """All rows of one output folder (`DIR/folder/*.parquet`), as dicts."""
    pattern = literal("/".join([output.rstrip("/"), folder])) + "/*.parquet"
    rows: list[dict] = []
    for match in FileSystems.match([pattern]):
        for meta in sorted(match.metadata_list, key=lambda m: m.path):
            with open_binary(meta.path) as f:
                rows.extend(pq.read_table(f).to_pylist())
    return rows


def spec_totals(markers: list[Marker]) -> SpecStats:
    """Speculation counters summed over every complete shard in DIR (this run's and, after
    --resume, earlier runs'), so the job-wide ratios cover every generated row."""
    names = {f.name for f in fields(SpecStats)}
    totals = SpecStats()
    for m in markers:
        totals.add(SpecStats(**{k: v for k, v in m.spec.items() if k in names}))
    return totals


def beam_counters(result: Any) -> dict[str, int]:
    """Committed counters (attempted where the runner has no committed values)."""
    counters: dict[str, int] = {}
    try:
        for c in result.metrics().query()["counters"]:
            value = c.committed if c.committed is not None else c.attempted
            counters[f"{c.key.metric.namespace}.{c.key.metric.name}"] = counters.get(
                f"{c.key.metric.namespace}.{c.key.metric.name}", 0
            ) + int(value or 0)
    except Exception:  # some runners cannot query metrics; the summary still gets written
        pass
    return dict(sorted(counters.items()))


def build_summary(output: str, job_wall_s: float, config: dict, counters: dict[str, int], skipped_files: list[dict],
                  processed: Collection[str] | None = None, thresholds: HealthThresholds | None = None) -> dict:
    """Totals over every complete shard in DIR; speeds over the shards this run `processed`
    (all of them when None), so a `--resume` that finds nothing to do reports no speed."""
    metrics = read_output_table(output, S.SHARD_METRICS_DIR)
    dead = read_output_table(output, S.DEAD_LETTER_DIR)
    output_tokens = sum(m["output_tokens"] for m in metrics)
    this_run = [m for m in metrics if processed is None or m["shard"] in processed]
    run_tokens = sum(m["output_tokens"] for m in this_run)
    engine_wall = sum(m["wall_s"] for m in this_run)
    load_s = counters.get("dspark.model_load_ms", 0) / 1000
    spec = spec_totals(read_markers(output))
    totals = {
        "num_shards": len(metrics),
        "num_records": sum(m["num_records"] for m in metrics),
        "num_ok": sum(m["num_ok"] for m in metrics),
        "num_failed": sum(m["num_failed"] for m in metrics),
        "num_duplicate_ids": sum(m["num_duplicate_ids"] for m in metrics),
        "num_files_skipped": len(skipped_files),
        "output_tokens": output_tokens,
        # this run: its wall time, the part loading and warming up the model (summed over worker
        # processes), the part inside engine calls, and tokens/s over each
        "run_output_tokens": run_tokens,
        "job_wall_s": job_wall_s,
        "model_load_s": load_s,
        "engine_wall_s": engine_wall,
        "tokens_per_s": ratio(run_tokens, job_wall_s) if this_run else None,
        "engine_tokens_per_s": ratio(run_tokens, engine_wall) if this_run else None,
        # mean_accepted_length, acceptance_rate, correction_rate, mean_verify_budget
        **spec.rates(),
        # the evaluation plan's health signals over every complete shard (health: the checks)
        "confidence_entropy": spec.confidence_entropy(),
        "acceptance_by_position": spec.acceptance_by_position(),
        "gpu_mem_fragmentation_peak": max((m["gpu_mem_fragmentation_peak"] for m in metrics
                                           if m.get("gpu_mem_fragmentation_peak") is not None), default=None),
        # what `--dtype auto` became on the workers (None when no shard file records a dtype)
        "dtype": ", ".join(sorted({m["dtype"] for m in metrics if m.get("dtype")})) or None,
        "dead_letter_by_error_type": dict(sorted(Counter(d["error_type"] for d in dead).items())),
    }
    return {
        "totals": totals,
        "health": check_health(metrics, totals, thresholds or HealthThresholds()),
        "skipped_files": skipped_files,
        "config": config,
        "versions": package_versions(),
        "beam_counters": counters,
    }


def write_summary(output: str, summary: dict) -> str:
    """Written last, under a temporary name renamed into place: a folder whose run did not
    finish has no run_summary.json (the run deletes the old one before anything else)."""
    path = "/".join([output.rstrip("/"), S.RUN_SUMMARY_FILE])
    write_text_atomically(path, json.dumps(summary, indent=2, sort_keys=False, default=str))
    return path
