"""The job graph: checked shards in, generations, per-shard metrics and dead letters out.

    units -> read row groups -> validate/render prompts -> batch (per shard, or across shards)
          -> generate (engine) -> generations
    every row's fate, the footers' row counts and the engine calls' timings -> shard metrics
    file-level problems + bad rows + rows the engine failed on -> dead letters
    all three, grouped by input file -> that file's output files, then its completion marker

By default rows are batched per shard (GroupIntoBatches keyed by shard), so each engine call's
wall time belongs to one shard and `shard_metrics.tokens_per_s` is that shard's own throughput.
`batch_scope="global"` (BatchElements) fills engine calls across shards instead, which keeps
continuous batching full when shards are small; call times are then apportioned to shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import apache_beam as beam
import pyarrow as pa

from transforms import schema as S
from transforms.generation import BATCH_REPORT_TAG, DEAD_LETTER_TAG, DecodeSpec, EngineSpec, GenerateBatchDoFn, build_generator
from transforms.metrics import ShardMetricsFn, ok_event, shard_metrics_row
from transforms.outputs import SPEC_COUNTS, ProgressHook, WriteShardOutputsDoFn, normalised, shard_identity, skipped_identity
from transforms.preflight import Preflight
from transforms.prompts import PromptSpec, to_prompt
from transforms.read import UNREAD_TAG, ReadRowGroupDoFn, row_group_units
from transforms.records import DeadLetter, PromptRow


@dataclass(frozen=True)
class JobSpec:
    output: str
    prompt: PromptSpec
    engine: EngineSpec
    decode: DecodeSpec
    rows_per_call: int = 128
    skip_bad_files: bool = False
    batch_scope: str = "shard"  # "shard": one shard per engine call; "global": calls mix shards


class ValidateRowsDoFn(beam.DoFn):
    def __init__(self, spec: PromptSpec):
        self.spec = spec
        self.bad_rows = beam.metrics.Metrics.counter("dspark", "rows_rejected_before_generation")

    def process(self, row):
        result = to_prompt(row, self.spec)
        if isinstance(result, DeadLetter):
            self.bad_rows.inc()
            yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, result)
        else:
            yield result


def key_by_shard(row: PromptRow) -> tuple[str, PromptRow]:
    return row.shard, row


def job_settings(job: JobSpec) -> dict:
    """The settings that decide what a shard's outputs hold (flat "section.key" names); --resume
    refuses to add to outputs written under other ones. Batching only changes speed: left out."""
    engine = {k: v for k, v in asdict(job.engine).items() if k != "batch_size"}
    decode = {k: v for k, v in asdict(job.decode).items() if k != "progress"}
    sections = {"prompt": asdict(job.prompt), "engine": engine, "decode": decode}
    flat = {f"{name}.{k}": v for name, values in sections.items() for k, v in values.items()}
    return normalised(flat | {"skip_bad_files": job.skip_bad_files})


def unit_identities(pre: Preflight) -> dict[str, dict]:
    """Every input file the job accounts for (shards and skipped files) -> its identity."""
    units = {s.path: shard_identity(s.num_rows, s.row_group_rows, s.fingerprint) for s in pre.shards}
    units.update({f.path: skipped_identity(f.error_type) for f in pre.skipped})
    return units


def commit_parts(pre: Preflight, rows_per_part: int) -> list[Preflight]:
    """The input as parts of whole shards in path order, each of at least `rows_per_part` rows
    (the last may hold fewer); files skipped as bad go with the first part. A local runner
    runs the parts in turn, and a part's outputs are committed when it ends, so a crash loses
    at most the part in progress and `--resume` redoes only that part's shards."""
    parts: list[Preflight] = []
    current: list = []
    for shard in sorted(pre.shards, key=lambda s: s.path):
        current.append(shard)
        if sum(s.num_rows for s in current) >= rows_per_part:
            parts.append(Preflight(current, pre.column_types))
            current = []
    if current or not parts:
        parts.append(Preflight(current, pre.column_types))
    parts[0].skipped = list(pre.skipped)
    return parts


def keyed(folder: str) -> Callable[[dict], tuple[str, tuple[str, dict]]]:
    """row -> (its input file, (folder, row)): what the per-file writer groups on."""
    return lambda row: (row["shard"], (folder, row))


def id_arrow_type(pre: Preflight, spec: PromptSpec) -> pa.DataType:
    return pre.column_types.get(spec.id_column, pa.string())


def kept_schema(pre: Preflight, spec: PromptSpec) -> pa.Schema:
    return pa.schema([pa.field(c, pre.column_types[c]) for c in spec.keep_columns])


BATCH_SCOPES = ("shard", "global")


