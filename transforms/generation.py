"""Calling the DSpark engine from Beam: one model per worker process, many rows per call.

The generator is built in `setup()` (never pickled into the job graph) and shared by every
thread of the worker process through `apache_beam.utils.shared`, so a process holds one model
copy, also across the parts of a job that a local runner runs in turn; calls into it are
serialised by a lock because the engine keeps per-call state.

Each element is a list of PromptRows (one shard's with --batch-scope shard, any shards' with
global): one engine call generates the whole list with continuous batching (`--batch-size`
rows decode together). The engine's `generate_each` returns a result or an error per row,
after its own fallbacks (out of memory: fewer rows together, then no speculation; any other
error: halving down to single rows; `dspark.fallbacks`). Here a row's error becomes its dead
letter (`out_of_memory` or `generation_error`) and each retry a Beam counter.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.utils import shared

from dspark.fallbacks import Attempt, is_out_of_memory
from dspark.metrics import entropy_bits
from transforms.prompts import clip, render, text_fields
from transforms.records import BatchReport, DeadLetter, GenerationRecord, PromptRow, SpecStats
from transforms.schema import ErrorType

LOG = logging.getLogger(__name__)
DEAD_LETTER_TAG = "dead_letter"
BATCH_REPORT_TAG = "batch_report"

SPEC_FIELDS = ("drafted", "verified", "accepted", "rounds", "prefills", "emitted")

# One loaded engine per worker process, whatever the number of DoFn copies (Beam keeps the
# most recently acquired object alive between pipelines run in turn in one process).
_PROCESS_ENGINES = shared.Shared()


@dataclass(frozen=True)
class EngineSpec:
    """Which engine to build on each worker (strings only: cheap to pickle, easy to log)."""

    target: str = "smollm2-135m-instruct"
    drafter: str = "auto"  # the job always passes its --drafter; "auto" is the default everywhere
    scheduler: str = "dspark"
    dtype: str = "auto"
    device: str = "auto"
    batch_size: int = 16
    trust_remote_code: bool = False

    def key(self) -> str:
        return repr(self)


@dataclass(frozen=True)
class DecodeSpec:
    """How to generate: passed to every `generate` call."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    chat: bool = True
    parse_special_tokens: bool = False  # False: row text that spells a control token stays text
    truncate_prompts: bool = False
    progress: bool = False
    row_time_limit_s: float | None = None  # per row, from when it starts decoding; None = no limit


def build_generator(spec: EngineSpec):
    """The real engine. Imported lazily so the launcher never loads torch models."""
    from dspark.generator import DSparkGenerator

    return DSparkGenerator.from_names(
        target=spec.target,
        drafter=spec.drafter,
        scheduler=spec.scheduler,
        device=spec.device,
        dtype=spec.dtype,
        max_batch_size=spec.batch_size,
        trust_remote_code=spec.trust_remote_code,
    )


def row_seed(seed: int, row: PromptRow) -> int:
    """The row's own sampling seed (from the job's seed, its shard and id): a sampled row's
    output then does not depend on its place in an engine call, so halving retries and
    --resume give it the same draws."""
    key = f"{seed}|{row.shard}|{row.id!r}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(key).digest()[:4], "little") & 0x7FFFFFFF


def time_limit_kwargs(limit_s: float | None) -> dict[str, float]:
    """Passed only when set, so a job without a limit also works with a generator (from a
    custom `generator_factory`) whose `generate` takes no `time_limit_s`."""
    return {} if limit_s is None else {"time_limit_s": limit_s}


def time_limit_letter(row: PromptRow, result: Any, limit_s: float | None) -> DeadLetter:
    """A row the engine stopped at the time limit: its partial output is not a generation."""
    limit = f"{limit_s:g} s" if limit_s is not None else "the time limit"
    return DeadLetter(
        row.id, row.shard, ErrorType.TIME_LIMIT,
        f"row time limit {limit} reached after {float(result.latency_s):.3f} s with "
        f"{int(result.num_output_tokens)} token(s) generated (--row-time-limit-s)",
    )


def failure_error_type(exc: BaseException) -> str:
    return ErrorType.OUT_OF_MEMORY if is_out_of_memory(exc) else ErrorType.GENERATION_ERROR


