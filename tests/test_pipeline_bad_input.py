"""Bad input and faults in the pipeline: bad rows go to dead_letter with a clear
error_type while the job goes on; bad files stop the job before any model loads, or are
recorded as file-level dead letters with --skip-bad-files; an engine exception on one row does
not cost the rest of its batch; and, as a property, every row ends up exactly once in
generations or dead_letter whatever the mix of good and bad rows."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_pipeline import base_args, sentence  # noqa: E402
from pipeline_support import TINY_NAME, build_tiny_model_dir, read_folder, read_summary, write_shard  # noqa: E402

from pipelines import generate as cli  # noqa: E402
from dspark.generator import DSparkGenerator  # noqa: E402
from transforms.generation import build_generator  # noqa: E402
from transforms.preflight import BadInputError  # noqa: E402
from transforms.schema import ErrorType  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
POISON = "POISON"
OOM = "OOMROW"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("models") / TINY_NAME)


# --- fault injection ---------------------------------------------------------------------
class PoisonedGenerator(DSparkGenerator):
    """The real engine, except that any call containing a POISON prompt raises, as a crash
    inside the engine on that row would, and any speculative call containing an OOMROW prompt
    runs out of accelerator memory (without speculation it fits)."""

    def generate(self, prompts, **kwargs):
        texts = [self.target.tokenizer.decode(p) for p in prompts]
        if any(POISON in t for t in texts):
            raise RuntimeError(f"injected fault on a batch of {len(prompts)}")
        if self.scheduler.max_depth > 0 and any(OOM in t for t in texts):
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return super().generate(prompts, **kwargs)


def rebuilt_as(cls, spec):
    """The real generator for `spec`, as an instance of the fault-injecting subclass `cls`."""
    real = build_generator(spec)
    return cls(real.target, real.drafter, real.scheduler, max_batch_size=real.max_batch_size)


def poisoned_factory(spec):
    return rebuilt_as(PoisonedGenerator, spec)


def never_load(spec):
    raise AssertionError("a model was loaded although the input was bad")


def string_column(values: list) -> pa.Array:
    """A Parquet string column that may hold invalid UTF-8 (bytes are stored as they are)."""
    raw = [v if isinstance(v, bytes) or v is None else v.encode("utf-8", "surrogatepass") for v in values]
    return pa.array(raw, type=pa.binary()).view(pa.string())


def write_raw_shard(path: Path, ids: list, texts: list) -> Path:
    pq.write_table(pa.table({"id": pa.array(ids, type=pa.string()), "text": string_column(texts)}), path)
    return path


def conserved(shards: dict[str, list], out: Path) -> tuple[collections.Counter, collections.Counter]:
    expected = collections.Counter((shard, i) for shard, ids in shards.items() for i in ids)
    gens, dead = read_folder(out, "generations"), read_folder(out, "dead_letter")
    got = collections.Counter([(g["shard"], g["id"]) for g in gens] + [(d["shard"], d["id"]) for d in dead])
    return got, expected


# --- row level ---------------------------------------------------------------------------
def test_bad_rows_go_to_dead_letter_and_the_batch_completes(tiny_model, tmp_path):
    long_text = " ".join(sentence(i, 30) for i in range(12))  # far beyond the 384-token context
    words = sentence(7, 30).split()
    rows = {
        "good0": sentence(0), "good1": sentence(1), "good2": sentence(2), "good3": sentence(3),
        "null": None, "empty": "", "blank": "  \n\t ", "nul": "text with a \x00 byte", "esc": "ansi \x1b[31m red",
        "badutf8": b"caf\xc3 \xff broken", "surrogate": "lone \ud800 half", "toolong": long_text,
        "repeated": " ".join(["the"] * 80), "shuffled": " ".join(np.random.default_rng(0).permutation(words)),
        "poisoned": f"{POISON} {sentence(9)}", "oom": f"{OOM} {sentence(10)}",
    }
    ids = list(rows) + ["good1", None]  # a duplicate id and a null id
    texts = list(rows.values()) + [sentence(11), sentence(12)]
    shard = write_raw_shard(tmp_path / "mixed.parquet", ids, texts)
    out = tmp_path / "out"
    args = base_args(tiny_model, out, str(shard)) + ["--rows-per-call", "32"]  # one batch: the poison shares it
    summary = cli.run(args, generator_factory=poisoned_factory)

    got, expected = conserved({str(shard): ids}, out)
    assert got == expected
    dead = {d["id"]: d for d in read_folder(out, "dead_letter")}
    assert {k: v["error_type"] for k, v in dead.items()} == {
        "null": ErrorType.NULL_TEXT, "empty": ErrorType.EMPTY_TEXT, "blank": ErrorType.EMPTY_TEXT,
        "nul": ErrorType.CONTROL_CHARACTERS, "esc": ErrorType.CONTROL_CHARACTERS,
        "badutf8": ErrorType.INVALID_UTF8, "surrogate": ErrorType.INVALID_UTF8,
        "toolong": ErrorType.PROMPT_TOO_LONG, "poisoned": ErrorType.GENERATION_ERROR, None: ErrorType.NULL_ID,
    }
    assert "injected fault" in dead["poisoned"]["error"]
    assert "U+0000" in dead["nul"]["error"] and "384" in dead["toolong"]["error"]

    # The rest of the poisoned batch completed, with the outputs the engine gives without the poison.
    gens = {(g["id"], g["output"]) for g in read_folder(out, "generations")}
    generated_ids = collections.Counter(i for i, _ in gens)
    assert generated_ids == collections.Counter(["good0", "good1", "good1", "good2", "good3", "repeated", "shuffled", "oom"])
    engine = DSparkGenerator.from_names(str(tiny_model), drafter="ngram", scheduler="dspark", dtype="float32", max_batch_size=4)
    clean = ["good0", "good2", "repeated", "shuffled", "oom"]  # oom: generated without speculation, same greedy text
    direct = engine.generate([rows[i] for i in clean], max_new_tokens=6)
    assert {(i, r.text) for i, r in zip(clean, direct)} <= gens

    metrics = read_folder(out, "shard_metrics")[0]
    assert (metrics["num_records"], metrics["num_ok"], metrics["num_failed"], metrics["num_duplicate_ids"]) == (18, 8, 10, 1)
    assert summary["beam_counters"]["dspark.batch_splits_after_error"] >= 1
    assert summary["beam_counters"]["dspark.rows_retried_without_speculation"] >= 1
    assert summary["beam_counters"]["dspark.oom_batch_halvings"] >= 1
    oom_row = next(g for g in read_folder(out, "generations") if g["id"] == "oom")
    assert oom_row["mean_accepted_length"] == pytest.approx(1.0)
    assert summary["totals"]["dead_letter_by_error_type"][ErrorType.EMPTY_TEXT] == 2


def test_non_string_text_column(tiny_model, tmp_path):
    shard = write_shard(tmp_path / "ints.parquet", [{"id": "x", "text": 5}, {"id": "y", "text": None}])
    out = tmp_path / "out"
    cli.run(base_args(tiny_model, out, str(shard)))
    assert sorted((d["id"], d["error_type"]) for d in read_folder(out, "dead_letter")) == [
        ("x", ErrorType.NON_STRING_TEXT), ("y", ErrorType.NULL_TEXT)
    ]
    assert read_folder(out, "generations") == []


class OutOfMemoryAtWidth(DSparkGenerator):
    """The real engine, running out of accelerator memory whenever more than 2 rows decode
    together while speculating, and on any HUGE prompt whatever the settings."""

    def generate(self, prompts, **kwargs):
        import torch

        width = min(self.max_batch_size, len(prompts))
        huge = any(HUGE in self.target.tokenizer.decode(p) for p in prompts)
        if huge or (self.scheduler.max_depth > 0 and width > 2):
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {width} rows)")
        return super().generate(prompts, **kwargs)


HUGE = "HUGEROW"


def oom_factory(spec):
    return rebuilt_as(OutOfMemoryAtWidth, spec)


def test_out_of_memory_halves_the_batch_then_drops_speculation_then_dead_letters(tiny_model, tmp_path):
    """Shard a: 6 rows run out of memory at 4 rows decoding together and complete at 2. Shard b:
    its HUGE row runs out of memory at every width: 4 -> 2 -> 1 -> no speculation, the other
    rows complete without speculation, and the HUGE row goes to dead_letter as out_of_memory."""
    a = write_shard(tmp_path / "a.parquet", [{"id": f"a{i}", "text": sentence(400 + i)} for i in range(6)])
    b = write_shard(tmp_path / "b.parquet", [{"id": f"b{i}", "text": sentence(500 + i)} for i in range(3)]
                    + [{"id": "huge", "text": f"{HUGE} {sentence(9)}"}])
    out = tmp_path / "out"
    summary = cli.run(base_args(tiny_model, out, str(tmp_path / "*.parquet")) + ["--rows-per-call", "32"],
                      generator_factory=oom_factory)

    dead = read_folder(out, "dead_letter")
    assert [(d["id"], d["error_type"]) for d in dead] == [("huge", ErrorType.OUT_OF_MEMORY)]
    assert "out of memory" in dead[0]["error"]
    counters = summary["beam_counters"]
    assert counters["dspark.oom_batch_halvings"] == 1 + 2  # a: 4 -> 2; b: 4 -> 2 -> 1
    assert counters["dspark.rows_retried_without_speculation"] == 4  # all of b's call
    gens = {g["id"]: g for g in read_folder(out, "generations")}
    assert set(gens) == {f"a{i}" for i in range(6)} | {f"b{i}" for i in range(3)}
    assert all(gens[f"b{i}"]["mean_accepted_length"] == pytest.approx(1.0) for i in range(3))
    # the retries change nothing in the outputs (greedy decoding is lossless)
    engine = DSparkGenerator.from_names(str(tiny_model), drafter="ngram", scheduler="dspark", dtype="float32", max_batch_size=4)
    ids = [*(f"a{i}" for i in range(6)), *(f"b{i}" for i in range(3))]
    texts = [sentence(400 + i) for i in range(6)] + [sentence(500 + i) for i in range(3)]
    assert [r.text for r in engine.generate(texts, max_new_tokens=6)] == [gens[i]["output"] for i in ids]
    metrics = {Path(m["shard"]).name: m for m in read_folder(out, "shard_metrics")}
    assert (metrics["b.parquet"]["num_ok"], metrics["b.parquet"]["num_failed"]) == (3, 1)
    assert str(a) in {m["shard"] for m in metrics.values()} and str(b) in {m["shard"] for m in metrics.values()}


def test_rows_past_the_time_limit_go_to_dead_letter(tiny_model, tmp_path):
    """A limit far below one decoding round: every row still decoding after its first round
    stops there and goes to dead_letter as time_limit, its message giving the limit, the time
    taken and the tokens produced; a row that finished in that round is a normal generation.
    A generous limit changes nothing."""
    from dspark.schedulers import DEFAULT_MAX_DEPTH

    texts = {f"t{i}": sentence(900 + i, 10) for i in range(5)}
    write_shard(tmp_path / "t.parquet", [{"id": k, "text": v} for k, v in texts.items()])
    args = base_args(tiny_model, tmp_path / "out", str(tmp_path / "t.parquet")) + ["--max-new-tokens", "40"]
    cli.run(args + ["--row-time-limit-s", "1e-6"])
    dead = {d["id"]: d for d in read_folder(tmp_path / "out", "dead_letter")}
    engine = DSparkGenerator.from_names(str(tiny_model), drafter="ngram", scheduler="dspark", dtype="float32", max_batch_size=4)
    unlimited = dict(zip(texts, engine.generate(list(texts.values()), max_new_tokens=40)))
    long_rows = {k for k, r in unlimited.items() if r.num_output_tokens > DEFAULT_MAX_DEPTH + 1}
    assert long_rows and long_rows <= set(dead)  # more tokens than one round can give: cut by the limit
    for d in dead.values():
        assert d["error_type"] == ErrorType.TIME_LIMIT
        assert d["error"].startswith("row time limit 1e-06 s reached after ") and " token(s) generated" in d["error"]
    gens = read_folder(tmp_path / "out", "generations")
    assert sorted([g["id"] for g in gens] + list(dead)) == sorted(texts)
    assert all(g["finish_reason"] != "time_limit" for g in gens)
    [metrics] = read_folder(tmp_path / "out", "shard_metrics")
    assert (metrics["num_ok"], metrics["num_failed"]) == (len(gens), len(dead))

    cli.run(args + ["--row-time-limit-s", "600", "--output", str(tmp_path / "out2")])
    assert read_folder(tmp_path / "out2", "dead_letter") == []
    assert {g["id"]: g["output"] for g in read_folder(tmp_path / "out2", "generations")} == {k: r.text for k, r in unlimited.items()}


def test_sampled_rows_do_not_depend_on_their_place_in_an_engine_call(tiny_model, tmp_path):
    """Sampling with per-row seeds: the same rows in calls of 5 and of 2 (and so at other
    positions, as after a halving retry or on --resume) give the same sampled outputs."""
    write_shard(tmp_path / "s.parquet", [{"id": f"s{i}", "text": sentence(950 + i)} for i in range(6)])
    outputs = []
    for k, per_call in enumerate(["5", "2"]):
        out = tmp_path / f"out{k}"
        cli.run(base_args(tiny_model, out, str(tmp_path / "s.parquet"))
                + ["--temperature", "1.0", "--scheduler", "ar", "--rows-per-call", per_call, "--seed", "7"])
        outputs.append({g["id"]: g["output"] for g in read_folder(out, "generations")})
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6
    assert len(set(outputs[0].values())) > 1


# --- file level --------------------------------------------------------------------------
def good_shard(path: Path, n: int = 3) -> Path:
    return write_shard(path, [{"id": f"{path.stem}-{i}", "text": sentence(i)} for i in range(n)])


def truncated(path: Path) -> Path:
    good_shard(path, 40)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


def csv_file(path: Path) -> Path:
    path.write_text("id,text\n1,hello\n")
    return path


BAD_FILES = {
    "not_parquet": (csv_file, "not a readable Parquet file"),
    "truncated": (truncated, "not a readable Parquet file"),
    "missing_column": (lambda p: write_shard(p, [{"id": "1", "body": "x", "lang": "en"}]),
                       "missing column(s) 'text'; columns found: id, body, lang"),
    "schema_mismatch": (lambda p: write_shard(p, [{"id": 7, "text": "x"}]), "schema disagrees with other shards: id: int64"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_fails_fast_naming_it(case, tmp_path):
    make, message = BAD_FILES[case]
    good_shard(tmp_path / "a-good.parquet")
    bad = make(tmp_path / "b-bad.parquet")
    args = ["--input", str(tmp_path / "*.parquet"), "--output", str(tmp_path / "out"), "--target", "/nonexistent/model"]
    with pytest.raises(BadInputError) as err:
        cli.run(args, generator_factory=never_load)
    assert str(bad) in str(err.value) and message in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_no_matching_file(tmp_path):
    with pytest.raises(BadInputError, match="no file matches"):
        cli.run(["--input", str(tmp_path / "nothing-*.parquet")], generator_factory=never_load)


def test_cli_reports_bad_input_as_an_error_message(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"\x00" * 64)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pipelines.generate", "--input", str(tmp_path / "*.parquet")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"error: {tmp_path / 'x.parquet'}: not a readable Parquet file" in proc.stderr
    assert "Traceback" not in proc.stderr


def corrupt_first_row_group(path: Path) -> None:
    """Overwrite the first data page header of row group 0 (the footer stays valid)."""
    offset = pq.ParquetFile(path).metadata.row_group(0).column(1).data_page_offset
    data = bytearray(path.read_bytes())
    data[offset: offset + 24] = b"\xff" * 24
    path.write_bytes(bytes(data))


def test_skip_bad_files_records_them_and_processes_the_rest(tiny_model, tmp_path):
    good = good_shard(tmp_path / "a-good.parquet", 2)
    write_shard(tmp_path / "c-long.parquet", [{"id": "long", "text": " ".join(sentence(i, 30) for i in range(12))}])
    not_parquet = tmp_path / "b-bad.parquet"
    not_parquet.write_text("hello")
    missing = write_shard(tmp_path / "d-missing.parquet", [{"id": "1", "body": "x"}])
    damaged = write_shard(tmp_path / "e-damaged.parquet", [{"id": f"e{i}", "text": sentence(i)} for i in range(6)], row_group_size=3)
    corrupt_first_row_group(damaged)
    out = tmp_path / "out"
    summary = cli.run(base_args(tiny_model, out, str(tmp_path / "*.parquet")) + ["--skip-bad-files", "--truncate-prompts"])

    dead = sorted((Path(d["shard"]).name, d["id"], d["error_type"]) for d in read_folder(out, "dead_letter"))
    assert dead == [
        ("b-bad.parquet", None, ErrorType.FILE_UNREADABLE),
        ("d-missing.parquet", None, ErrorType.FILE_MISSING_COLUMNS),
        ("e-damaged.parquet", None, ErrorType.FILE_ROW_GROUP_UNREADABLE),
    ]
    gens = {g["id"]: g for g in read_folder(out, "generations")}
    assert set(gens) == {"a-good-0", "a-good-1", "long", "e3", "e4", "e5"}
    assert gens["long"]["prompt_truncated"] is True and gens["a-good-0"]["prompt_truncated"] is False
    assert gens["long"]["num_prompt_tokens"] + 6 <= 384
    assert {f["file"] for f in summary["skipped_files"]} == {str(not_parquet), str(missing)}
    assert read_summary(out)["totals"]["num_files_skipped"] == 2
    assert str(good) in {m["shard"] for m in read_folder(out, "shard_metrics")}
    # the damaged file's 6 rows are all accounted for: 3 generated, 3 never read (one dead letter)
    damaged_metrics = next(m for m in read_folder(out, "shard_metrics") if m["shard"] == str(damaged))
    assert (damaged_metrics["num_records"], damaged_metrics["num_ok"], damaged_metrics["num_failed"]) == (6, 3, 3)
    letter = next(d for d in read_folder(out, "dead_letter") if d["error_type"] == ErrorType.FILE_ROW_GROUP_UNREADABLE)
    assert letter["error"].startswith("row group 0 (3 rows) could not be read")
    totals = read_summary(out)["totals"]
    assert totals["num_records"] == 2 + 1 + 6 and totals["num_ok"] + totals["num_failed"] == totals["num_records"]


def test_unreadable_row_group_fails_the_job_naming_the_file(tiny_model, tmp_path):
    damaged = write_shard(tmp_path / "damaged.parquet", [{"id": f"e{i}", "text": sentence(i)} for i in range(6)], row_group_size=3)
    corrupt_first_row_group(damaged)
    with pytest.raises(Exception, match="damaged.parquet: row group 0"):
        cli.run(base_args(tiny_model, tmp_path / "out", str(damaged)))


# --- property: conservation --------------------------------------------------------------
GOOD_OR_BAD = st.one_of(
    st.builds(lambda s: sentence(s, 8), st.integers(0, 10_000)),  # good
    st.just(None), st.just(""), st.just("   "),
    st.sampled_from(["ctl \x01 char", "del \x7f char"]),
    st.sampled_from([b"\xff\xfe", b"ok \xc3("]),  # invalid UTF-8
    st.builds(lambda n: "word " * n, st.integers(400, 600)),  # too long for the tiny context
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30),  # anything
    st.builds(lambda s: f"{POISON} {sentence(s, 5)}", st.integers(0, 100)),  # the engine raises on it
)
SHARDS = st.lists(
    st.lists(st.tuples(st.one_of(st.sampled_from(["r1", "r2", "r3"]), st.uuids().map(str), st.none()), GOOD_OR_BAD),
             min_size=1, max_size=6),
    min_size=1, max_size=3,
)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(shards=SHARDS)
def test_property_every_row_exactly_once(tiny_model, tmp_path_factory, shards):
    folder = tmp_path_factory.mktemp("prop")
    ids_by_shard = {}
    for k, rows in enumerate(shards):
        path = write_raw_shard(folder / f"s{k}.parquet", [i for i, _ in rows], [t for _, t in rows])
        ids_by_shard[str(path)] = [i for i, _ in rows]
    out = folder / "out"
    args = base_args(tiny_model, out, str(folder / "*.parquet")) + ["--max-new-tokens", "2", "--rows-per-call", "4"]
    cli.run(args, generator_factory=poisoned_factory)
    got, expected = conserved(ids_by_shard, out)
    assert got == expected
    # a POISON row with a unique, non-null id must be a generation_error (the rest of its batch completes)
    counts = collections.Counter((s, i) for s, ids in ids_by_shard.items() for i in ids)
    poisoned = [(s, i) for s, rows in zip(ids_by_shard, shards) for i, t in rows
                if isinstance(t, str) and t.startswith(POISON) and i is not None and counts[(s, i)] == 1]
    dead_types = {(d["shard"], d["id"]): d["error_type"] for d in read_folder(out, "dead_letter")}
    assert all(dead_types.get(key) == ErrorType.GENERATION_ERROR for key in poisoned)
    metrics = {m["shard"]: m for m in read_folder(out, "shard_metrics")}
    for shard, ids in ids_by_shard.items():
        m = metrics[shard]
        assert m["num_records"] == len(ids) == m["num_ok"] + m["num_failed"]
        assert m["num_duplicate_ids"] == sum(i is not None for i in ids) - len({i for i in ids if i is not None})
