"""Per-input-shard output files, completion markers and `--resume`.

Each input file (a shard, or a bad file skipped with --skip-bad-files) gets its own output
files, named after it by `output_name`:

    DIR/generations/NAME.parquet      its generated rows (absent when it has none)
    DIR/dead_letter/NAME.parquet      its dead letters (absent when it has none)
    DIR/shard_metrics/NAME.parquet    its metrics row (shards only)
    DIR/_complete/NAME.json           the completion marker, written last

One worker writes all of a shard's files (the shard's outputs are grouped by shard), each to a
temporary name in its folder and renamed into place once closed; the marker follows only when
every file is in place. So a shard with a marker is complete, and a shard without one, after a
crash, is partial: `--resume` keeps the complete shards, deletes every other output file and
processes the rest again. Without `--resume` a job deletes all previous outputs first.

Output names never come from the data as paths: NAME is the shard's base name reduced to
[A-Za-z0-9._-] plus a hash of its full path, and `inside` refuses any path part that could
leave DIR, so a shard called `../../x.parquet` still writes under DIR.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.localfilesystem import LocalFileSystem
from apache_beam.metrics import Metrics

from transforms import schema as S

LOG = logging.getLogger(__name__)

DATA_FOLDERS = (S.GENERATIONS_DIR, S.DEAD_LETTER_DIR, S.SHARD_METRICS_DIR)
PARQUET = ".parquet"
MARKER = ".json"
TMP_TAG = ".tmp-"  # temporary files: NAME.parquet.tmp-UUID, never matched by *.parquet
SPEC_COUNTS = "spec_counts"  # not a folder: the shard's summed speculation counters, kept in its marker
WRITE_CHUNK_ROWS = 1000  # rows converted to Arrow at a time: bounded memory for big shards

# Called as hook(shard, stage) after a shard's data files are in place ("files_written") and
# after its marker ("complete"); tests inject crashes here.
ProgressHook = Callable[[str, str], None]


class ResumeError(ValueError):
    """`--resume` into an output folder that another configuration wrote."""


class OutputError(OSError):
    """The output location cannot be written."""


# --- names and paths ---------------------------------------------------------------------
def output_name(shard: str) -> str:
    """A file stem for one input file's outputs: its base name made safe (no separators, no
    leading dots) plus 16 hex digits of its full path's hash, so equal base names in different
    folders never collide."""
    base = re.split(r"[/\\]", shard.rstrip("/\\"))[-1]
    if base.lower().endswith(PARQUET):
        base = base[: -len(PARQUET)]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("._-")[:80] or "shard"
    digest = hashlib.sha256(shard.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{safe}-{digest}"


def inside(output: str, *parts: str) -> str:
    """`DIR/part/...`, refusing any part that could name a place outside DIR."""
    for part in parts:
        if not part or part in (".", "..") or any(c in part for c in "/\\\x00"):
            raise ValueError(f"refusing output path part {part!r}: it could leave the output folder {output!r}")
    return "/".join([output.rstrip("/"), *parts])


def data_file(output: str, folder: str, name: str) -> str:
    return inside(output, folder, name + PARQUET)


def marker_file(output: str, name: str) -> str:
    return inside(output, S.COMPLETE_DIR, name + MARKER)


# --- what a marker says ------------------------------------------------------------------
def shard_identity(num_rows: int, row_group_rows: Iterable[int], fingerprint: str = "") -> dict:
    """What must not have changed in an input shard for its old outputs to stand."""
    return {"kind": "shard", "num_rows": int(num_rows), "row_group_rows": [int(n) for n in row_group_rows],
            "fingerprint": fingerprint}


def skipped_identity(error_type: str) -> dict:
    return {"kind": "skipped_file", "error_type": error_type}


def normalised(value: Any) -> Any:
    """JSON round trip: tuples become lists, so settings compare equal to what a marker holds."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