def spec_stats(stats: Any) -> SpecStats:
    """The engine's RequestStats as plain counters (a result without them: one prefill, and
    one token per round and per accepted draft)."""
    rounds = int(getattr(stats, "rounds", 0) or 0)
    accepted = int(getattr(stats, "accepted", 0) or 0)
    prefills = int(getattr(stats, "prefills", 1))
    emitted = getattr(stats, "emitted", None)
    confidences = list(getattr(stats, "confidences", None) or [])
    return SpecStats(
        drafted=int(getattr(stats, "drafted", 0) or 0),
        verified=int(getattr(stats, "verified", 0) or 0),
        accepted=accepted,
        rounds=rounds,
        prefills=prefills,
        emitted=int(emitted) if emitted is not None else prefills + accepted + rounds,
        entropy_bits=entropy_bits(confidences),
        confidences=len(confidences),
        position_attempts=[int(n) for n in getattr(stats, "position_attempts", None) or []],
        position_accepts=[int(n) for n in getattr(stats, "position_accepts", None) or []],
    )


def prompt_error_type(kind: str) -> str:
    return ErrorType.PROMPT_TOO_LONG if kind == "too_long" else ErrorType.PROMPT_ERROR


@dataclass
class Encoded:
    row: PromptRow
    ids: list[int]
    truncated: bool = False


def shorten_to_fit(row: PromptRow, text_column: str, template: str, encode: Callable[[str], list[int]], tokenizer) -> Encoded | None:
    """Cut the end of the text column, token-wise, until the rendered prompt fits (the engine's
    `cut_to_fit`: the rest of the template stays whole). None if even one text token does not fit."""
    from dspark.generator import cut_to_fit

    fields = text_fields(row.template_values, text_column)
    found = cut_to_fit(row.template_values[fields[0]],
                       lambda text: encode(render(template, dict(row.template_values, **{f: text for f in fields}))),
                       None, tokenizer, keep="start")
    return None if found is None else Encoded(row, found, truncated=True)


