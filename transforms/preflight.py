"""File-level checks that run on the launcher before the pipeline is built, so bad input fails
in seconds, with the file named, before any model loads on any worker.

Checks: the glob matches something; every file is readable Parquet (not truncated, not some
other format); it has the id, text and template columns; the needed columns have the same types
in every file. With `skip_bad_files`, bad files become file-level dead-letter entries instead.
"""

from __future__ import annotations

import concurrent.futures
from collections import Counter
import hashlib
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from transforms.schema import ErrorType


class BadInputError(ValueError):
    """Input that cannot be processed at all; the message names the file and the problem."""


@dataclass(frozen=True)
class ShardFile:
    """A readable input shard: where it is and how it splits into row groups."""

    path: str
    num_rows: int
    row_group_rows: tuple[int, ...]
    fingerprint: str = ""  # size, modification time and footer hash: changes when the file is rewritten


@dataclass(frozen=True)
class FileProblem:
    path: str
    error_type: str
    error: str

    def message(self) -> str:
        return f"{self.path}: {self.error}"


@dataclass
class Preflight:
    """What the pipeline may read: good shards, the Arrow types of the needed columns, and the
    files left out (only when skipping bad files)."""

    shards: list[ShardFile]
    column_types: dict[str, pa.DataType]
    skipped: list[FileProblem] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.shards)


def limit_rows(shards: list[ShardFile], per_shard: int | None) -> list[ShardFile]:
    """The first `per_shard` rows of each shard (row groups cut accordingly); None = all."""
    if per_shard is None:
        return shards
    limited = []
    for s in shards:
        left, groups = per_shard, []
        for n in s.row_group_rows:
            groups.append(min(n, left))
            left -= groups[-1]
        limited.append(ShardFile(s.path, sum(groups), tuple(groups), s.fingerprint))
    return limited


def expand_glob(pattern: str) -> list[str]:
    """Sorted paths matching `pattern` on any Beam filesystem (local, gs://, s3://...)."""
    try:
        results = FileSystems.match([pattern])
    except Exception as exc:  # Beam raises BeamIOError for a bad scheme/bucket as well as no match
        raise BadInputError(f"--input {pattern!r}: cannot list files: {exc}") from exc
    paths = sorted({m.path for r in results for m in r.metadata_list})
    if not paths:
        raise BadInputError(f"--input {pattern!r}: no file matches this pattern")
    return paths


def normalise_type(t: pa.DataType) -> pa.DataType:
    """Types that read back as the same Python values compare equal (large_string == string...)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
        return pa.binary()
    return t


def open_binary(path: str):
    """A seekable binary stream on any Beam filesystem; never decompressed by file extension."""
    return FileSystems.open(path, mime_type="application/octet-stream", compression_type=CompressionTypes.UNCOMPRESSED)


def read_footer(path: str) -> tuple[pa.Schema, tuple[int, ...], str]:
    """The Arrow schema, the row-group sizes and a fingerprint from one read of a Parquet
    footer. The fingerprint is the size, the modification time and a hash of the footer (which
    holds every column chunk's offsets, sizes and statistics): a rewritten file gets another
    one, also with the same row count."""
    with open_binary(path) as f:
        meta = pq.ParquetFile(f).metadata
        f.seek(0, 2)
        size = f.tell()
        f.seek(size - 8)
        footer_len = int.from_bytes(f.read(4), "little")
        f.seek(size - 8 - footer_len)
        digest = hashlib.sha256(f.read(footer_len)).hexdigest()[:16]
    row_groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return meta.schema.to_arrow_schema(), row_groups, f"{size}:{FileSystems.last_updated(path):.0f}:{digest}"


def inspect_file(path: str, required: list[str]) -> tuple[ShardFile, dict[str, pa.DataType]] | FileProblem:
    """Open one file's footer and check its columns; a problem is returned, not raised."""
    try:
        schema, row_groups, fingerprint = read_footer(path)
    except Exception as exc:  # pyarrow says "magic bytes not found" for truncated and non-Parquet files alike
        return FileProblem(path, ErrorType.FILE_UNREADABLE, f"not a readable Parquet file ({type(exc).__name__}: {exc})")
    missing = [c for c in required if c not in schema.names]
    if missing:
        return FileProblem(
            path,
            ErrorType.FILE_MISSING_COLUMNS,
            f"missing column(s) {', '.join(map(repr, missing))}; columns found: {', '.join(schema.names) or '(none)'}",
        )
    types = {c: normalise_type(schema.field(c).type) for c in required}
    return ShardFile(path, sum(row_groups), row_groups, fingerprint), types


def is_text_type(t: pa.DataType) -> bool:
    """Types a text column may have (strings, or bytes holding UTF-8), after `normalise_type`."""
    return pa.types.is_string(t) or pa.types.is_binary(t)


def _schema_problems(inspected: list[tuple[ShardFile, dict[str, pa.DataType]]], text_column: str | None) -> list[FileProblem]:
    """Files whose needed columns' types differ from the expected ones. Expected: for each
    column, the type most files give it (ties: the first file by path), counting only files
    whose text column holds text when there are any; so one odd file never decides what the
    good ones are. (A text column of another type in every file reaches the rows, which then
    go to dead_letter one by one.)"""
    if not inspected:
        return []
    textual = [(s, t) for s, t in inspected if text_column is None or is_text_type(t[text_column])]
    voters = textual or inspected
    expected = {c: Counter(types[c] for _, types in voters).most_common(1)[0][0] for c in inspected[0][1]}
    problems = []
    for shard, types in inspected:
        diffs = [f"{c}: {types[c]} (but {expected[c]} in most files)" for c in expected if types[c] != expected[c]]
        if diffs:
            problems.append(FileProblem(shard.path, ErrorType.FILE_SCHEMA_MISMATCH, "schema disagrees with other shards: " + "; ".join(diffs)))
    return problems


def check_inputs(
    pattern: str, required: list[str], skip_bad_files: bool = False, max_workers: int = 16, text_column: str | None = None
) -> Preflight:
    """Expand the glob and check every file. Raises BadInputError naming the first bad file (in
    path order) unless `skip_bad_files`, in which case bad files are listed in `skipped`."""
    paths = expand_glob(pattern)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(max_workers, len(paths))) as pool:
        results = list(pool.map(lambda p: inspect_file(p, required), paths))
    problems = [r for r in results if isinstance(r, FileProblem)]
    good = [r for r in results if not isinstance(r, FileProblem)]
    mismatched = _schema_problems(good, text_column)
    bad_paths = {p.path for p in mismatched}
    good = [g for g in good if g[0].path not in bad_paths]
    problems = sorted(problems + mismatched, key=lambda p: p.path)
    if problems and not skip_bad_files:
        more = f" (and {len(problems) - 1} more bad file(s); --skip-bad-files records them in dead_letter instead)" if len(problems) > 1 else " (--skip-bad-files records bad files in dead_letter instead)"
        raise BadInputError(problems[0].message() + more)
    if not good:
        raise BadInputError(f"--input {pattern!r}: none of the {len(paths)} matching file(s) is usable: " + "; ".join(p.message() for p in problems))
    return Preflight(shards=[g[0] for g in good], column_types=dict(good[0][1]), skipped=problems)
