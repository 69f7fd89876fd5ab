"""Per-shard metrics: one row per input shard, combined from small events keyed by shard.

Events (all keyed by the shard's path):
  ("file", n)            the launcher saw n rows in the shard's Parquet footer
  ("read", id)           the reader produced a row (counts records and duplicate ids)
  ("unread", n)          a row group of n rows could not be read (--skip-bad-files): n records,
                         all failed (the dead letter is one file-level entry for the group)
  ("ok", OkEvent)        a row was generated
  ("fail", error_type)   a row went to the dead letter
  ("batch", BatchReport) an engine call's wall time and resource use
Sums are kept, ratios are computed at the end, so the combiner can merge partial results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam

from dspark.metrics import ratio
from transforms.records import BatchReport, GenerationRecord, SpecStats


@dataclass(frozen=True)
class OkEvent:
    num_output_tokens: int
    latency_s: float
    stats: SpecStats


def ok_event(record: GenerationRecord) -> OkEvent:
    return OkEvent(record.num_output_tokens, record.latency_s, record.stats)


def hashable_id(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


@dataclass
class ShardAccumulator:
    expected_rows: int = 0
    records: int = 0
    ids: set = field(default_factory=set)
    ids_seen: int = 0  # non-null ids read
    ok: int = 0
    failed: int = 0
    output_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    wall_s: float = 0.0
    batches: list[BatchReport] = field(default_factory=list)

    def add(self, kind: str, value: Any) -> None:
        if kind == "file":
            self.expected_rows += int(value)
        elif kind == "read":
            self.records += 1
            if value is not None:
                self.ids_seen += 1
                self.ids.add(hashable_id(value))
        elif kind == "unread":
            self.records += int(value)
            self.failed += int(value)
        elif kind == "ok":
            self.ok += 1
            self.output_tokens += value.num_output_tokens
            self.latencies.append(value.latency_s)
            self.stats.add(value.stats)
        elif kind == "fail":
            self.failed += 1
        elif kind == "batch":
            self.wall_s += value.wall_s
            self.batches.append(value)
        else:
            raise ValueError(f"unknown shard event {kind!r}")

    def merge(self, other: "ShardAccumulator") -> None:
        self.expected_rows += other.expected_rows
        self.records += other.records
        self.ids |= other.ids
        self.ids_seen += other.ids_seen
        self.ok += other.ok
        self.failed += other.failed
        self.output_tokens += other.output_tokens
        self.latencies.extend(other.latencies)
        self.stats.add(other.stats)
        self.wall_s += other.wall_s
        self.batches.extend(other.batches)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_weighted_mean(batches: list[BatchReport], attr: str) -> float | None:
    pairs = [(getattr(b, attr), b.wall_s) for b in batches if getattr(b, attr) is not None]
    if not pairs:
        return None
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else sum(v for v, _ in pairs) / len(pairs)


def peak(batches: list[BatchReport], attr: str) -> Any:
    """The largest reading over the engine calls (None when no call has one)."""
    return max((getattr(b, attr) for b in batches if getattr(b, attr) is not None), default=None)


def shard_metrics_row(shard: str, acc: ShardAccumulator) -> dict:
    """The `shard_metrics` row (column order and names: transforms.schema.SHARD_METRIC_COLUMNS)."""
    s = acc.stats
    devices = sorted({b.device for b in acc.batches if b.device})
    dtypes = sorted({b.dtype for b in acc.batches if b.dtype})
    return {
        "shard": shard,
        "num_records": acc.records,
        "num_ok": acc.ok,
        "num_failed": acc.failed,
        "num_duplicate_ids": acc.ids_seen - len(acc.ids),
        "output_tokens": acc.output_tokens,
        "wall_s": acc.wall_s,
        "tokens_per_s": ratio(acc.output_tokens, acc.wall_s),
        **s.rates(),  # mean_accepted_length, acceptance_rate, correction_rate, mean_verify_budget
        "confidence_entropy": s.confidence_entropy(),
        "acceptance_by_position": s.acceptance_by_position(),
        "p50_latency_s": percentile(acc.latencies, 50),
        "p99_latency_s": percentile(acc.latencies, 99),
        "device": ", ".join(devices) if devices else None,
        "dtype": ", ".join(dtypes) if dtypes else None,
        "gpu_util_mean": time_weighted_mean(acc.batches, "gpu_util_mean"),
        "gpu_mem_peak_bytes": peak(acc.batches, "gpu_mem_peak_bytes"),
        "gpu_mem_fragmentation_peak": peak(acc.batches, "gpu_mem_fragmentation_peak"),
        "cpu_util_mean": time_weighted_mean(acc.batches, "cpu_util_mean"),
        "rss_peak_bytes": peak(acc.batches, "rss_peak_bytes"),
    }


class ShardMetricsFn(beam.CombineFn):
    def create_accumulator(self) -> ShardAccumulator:
        return ShardAccumulator()

    def add_input(self, acc: ShardAccumulator, event: tuple[str, Any]) -> ShardAccumulator:
        acc.add(*event)
        return acc

    def merge_accumulators(self, accumulators) -> ShardAccumulator:
        merged = ShardAccumulator()
        for acc in accumulators:
            merged.merge(acc)
        return merged

    def extract_output(self, acc: ShardAccumulator) -> ShardAccumulator:
        return acc
