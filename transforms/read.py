"""Reading Parquet shards row group by row group, keeping the shard's name with every row.

Why not `ReadFromParquet(with_filename=True)`: it converts whole record batches to Python with
pyarrow, so one string cell with invalid UTF-8 raises for the entire bundle and the job dies.
Here string columns are read as bytes and decoded cell by cell, so such a row becomes a
dead letter. Work units are (file, row group) pairs, so big shards still spread over workers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.metrics import Metrics

from transforms.preflight import ShardFile, open_binary
from transforms.records import DeadLetter, InputRow, InvalidUtf8
from transforms.schema import ErrorType

LOG = logging.getLogger(__name__)
DEAD_LETTER_TAG = "dead_letter"
UNREAD_TAG = "unread_rows"  # (path, rows) of a row group that could not be read


def row_group_units(shards: list[ShardFile]) -> list[tuple[str, int]]:
    """(path, row group index) for every non-empty row group."""
    return [(s.path, i) for s in shards for i, n in enumerate(s.row_group_rows) if n > 0]


def decode_utf8(value: bytes | None) -> str | InvalidUtf8 | None:
    if value is None:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return InvalidUtf8(value)


def column_to_python(column: pa.ChunkedArray) -> list:
    """Python values of a column; string cells are decoded one by one (see module docstring)."""
    t = column.type
    if pa.types.is_dictionary(t):
        column = column.cast(t.value_type)
        t = t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return [decode_utf8(v) for v in column.cast(pa.large_binary()).to_pylist()]
    return column.to_pylist()


def table_to_rows(table: pa.Table, shard: str) -> Iterator[InputRow]:
    columns = {name: column_to_python(table.column(name)) for name in table.column_names}
    for i in range(table.num_rows):
        yield InputRow(shard=shard, values={name: values[i] for name, values in columns.items()})


def read_row_group(path: str, index: int, columns: list[str]) -> pa.Table:
    with open_binary(path) as f:
        return pq.ParquetFile(f).read_row_group(index, columns=columns)


class ReadRowGroupDoFn(beam.DoFn):
    """(path, row group) -> InputRow for each row. A row group that fails to decode (a file
    corrupted after the launcher checked its footer) fails the job, naming the file, or with
    `skip_bad_files` becomes one file-level dead letter that names the row group and its row
    count, and an UNREAD_TAG output (path, rows) so the shard's metrics count those rows as
    records that failed."""

    def __init__(self, columns: list[str], skip_bad_files: bool, row_group_rows: dict[str, tuple[int, ...]]):
        self.columns = list(columns)
        self.skip_bad_files = skip_bad_files
        self.row_group_rows = row_group_rows  # after --limit-per-shard: the rows the job means to read
        self.rows_read = Metrics.counter("dspark", "rows_read")
        self.bad_row_groups = Metrics.counter("dspark", "row_groups_unreadable")
        self.rows_unread = Metrics.counter("dspark", "rows_unread")

    def process(self, unit: tuple[str, int]):
        path, index = unit
        wanted = self.row_group_rows[path][index]
        try:
            table = read_row_group(path, index, self.columns)
        except Exception as exc:
            message = f"row group {index} ({wanted} rows) could not be read: {type(exc).__name__}: {exc}"
            if not self.skip_bad_files:
                raise RuntimeError(f"{path}: {message} (--skip-bad-files records it in dead_letter instead)") from exc
            LOG.error("%s: %s", path, message)
            self.bad_row_groups.inc()
            self.rows_unread.inc(wanted)
            yield beam.pvalue.TaggedOutput(
                DEAD_LETTER_TAG, DeadLetter(None, path, ErrorType.FILE_ROW_GROUP_UNREADABLE, message)
            )
            yield beam.pvalue.TaggedOutput(UNREAD_TAG, (path, wanted))
            return
        if wanted < table.num_rows:  # --limit-per-shard cut this group
            table = table.slice(0, wanted)
        for row in table_to_rows(table, path):
            self.rows_read.inc()
            yield row