class GenerateBatchDoFn(beam.DoFn):
    """[PromptRow] -> GenerationRecord; dead letters and BatchReports as tagged outputs."""

    def __init__(
        self,
        engine: EngineSpec,
        decode: DecodeSpec,
        text_column: str,
        template: str,
        generator_factory: Callable[[EngineSpec], Any] = build_generator,
        share_key: str | None = None,
    ):
        self.engine = engine
        self.decode = decode
        self.text_column = text_column
        self.template = template
        self.generator_factory = generator_factory
        # which loaded engine this DoFn may share: every copy of this DoFn in a process, and
        # the parts of one job run in turn in one process (`share_key`), hold one model copy
        self.share_key = share_key or uuid.uuid4().hex
        self.rows_ok = Metrics.counter("dspark", "rows_generated")
        self.rows_failed = Metrics.counter("dspark", "rows_failed_in_generation")
        self.output_tokens = Metrics.counter("dspark", "output_tokens")
        self.engine_calls = Metrics.counter("dspark", "engine_calls")
        self.batch_splits = Metrics.counter("dspark", "batch_splits_after_error")
        self.truncated = Metrics.counter("dspark", "prompts_truncated")
        self.oom_halvings = Metrics.counter("dspark", "oom_batch_halvings")
        self.oom_fallbacks = Metrics.counter("dspark", "rows_retried_without_speculation")
        self.call_seconds = Metrics.distribution("dspark", "engine_call_ms")
        # model load and warm-up (de-quantising, kernel and cost-table profiling), once per worker
        # process: run_summary.json reports it apart from generation
        self.load_ms = Metrics.counter("dspark", "model_load_ms")
        # summed speculation counters: run_summary.json derives the job's ratios from them
        self.spec_counters = {name: Metrics.counter("dspark", f"spec_{name}") for name in SPEC_FIELDS}

    def setup(self) -> None:
        def load() -> _SharedGenerator:
            started = time.perf_counter()
            holder = _SharedGenerator(self.generator_factory(self.engine))
            holder.load_s = time.perf_counter() - started
            LOG.info("Loaded %s in %.1f s on %s in %s", self.engine, holder.load_s, holder.device, holder.dtype)
            return holder

        self._holder = _PROCESS_ENGINES.acquire(load, tag=(self.engine.key(), self.share_key))

    # --- steps -------------------------------------------------------------------------
    def _encode(self, rows: list[PromptRow]) -> tuple[list[Encoded], list[DeadLetter]]:
        gen, encoded, dead = self._holder.generator, [], []

        def encode(prompt: str) -> list[int]:
            return gen.encode(prompt, chat=self.decode.chat, max_new_tokens=self.decode.max_new_tokens,
                              parse_special_tokens=self.decode.parse_special_tokens)

        for row in rows:
            try:
                encoded.append(Encoded(row, encode(row.prompt)))
                continue
            except Exception as exc:
                kind = getattr(exc, "kind", None)
                if kind is None:  # not a PromptError: the tokenizer itself failed on this row
                    dead.append(DeadLetter(row.id, row.shard, ErrorType.PROMPT_ERROR, clip(f"{type(exc).__name__}: {exc}")))
                    continue
                error = exc
            if kind == "too_long" and self.decode.truncate_prompts and text_fields(row.template_values, self.text_column):
                shorter = shorten_to_fit(row, self.text_column, self.template, encode, gen.target.tokenizer)
                if shorter is not None:
                    self.truncated.inc()
                    encoded.append(shorter)
                    continue
            hint = " (--truncate-prompts cuts the text to fit instead)" if kind == "too_long" and not self.decode.truncate_prompts else ""
            dead.append(DeadLetter(row.id, row.shard, prompt_error_type(kind), clip(f"{error}{hint} [{kind}]")))
        return encoded, dead

    def _generate(self, batch: list[Encoded]) -> list[Any]:
        """One result per row, a generation or the error that row fails with on its own: the
        engine's fallbacks (`dspark.fallbacks`) decide; here they are counted and logged."""
        d = self.decode

        def on_retry(kind: str, size: int, attempt: Attempt, exc: BaseException) -> None:
            if kind == "split":
                self.batch_splits.inc()
                LOG.warning("Engine call on %d rows failed (%s: %s); retrying in halves", size, type(exc).__name__, exc)
            elif kind == "halve_batch":
                self.oom_halvings.inc()
                LOG.warning("Out of memory on %d rows; retrying with %d rows decoding together", size, attempt.batch_size)
            else:
                self.oom_fallbacks.inc(size)
                LOG.warning("Out of memory on %d rows at one row at a time; retrying without speculation", size)

        if not batch:
            return []
        self.engine_calls.inc()
        with self._holder.lock:
            return self._holder.generator.generate_each(
                [e.ids for e in batch],
                max_new_tokens=d.max_new_tokens,
                temperature=d.temperature,
                top_k=d.top_k,
                top_p=d.top_p,
                stop=list(d.stop) or None,
                seeds=[row_seed(d.seed, e.row) for e in batch],
                chat=d.chat,
                progress=d.progress,
                on_retry=on_retry,
                **time_limit_kwargs(d.row_time_limit_s),
            )

    def _record(self, item: Encoded, result: Any) -> GenerationRecord:
        stats = spec_stats(result.stats)
        return GenerationRecord(
            id=item.row.id,
            shard=item.row.shard,
            output=result.text,
            num_prompt_tokens=int(result.num_prompt_tokens),
            num_output_tokens=int(result.num_output_tokens),
            finish_reason=str(result.finish_reason),
            latency_s=float(result.latency_s),
            mean_accepted_length=float(stats.rates()["mean_accepted_length"] or 0.0),
            stats=stats,
            kept=dict(item.row.kept),
            prompt_truncated=item.truncated,
        )

    def process(self, rows: list[PromptRow]):
        load_s = self._holder.take_load_s()
        if load_s is not None:  # counted in a bundle: Beam drops metrics updated in setup()
            self.load_ms.inc(round(1000 * load_s))
        rows = list(rows)
        sampler = self._holder.sampler()
        started = time.perf_counter()
        encoded, dead = self._encode(rows)
        results = self._generate(encoded)
        wall_s = time.perf_counter() - started
        usage = {**sampler.stop(), "dtype": self._holder.dtype}
        tokens_by_shard: dict[str, int] = {}
        for item, result in zip(encoded, results):
            if isinstance(result, Exception):
                dead.append(
                    DeadLetter(item.row.id, item.row.shard, failure_error_type(result), clip(f"{type(result).__name__}: {result}"))
                )
                continue
            if getattr(result, "finish_reason", None) == "time_limit":
                dead.append(time_limit_letter(item.row, result, self.decode.row_time_limit_s))
                continue
            record = self._record(item, result)
            tokens_by_shard[record.shard] = tokens_by_shard.get(record.shard, 0) + record.num_output_tokens
            for name, counter in self.spec_counters.items():
                counter.inc(getattr(record.stats, name))
            yield record
        for letter in dead:
            yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, letter)
        tokens = sum(tokens_by_shard.values())
        self.rows_ok.inc(len(rows) - len(dead))
        self.rows_failed.inc(len(dead))
        self.output_tokens.inc(tokens)
        self.call_seconds.update(int(wall_s * 1000))
        shards = sorted({r.shard for r in rows})
        LOG.info(
            "%s: %d rows (%d failed), %d tokens in %.1f s (%.1f tokens/s)",
            shards[0] if len(shards) == 1 else f"{len(shards)} shards", len(rows), len(dead), tokens, wall_s,
            tokens / wall_s if wall_s > 0 else 0.0,
        )
        for report in split_batch_report(rows, tokens_by_shard, wall_s, usage):
            yield beam.pvalue.TaggedOutput(BATCH_REPORT_TAG, report)


