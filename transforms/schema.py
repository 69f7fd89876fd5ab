"""The pipeline's output contract: folder names, column names, Arrow schemas, error types.

Tests and docs/pipeline.md refer to these names; change them only together.
"""

from __future__ import annotations

import pyarrow as pa

GENERATIONS_DIR = "generations"
SHARD_METRICS_DIR = "shard_metrics"
DEAD_LETTER_DIR = "dead_letter"
RUN_SUMMARY_FILE = "run_summary.json"
COMPLETE_DIR = "_complete"  # one marker per input file whose outputs are all written (--resume)

GENERATION_COLUMNS = (
    "id",
    "shard",
    "output",
    "num_prompt_tokens",
    "num_output_tokens",
    "finish_reason",
    "latency_s",
    "mean_accepted_length",
)
TRUNCATED_COLUMN = "prompt_truncated"  # added only when prompts may be truncated (--truncate-prompts)

SHARD_METRIC_COLUMNS = (
    "shard",
    "num_records",
    "num_ok",
    "num_failed",
    "num_duplicate_ids",
    "output_tokens",
    "wall_s",
    "tokens_per_s",
    "mean_accepted_length",
    "acceptance_rate",
    "correction_rate",
    "mean_verify_budget",
    "confidence_entropy",
    "acceptance_by_position",
    "p50_latency_s",
    "p99_latency_s",
    "device",
    "dtype",
    "gpu_util_mean",
    "gpu_mem_peak_bytes",
    "gpu_mem_fragmentation_peak",
    "cpu_util_mean",
    "rss_peak_bytes",
)

DEAD_LETTER_COLUMNS = ("id", "shard", "error_type", "error")


class ErrorType:
    """Values of `dead_letter.error_type`. Row-level ones have the row's id; file-level ones
    (prefix `file_`) have a null id and name the file in `shard`."""

    NULL_ID = "null_id"
    NULL_TEXT = "null_text"
    NON_STRING_TEXT = "non_string_text"
    EMPTY_TEXT = "empty_text"
    INVALID_UTF8 = "invalid_utf8"
    CONTROL_CHARACTERS = "control_characters"
    TEMPLATE_ERROR = "template_error"
    PROMPT_TOO_LONG = "prompt_too_long"
    PROMPT_ERROR = "prompt_error"  # any other refusal by the engine's encoder
    GENERATION_ERROR = "generation_error"  # the engine raised on this row alone
    OUT_OF_MEMORY = "out_of_memory"  # out of accelerator memory alone, even without speculation
    TIME_LIMIT = "time_limit"  # ran past --row-time-limit-s
    FILE_UNREADABLE = "file_unreadable"  # not Parquet, truncated, unreadable footer
    FILE_MISSING_COLUMNS = "file_missing_columns"
    FILE_SCHEMA_MISMATCH = "file_schema_mismatch"
    FILE_ROW_GROUP_UNREADABLE = "file_row_group_unreadable"  # a row group failed to decode mid-job

    ROW_LEVEL = (
        NULL_ID, NULL_TEXT, NON_STRING_TEXT, EMPTY_TEXT, INVALID_UTF8, CONTROL_CHARACTERS,
        TEMPLATE_ERROR, PROMPT_TOO_LONG, PROMPT_ERROR, GENERATION_ERROR, OUT_OF_MEMORY, TIME_LIMIT,
    )
    FILE_LEVEL = (FILE_UNREADABLE, FILE_MISSING_COLUMNS, FILE_SCHEMA_MISMATCH, FILE_ROW_GROUP_UNREADABLE)


def generations_schema(id_type: pa.DataType, kept: pa.Schema | None = None, truncation: bool = False) -> pa.Schema:
    """`id` keeps the input's Arrow type; kept input columns follow the contract columns."""
    fields = [
        pa.field("id", id_type),
        pa.field("shard", pa.string()),
        pa.field("output", pa.string()),
        pa.field("num_prompt_tokens", pa.int64()),
        pa.field("num_output_tokens", pa.int64()),
        pa.field("finish_reason", pa.string()),
        pa.field("latency_s", pa.float64()),
        pa.field("mean_accepted_length", pa.float64()),
    ]
    if truncation:
        fields.append(pa.field(TRUNCATED_COLUMN, pa.bool_()))
    if kept is not None:
        fields.extend(kept)
    return pa.schema(fields)


def shard_metrics_schema() -> pa.Schema:
    ints = {"num_records", "num_ok", "num_failed", "num_duplicate_ids", "output_tokens", "gpu_mem_peak_bytes", "rss_peak_bytes"}
    strings = {"shard", "device", "dtype"}
    lists = {"acceptance_by_position"}

    def arrow_type(c: str) -> pa.DataType:
        if c in lists:
            return pa.list_(pa.float64())
        return pa.string() if c in strings else pa.int64() if c in ints else pa.float64()

    return pa.schema([pa.field(c, arrow_type(c)) for c in SHARD_METRIC_COLUMNS])


def dead_letter_schema(id_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [pa.field("id", id_type), pa.field("shard", pa.string()), pa.field("error_type", pa.string()), pa.field("error", pa.string())]
    )
