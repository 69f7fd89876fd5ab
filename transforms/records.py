"""The small records that travel between the pipeline's steps. Plain dataclasses: Beam pickles
them, tests build them by hand."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dspark.metrics import add_counts, speculation_rates


@dataclass(frozen=True)
class InvalidUtf8:
    """A string cell whose bytes are not valid UTF-8 (kept raw so the row can be reported)."""

    raw: bytes

    def lossy(self) -> str:
        return self.raw.decode("utf-8", errors="backslashreplace")


@dataclass
class InputRow:
    """One row as read from a shard: the needed columns only."""

    shard: str
    values: dict[str, Any]


@dataclass
class PromptRow:
    """A valid row, rendered through the template (not yet through the chat template)."""

    shard: str
    id: Any
    prompt: str
    template_values: dict[str, str]  # kept so an over-long prompt can be re-rendered shorter
    kept: dict[str, Any] = field(default_factory=dict)


@dataclass
class DeadLetter:
    id: Any
    shard: str
    error_type: str
    error: str

    def as_row(self) -> dict:
        return {"id": self.id, "shard": self.shard, "error_type": self.error_type, "error": self.error}


@dataclass
class SpecStats:
    """Speculation counters of one request, summed per shard (ratios are computed at the end),
    and the evaluation plan's health signals: the confidences' summed binary entropy and the
    per-depth attempts and acceptances behind conditional acceptance by draft position."""

    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    rounds: int = 0
    prefills: int = 0
    emitted: int = 0
    entropy_bits: float = 0.0  # summed over the verified confidences counted in `confidences`
    confidences: int = 0
    position_attempts: list[int] = field(default_factory=list)  # index k-1: draft depth k
    position_accepts: list[int] = field(default_factory=list)

    def add(self, other: "SpecStats") -> None:
        for name in ("drafted", "verified", "accepted", "rounds", "prefills", "emitted", "entropy_bits", "confidences"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.position_attempts = add_counts(self.position_attempts, other.position_attempts)
        self.position_accepts = add_counts(self.position_accepts, other.position_accepts)

    def rates(self) -> dict:
        """tau, acceptance, correction and verify budget, defined in `dspark.metrics`."""
        return speculation_rates(verified=self.verified, accepted=self.accepted, rounds=self.rounds,
                                 emitted=self.emitted, prefills=self.prefills)

    def confidence_entropy(self) -> float | None:
        """Mean binary entropy (bits) of the verified confidences; None without any."""
        return self.entropy_bits / self.confidences if self.confidences else None

    def acceptance_by_position(self) -> list[float | None]:
        """Conditional acceptance at draft depth 1..K: accepted / attempted, an attempt at depth
        k counted only when depths 1..k-1 were accepted (None where never attempted)."""
        return [a / n if n else None for a, n in zip(self.position_accepts, self.position_attempts)]


@dataclass
class GenerationRecord:
    """A successful row: the contract columns, kept input columns and its speculation counters."""

    id: Any
    shard: str
    output: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str
    latency_s: float
    mean_accepted_length: float
    stats: SpecStats
    kept: dict[str, Any] = field(default_factory=dict)
    prompt_truncated: bool = False

    def as_row(self, with_truncation: bool) -> dict:
        row = {
            "id": self.id,
            "shard": self.shard,
            "output": self.output,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "finish_reason": self.finish_reason,
            "latency_s": self.latency_s,
            "mean_accepted_length": self.mean_accepted_length,
        }
        if with_truncation:
            row["prompt_truncated"] = self.prompt_truncated
        row.update(self.kept)
        return row


@dataclass
class BatchReport:
    """One engine call (with its retries) on rows of one shard: time and resource use."""

    shard: str
    num_rows: int
    wall_s: float
    device: str | None = None
    dtype: str | None = None  # the dtype the target ran in (`auto` resolved)
    gpu_util_mean: float | None = None
    gpu_mem_peak_bytes: int | None = None
    gpu_mem_fragmentation_peak: float | None = None  # (reserved - allocated) / reserved at the allocator's peak
    cpu_util_mean: float | None = None
    rss_peak_bytes: int | None = None