@dataclass(frozen=True)
class Marker:
    shard: str
    identity: dict
    settings: dict
    rows: dict[str, int]  # folder -> rows written (folders without a file are absent)
    # summed speculation counters and health signals (`SpecStats` fields): the run summary's
    # job-wide ratios are computed from these, so they cover resumed shards too
    spec: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        fields = {"shard": self.shard, "identity": self.identity, "settings": self.settings, "rows": self.rows, "spec": self.spec}
        return json.dumps(fields, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Marker":
        d = json.loads(text)
        return cls(d["shard"], d["identity"], d["settings"], {k: int(v) for k, v in d["rows"].items()}, dict(d.get("spec", {})))

    def files(self, output: str) -> list[str]:
        name = output_name(self.shard)
        return [data_file(output, folder, name) for folder in self.rows] + [marker_file(output, name)]


@dataclass
class ResumePlan:
    """Which input files are already complete in DIR (their outputs stay) and which to process."""

    complete: list[str] = field(default_factory=list)
    todo: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # in todo: complete once, but the input file changed since
    kept_other: list[str] = field(default_factory=list)  # complete shards not in this job's input


def settings_diff(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def plan_resume(markers: list[Marker], units: dict[str, dict], settings: dict) -> ResumePlan:
    """Pure: a unit (input file -> identity) is complete when a marker names it with the same
    identity. A marker written under other settings is an error, never silently mixed in."""
    settings = normalised(settings)
    for m in markers:
        diff = settings_diff(m.settings, settings)
        if diff:
            raise ResumeError(
                f"--resume: the outputs of {m.shard} were written with other settings ({'; '.join(diff)}); "
                "run without --resume to replace all outputs, or with the earlier settings"
            )
    by_shard = {m.shard: m for m in markers}
    plan = ResumePlan()
    for shard, identity in sorted(units.items()):
        m = by_shard.get(shard)
        (plan.complete if m is not None and m.identity == normalised(identity) else plan.todo).append(shard)
        if m is not None and m.identity != normalised(identity):
            plan.changed.append(shard)
    plan.kept_other = sorted(set(by_shard) - set(units))
    return plan


# --- filesystem --------------------------------------------------------------------------
def literal(path: str) -> str:
    """`path` as a match pattern that matches only itself: an output folder named `g[1]` is
    that folder, never the glob that also matches `g1`."""
    return re.sub(r"[*?[]", lambda m: r"[\[]" if m.group() == "[" else f"[{m.group()}]", path)


def matching(pattern: str) -> list[str]:
    try:
        return sorted(m.path for r in FileSystems.match([pattern]) for m in r.metadata_list)
    except Exception:  # a folder that does not exist yet matches nothing
        return []


def read_text(path: str) -> str:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read().decode("utf-8")


def read_markers(output: str) -> list[Marker]:
    markers = []
    for path in matching(literal(inside(output, S.COMPLETE_DIR)) + "/*" + MARKER):
        try:
            markers.append(Marker.from_json(read_text(path)))
        except Exception as exc:  # a torn marker means an incomplete shard: redo it
            LOG.warning("Ignoring unreadable completion marker %s (%s)", path, exc)
    return markers


def existing_outputs(output: str) -> list[str]:
    """Every file this job may have written under DIR (data, markers, temporary files)."""
    patterns = [literal(inside(output, folder)) + "/*" + PARQUET + "*" for folder in DATA_FOLDERS]
    patterns.append(literal(inside(output, S.COMPLETE_DIR)) + "/*")
    return sorted({p for pattern in patterns for p in matching(pattern)})


def delete_files(paths: list[str]) -> None:
    """Delete exactly these files. Beam's local filesystem matches the paths it deletes as
    globs (other filesystems take them as they are), so local paths are escaped."""
    if paths:
        FileSystems.delete([literal(p) if isinstance(FileSystems.get_filesystem(p), LocalFileSystem) else p for p in paths])


def prepare_output(output: str, resume: bool, units: dict[str, dict], settings: dict) -> ResumePlan:
    """Before the job runs: without `resume`, delete all previous outputs and process every unit;
    with it, keep the complete units' files, delete everything else, process the rest."""
    summary = [f for f in matching(literal(inside(output, S.RUN_SUMMARY_FILE)))]
    if not resume:
        delete_files(summary)  # first: from here on the folder no longer claims a finished run
        delete_files(existing_outputs(output))
        return ResumePlan(todo=sorted(units))
    markers = read_markers(output)
    plan = plan_resume(markers, units, settings)
    delete_files(summary)
    done = set(plan.complete) | set(plan.kept_other)
    keep = {f for m in markers if m.shard in done for f in m.files(output)}
    delete_files([f for f in existing_outputs(output) if f not in keep])
    return plan


def check_writable(output: str) -> None:
    """Create and remove a probe file in DIR, so an output location that cannot be written
    fails before any model loads or any old output is deleted. Raises OutputError."""
    probe = inside(output, f".dspark-write-probe{TMP_TAG}{uuid.uuid4().hex}")
    try:
        with FileSystems.create(probe, mime_type="application/octet-stream") as f:
            f.write(b"probe")
        delete_files([probe])
    except Exception as exc:
        raise OutputError(f"cannot write to --output {output}: {type(exc).__name__}: {exc}") from exc


def write_text_atomically(path: str, text: str) -> None:
    tmp = f"{path}{TMP_TAG}{uuid.uuid4().hex}"
    with FileSystems.create(tmp, mime_type="application/json") as f:
        f.write(text.encode("utf-8"))
    FileSystems.rename([tmp], [path])


class ParquetFileWriter:
    """Rows -> one Parquet file, written under a temporary name, in chunks, renamed on `commit`."""

    def __init__(self, path: str, schema: pa.Schema):
        self.path, self.schema = path, schema
        self.tmp = f"{path}{TMP_TAG}{uuid.uuid4().hex}"
        self.handle = FileSystems.create(self.tmp, mime_type="application/octet-stream",
                                         compression_type=CompressionTypes.UNCOMPRESSED)
        self.writer = pq.ParquetWriter(self.handle, schema)
        self.pending: list[dict] = []
        self.rows = 0

    def add(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) >= WRITE_CHUNK_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.writer.write_table(pa.Table.from_pylist(self.pending, schema=self.schema))
            self.rows += len(self.pending)
            self.pending = []

    def commit(self) -> int:
        self.flush()
        self.writer.close()
        self.handle.close()
        FileSystems.rename([self.tmp], [self.path])
        return self.rows

    def abort(self) -> None:
        try:
            self.writer.close()
            self.handle.close()
            delete_files(matching(literal(self.tmp)))
        except Exception:  # cleanup must never hide the original error
            pass


class WriteShardOutputsDoFn(beam.DoFn):
    """(input file, [(folder, row)]) -> its data files, then its completion marker."""

    def __init__(self, output: str, schemas: dict[str, pa.Schema], identities: dict[str, dict], settings: dict,
                 on_progress: ProgressHook | None = None):
        self.output = output
        self.schemas = schemas
        self.identities = identities
        self.settings = normalised(settings)
        self.on_progress = on_progress
        self.shards_written = Metrics.counter("dspark", "shards_written")

    def _write_files(self, name: str, rows: Iterable[tuple[str, dict]], spec: dict[str, Any]) -> dict[str, int]:
        """Write the data files; the SPEC_COUNTS element goes into `spec` (for the marker)."""
        writers: dict[str, ParquetFileWriter] = {}
        try:
            for folder, row in rows:
                if folder == SPEC_COUNTS:
                    spec.update(row)
                    continue
                if folder not in writers:
                    writers[folder] = ParquetFileWriter(data_file(self.output, folder, name), self.schemas[folder])
                writers[folder].add(row)
            counts = {folder: writers.pop(folder).commit() for folder in sorted(writers)}
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        # a retried bundle may find files of an earlier attempt that this one has no rows for
        stale = [data_file(self.output, f, name) for f in DATA_FOLDERS if f not in counts]
        delete_files([p for p in stale if FileSystems.exists(p)])
        return counts

    def process(self, element: tuple[str, Iterable[tuple[str, dict]]]):
        shard, rows = element
        name = output_name(shard)
        spec: dict[str, Any] = {}
        counts = self._write_files(name, rows, spec)
        if self.on_progress is not None:
            self.on_progress(shard, "files_written")
        marker = Marker(shard, self.identities.get(shard, {}), self.settings, counts, spec)
        write_text_atomically(marker_file(self.output, name), marker.to_json())
        self.shards_written.inc()
        if self.on_progress is not None:
            self.on_progress(shard, "complete")
        yield shard