def split_batch_report(rows: list[PromptRow], tokens_by_shard: dict[str, int], wall_s: float, usage: dict) -> list[BatchReport]:
    """One BatchReport per shard in the call. A call that mixed shards (--batch-scope global)
    charges its wall time to each shard in proportion to the tokens generated for it (rows,
    when nothing was generated), so shard wall times add up to the call's."""
    rows_by_shard: dict[str, int] = {}
    for r in rows:
        rows_by_shard[r.shard] = rows_by_shard.get(r.shard, 0) + 1
    total_tokens = sum(tokens_by_shard.values())
    reports = []
    for shard, n in sorted(rows_by_shard.items()):
        share = tokens_by_shard.get(shard, 0) / total_tokens if total_tokens else n / len(rows)
        reports.append(BatchReport(shard=shard, num_rows=n, wall_s=wall_s * share, **usage))
    return reports


class _SharedGenerator:
    """What `shared.Shared` holds per process: the generator, its lock, its device."""

    def __init__(self, generator: Any):
        self.generator = generator
        self.lock = threading.Lock()
        target = getattr(generator, "target", None)
        self.device = getattr(target, "device", None)
        self.load_s: float | None = None
        dtype = getattr(target, "dtype", None)  # `auto` resolved: whether a run is bit-exact depends on it
        self.dtype = str(dtype).removeprefix("torch.") if dtype is not None else None

    def take_load_s(self) -> float | None:
        """The load time, to the first caller only: one count per loaded model, however many
        DoFn instances share it."""
        with self.lock:
            load_s, self.load_s = self.load_s, None
        return load_s

    def sampler(self) -> "UsageSampler":
        return UsageSampler(self.device).start()


class UsageSampler:
    """Device and process utilisation during one engine call: `dspark.hardware` when present
    (NVML on GPUs, nulls without one), else RSS and CPU time from psutil."""

    def __init__(self, device: Any = None):
        self.device = device

    def start(self) -> "UsageSampler":
        try:
            from dspark.hardware import UtilizationSampler, reset_cuda_peaks

            reset_cuda_peaks(self.device)  # this call's allocator peaks: its fragmentation
            self._sampler = UtilizationSampler(interval_s=0.5, device=self.device).start()
        except Exception:  # never let monitoring fail a batch
            self._sampler = None
            self._fallback = _psutil_start()
        return self

    def stop(self) -> dict:
        if self._sampler is not None:
            try:
                from dspark.hardware import cuda_memory

                report = self._sampler.stop()
                usage = {k: v for k, v in report.as_dict().items() if k in _USAGE_KEYS}
                return usage | {"gpu_mem_fragmentation_peak": (cuda_memory(self.device) or {}).get("peak_fragmentation")}
            except Exception:
                pass
            return dict.fromkeys(_USAGE_KEYS)
        return _psutil_stop(self._fallback, self.device)


_USAGE_KEYS = ("device", "gpu_util_mean", "gpu_mem_peak_bytes", "gpu_mem_fragmentation_peak", "cpu_util_mean", "rss_peak_bytes")


def _psutil_start() -> tuple[float, float] | None:
    try:
        import psutil

        t = psutil.Process().cpu_times()
        return time.perf_counter(), t.user + t.system
    except Exception:
        return None


def _psutil_stop(started: tuple[float, float] | None, device: Any) -> dict:
    usage = dict.fromkeys(_USAGE_KEYS)
    usage["device"] = str(device) if device is not None else None
    if started is None:
        return usage
    import os

    import psutil

    proc = psutil.Process()
    t = proc.cpu_times()
    wall = max(1e-9, time.perf_counter() - started[0])
    usage["cpu_util_mean"] = (t.user + t.system - started[1]) / wall / max(1, os.cpu_count() or 1)
    usage["rss_peak_bytes"] = int(proc.memory_info().rss)
    return usage