class BatchPerShard(beam.PTransform):
    """Lists of up to n rows of one shard: each engine call's time belongs to one shard."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def expand(self, rows):
        return (
            rows
            | "KeyByShard" >> beam.Map(key_by_shard).with_output_types(tuple[str, Any])  # str key: deterministic coder
            | "GroupIntoBatches" >> beam.GroupIntoBatches(self.n)
            | "DropKey" >> beam.MapTuple(lambda _, batch: list(batch))
        )


def batch_rows(scope: str, n: int) -> beam.PTransform:
    """Rows -> lists of up to n rows for one engine call. `global` fills calls across shards
    (fuller continuous batching when shards are small; shard times are then apportioned)."""
    if scope == "shard":
        return BatchPerShard(n)
    if scope == "global":
        return beam.BatchElements(min_batch_size=n, max_batch_size=n)
    raise ValueError(f"batch scope must be one of {BATCH_SCOPES}, got {scope!r}")


class GenerateFromShards(beam.PTransform):
    """Apply to a pipeline (`p | GenerateFromShards(...)`); returns the written PCollections."""

    def __init__(self, preflight: Preflight, job: JobSpec, generator_factory=build_generator,
                 on_progress: ProgressHook | None = None, share_key: str | None = None):
        super().__init__()
        self.pre = preflight
        self.job = job
        self.generator_factory = generator_factory
        self.on_progress = on_progress
        self.share_key = share_key  # the same key in each part of one run: one model load per process

    def expand(self, pbegin):
        pre, job = self.pre, self.job
        columns = job.prompt.required_columns()

        read = (
            pbegin
            | "RowGroups" >> beam.Create(row_group_units(pre.shards))
            | "SpreadRowGroups" >> beam.Reshuffle()
            | "ReadRowGroups" >> beam.ParDo(
                ReadRowGroupDoFn(columns, job.skip_bad_files, {s.path: s.row_group_rows for s in pre.shards})
            ).with_outputs(DEAD_LETTER_TAG, UNREAD_TAG, main="rows")
        )
        valid = read.rows | "Validate" >> beam.ParDo(ValidateRowsDoFn(job.prompt)).with_outputs(DEAD_LETTER_TAG, main="prompts")
        generated = (
            valid.prompts
            | "Batch" >> batch_rows(job.batch_scope, job.rows_per_call)
            | "Generate" >> beam.ParDo(
                GenerateBatchDoFn(job.engine, job.decode, job.prompt.text_column, job.prompt.template, self.generator_factory,
                                  self.share_key)
            ).with_outputs(DEAD_LETTER_TAG, BATCH_REPORT_TAG, main="records")
        )

        skipped_files = pbegin | "SkippedFiles" >> beam.Create(
            [DeadLetter(None, f.path, f.error_type, f.error) for f in pre.skipped]
        )
        dead = (
            skipped_files,
            read[DEAD_LETTER_TAG],
            valid[DEAD_LETTER_TAG],
            generated[DEAD_LETTER_TAG],
        ) | "AllDeadLetters" >> beam.Flatten()

        id_column = job.prompt.id_column
        events = (
            pbegin | "FooterRows" >> beam.Create([(s.path, ("file", s.num_rows)) for s in pre.shards]),
            read.rows | "ReadEvents" >> beam.Map(lambda r: (r.shard, ("read", r.values.get(id_column)))),
            read[UNREAD_TAG] | "UnreadEvents" >> beam.MapTuple(lambda path, n: (path, ("unread", n))),
            generated.records | "OkEvents" >> beam.Map(lambda r: (r.shard, ("ok", ok_event(r)))),
            (
                (read[DEAD_LETTER_TAG], valid[DEAD_LETTER_TAG], generated[DEAD_LETTER_TAG])
                | "RowDeadLetters" >> beam.Flatten()
                | "RowFailures" >> beam.Filter(lambda d: d.error_type in S.ErrorType.ROW_LEVEL)
                | "FailEvents" >> beam.Map(lambda d: (d.shard, ("fail", d.error_type)))
            ),
            generated[BATCH_REPORT_TAG] | "BatchEvents" >> beam.Map(lambda b: (b.shard, ("batch", b))),
        ) | "AllShardEvents" >> beam.Flatten()
        per_shard = events | "PerShard" >> beam.CombinePerKey(ShardMetricsFn())
        metrics = per_shard | "MetricsRow" >> beam.MapTuple(shard_metrics_row)
        spec_counts = per_shard | "SpecCounts" >> beam.MapTuple(
            lambda shard, acc: (shard, (SPEC_COUNTS, asdict(acc.stats)))
        ).with_output_types(tuple[str, Any])

        truncation = job.decode.truncate_prompts
        gen_rows = generated.records | "GenerationRow" >> beam.Map(lambda r: r.as_row(truncation))
        dead_rows = dead | "DeadLetterRow" >> beam.Map(lambda d: d.as_row())
        id_type = id_arrow_type(pre, job.prompt)
        schemas = {
            S.GENERATIONS_DIR: S.generations_schema(id_type, kept_schema(pre, job.prompt), truncation),
            S.SHARD_METRICS_DIR: S.shard_metrics_schema(),
            S.DEAD_LETTER_DIR: S.dead_letter_schema(id_type),
        }
        return (
            (
                gen_rows | "KeyGenerations" >> beam.Map(keyed(S.GENERATIONS_DIR)).with_output_types(tuple[str, Any]),
                metrics | "KeyShardMetrics" >> beam.Map(keyed(S.SHARD_METRICS_DIR)).with_output_types(tuple[str, Any]),
                dead_rows | "KeyDeadLetters" >> beam.Map(keyed(S.DEAD_LETTER_DIR)).with_output_types(tuple[str, Any]),
                spec_counts,
            )
            | "AllOutputs" >> beam.Flatten()
            | "ByInputFile" >> beam.GroupByKey()
            | "WriteShardOutputs" >> beam.ParDo(
                WriteShardOutputsDoFn(job.output, schemas, unit_identities(pre), job_settings(job), self.on_progress)
            )
        )
