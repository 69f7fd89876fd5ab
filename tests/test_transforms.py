"""Unit tests of the pipeline's pure parts: prompt validation, Parquet decoding, failure
isolation, shard metrics, file preflight and option/config resolution. No model, no Beam run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipelines import generate as cli  # noqa: E402
from transforms.generation import spec_stats  # noqa: E402
from transforms.metrics import OkEvent, ShardMetricsFn, percentile, shard_metrics_row  # noqa: E402
from transforms.preflight import BadInputError, check_inputs  # noqa: E402
from transforms.prompts import PromptSpec, template_fields, to_prompt  # noqa: E402
from transforms.read import table_to_rows  # noqa: E402
from transforms.records import BatchReport, DeadLetter, InputRow, InvalidUtf8, PromptRow, SpecStats  # noqa: E402
from transforms.schema import SHARD_METRIC_COLUMNS, ErrorType  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


# --- prompts -----------------------------------------------------------------------------
def row(text, id_="r1", **other) -> InputRow:
    return InputRow(shard="s.parquet", values={"id": id_, "text": text, **other})


@pytest.mark.parametrize(
    "text, error_type",
    [
        (None, ErrorType.NULL_TEXT),
        ("", ErrorType.EMPTY_TEXT),
        (" \n\t ", ErrorType.EMPTY_TEXT),
        (42, ErrorType.NON_STRING_TEXT),
        (3.5, ErrorType.NON_STRING_TEXT),
        (["a"], ErrorType.NON_STRING_TEXT),
        (b"\xff\xfe", ErrorType.INVALID_UTF8),
        (InvalidUtf8(b"ab\xc3"), ErrorType.INVALID_UTF8),
        ("bad \ud800 surrogate", ErrorType.INVALID_UTF8),
        ("nul \x00 inside", ErrorType.CONTROL_CHARACTERS),
        ("bell \x07", ErrorType.CONTROL_CHARACTERS),
        ("c1 \x85 control", ErrorType.CONTROL_CHARACTERS),
    ],
)
def test_bad_text_becomes_a_dead_letter_with_its_type(text, error_type):
    result = to_prompt(row(text), PromptSpec())
    assert isinstance(result, DeadLetter)
    assert (result.id, result.shard, result.error_type) == ("r1", "s.parquet", error_type)
    assert "'text'" in result.error


def test_null_id_is_a_dead_letter():
    result = to_prompt(row("fine", id_=None), PromptSpec())
    assert isinstance(result, DeadLetter) and result.error_type == ErrorType.NULL_ID


def test_template_fills_text_and_other_columns_and_keeps_columns():
    spec = PromptSpec(template="[{domain}] {text} ({n})", keep_columns=("domain",))
    result = to_prompt(row("Add two numbers.", domain="math", n=7), spec)
    assert isinstance(result, PromptRow)
    assert result.prompt == "[math] Add two numbers. (7)"
    assert result.kept == {"domain": "math"}
    assert spec.required_columns() == ["id", "text", "domain", "n"]


def test_tabs_newlines_and_carriage_returns_are_normal_text():
    result = to_prompt(row("a\tb\r\nc\n"), PromptSpec())
    assert isinstance(result, PromptRow) and result.prompt == "a\tb\r\nc\n"


def test_strip_control_chars_option_removes_them():
    spec = PromptSpec(strip_control_chars=True)
    assert to_prompt(row("a\x00b\x1bc"), spec).prompt == "abc"
    only_controls = to_prompt(row("\x00\x07"), spec)
    assert isinstance(only_controls, DeadLetter) and only_controls.error_type == ErrorType.EMPTY_TEXT


@pytest.mark.parametrize("template", ["{text.__class__}", "{text[0]}", "{0}", "{}", "{text!r}", "{text:>10}", "{", "no field"])
def test_unsafe_or_malformed_templates_are_refused(template):
    with pytest.raises(ValueError):
        template_fields(template)


def test_literal_braces_in_template():
    assert template_fields("{{json}}: {text}") == ("text",)


# --- reading -----------------------------------------------------------------------------
def test_invalid_utf8_cell_does_not_break_its_neighbours():
    text = pa.array([b"good", b"\xff bad", None], type=pa.binary()).view(pa.string())
    table = pa.table({"id": ["a", "b", "c"], "text": text})
    with pytest.raises(UnicodeDecodeError):
        table.to_pylist()  # what a plain pyarrow/Beam conversion would do to the whole batch
    rows = list(table_to_rows(table, "f.parquet"))
    assert [r.values["text"] for r in rows] == ["good", InvalidUtf8(b"\xff bad"), None]
    assert {r.shard for r in rows} == {"f.parquet"}


# --- failure isolation -------------------------------------------------------------------
def test_spec_stats_reads_engine_stats():
    from dspark.metrics import RequestStats

    s = RequestStats(drafted=9, verified=6, accepted=4, rounds=3, emitted=7)
    assert spec_stats(s) == SpecStats(drafted=9, verified=6, accepted=4, rounds=3, emitted=7)


# --- shard metrics -----------------------------------------------------------------------
def test_percentile_matches_numpy():
    xs = [0.3, 1.2, 0.7, 5.0, 2.2, 0.1]
    for q in (50, 99, 0, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_shard_metrics_from_events():
    fn = ShardMetricsFn()
    events = [("file", 5)] + [("read", i) for i in ["a", "b", "b", "c", None]]
    events += [
        ("ok", OkEvent(10, 1.0, SpecStats(drafted=8, verified=6, accepted=3, rounds=5, emitted=8))),
        ("ok", OkEvent(20, 3.0, SpecStats(drafted=4, verified=2, accepted=2, rounds=10, emitted=12))),
        ("fail", ErrorType.NULL_ID),
        ("fail", ErrorType.EMPTY_TEXT),
        ("fail", ErrorType.GENERATION_ERROR),
        ("batch", BatchReport("s", 3, wall_s=2.0, device="cpu", dtype="bfloat16", cpu_util_mean=0.5, rss_peak_bytes=100)),
        ("batch", BatchReport("s", 2, wall_s=1.0, device="cpu", dtype="bfloat16", cpu_util_mean=0.8, rss_peak_bytes=300)),
    ]
    # split over two accumulators, as a distributed combine would
    a, b = fn.create_accumulator(), fn.create_accumulator()
    for i, e in enumerate(events):
        fn.add_input(a if i % 2 else b, e)
    m = shard_metrics_row("s", fn.extract_output(fn.merge_accumulators([a, b])))
    assert list(m) == list(SHARD_METRIC_COLUMNS)
    assert (m["num_records"], m["num_ok"], m["num_failed"], m["num_duplicate_ids"]) == (5, 2, 3, 1)
    assert m["output_tokens"] == 30 and m["wall_s"] == pytest.approx(3.0)
    assert m["tokens_per_s"] == pytest.approx(10.0)
    assert m["mean_accepted_length"] == pytest.approx(20 / 15)
    assert m["acceptance_rate"] == pytest.approx(5 / 8) and m["correction_rate"] == pytest.approx(3 / 8)
    assert m["mean_verify_budget"] == pytest.approx(8 / 15)
    assert m["p50_latency_s"] == pytest.approx(2.0) and m["p99_latency_s"] == pytest.approx(2.98)
    assert m["cpu_util_mean"] == pytest.approx((0.5 * 2 + 0.8 * 1) / 3)
    assert m["rss_peak_bytes"] == 300 and m["device"] == "cpu" and m["dtype"] == "bfloat16"
    assert m["gpu_util_mean"] is None and m["gpu_mem_peak_bytes"] is None


def test_ratios_are_null_without_drafts():
    fn = ShardMetricsFn()
    acc = fn.add_input(fn.create_accumulator(), ("ok", OkEvent(4, 0.5, SpecStats(rounds=4, emitted=4))))
    m = shard_metrics_row("s", acc)
    assert m["mean_accepted_length"] == 1.0
    assert m["acceptance_rate"] is None and m["correction_rate"] is None and m["mean_verify_budget"] == 0.0


# --- file preflight ----------------------------------------------------------------------
def good_table(n=3, **extra):
    return pa.table({"id": [f"i{k}" for k in range(n)], "text": [f"text {k}" for k in range(n)], **extra})


def test_preflight_no_match(tmp_path):
    with pytest.raises(BadInputError, match="no file matches"):
        check_inputs(str(tmp_path / "*.parquet"), ["id", "text"])


def test_preflight_names_a_non_parquet_file(tmp_path):
    pq.write_table(good_table(), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_text("id,text\n1,hello\n")
    with pytest.raises(BadInputError, match=r"b\.parquet: not a readable Parquet file"):
        check_inputs(str(tmp_path / "*.parquet"), ["id", "text"])


def test_preflight_names_a_truncated_file(tmp_path):
    pq.write_table(good_table(50), tmp_path / "a.parquet")
    data = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "c.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInputError, match=r"c\.parquet: not a readable Parquet file"):
        check_inputs(str(tmp_path / "*.parquet"), ["id", "text"])


def test_preflight_lists_columns_found(tmp_path):
    pq.write_table(pa.table({"key": ["a"], "body": ["b"]}), tmp_path / "a.parquet")
    with pytest.raises(BadInputError) as err:
        check_inputs(str(tmp_path / "*.parquet"), ["id", "text"])
    msg = str(err.value)
    assert "a.parquet" in msg and "'id'" in msg and "'text'" in msg and "columns found: key, body" in msg


def test_preflight_schema_disagreement(tmp_path):
    pq.write_table(good_table(), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [1, 2], "text": ["x", "y"]}), tmp_path / "b.parquet")
    with pytest.raises(BadInputError, match=r"b\.parquet: schema disagrees.*id: int64"):
        check_inputs(str(tmp_path / "*.parquet"), ["id", "text"])


def test_preflight_ignores_unneeded_column_differences_and_string_widths(tmp_path):
    pq.write_table(good_table(extra=["x"] * 3), tmp_path / "a.parquet")
    t = good_table(2)
    pq.write_table(t.cast(pa.schema([("id", pa.large_string()), ("text", pa.large_string())])), tmp_path / "b.parquet")
    pre = check_inputs(str(tmp_path / "*.parquet"), ["id", "text"])
    assert [Path(s.path).name for s in pre.shards] == ["a.parquet", "b.parquet"]
    assert pre.num_rows == 5 and pre.column_types["id"] == pa.string()


def test_preflight_skip_bad_files_keeps_the_good_ones(tmp_path):
    pq.write_table(good_table(7), tmp_path / "a.parquet", row_group_size=3)
    (tmp_path / "b.parquet").write_bytes(b"PAR1 not really")
    pq.write_table(pa.table({"id": ["z"]}), tmp_path / "c.parquet")
    pre = check_inputs(str(tmp_path / "*.parquet"), ["id", "text"], skip_bad_files=True)
    assert [Path(s.path).name for s in pre.shards] == ["a.parquet"]
    assert pre.shards[0].row_group_rows == (3, 3, 1)
    assert [(Path(p.path).name, p.error_type) for p in pre.skipped] == [
        ("b.parquet", ErrorType.FILE_UNREADABLE),
        ("c.parquet", ErrorType.FILE_MISSING_COLUMNS),
    ]


def test_commit_parts_are_whole_shards_of_at_least_the_given_rows():
    from transforms.job import commit_parts
    from transforms.preflight import FileProblem, Preflight, ShardFile

    shards = [ShardFile(f"s{k}", n, (n,)) for k, n in enumerate([3, 1, 1, 5, 2])]
    skipped = [FileProblem("bad", ErrorType.FILE_UNREADABLE, "not Parquet")]
    parts = commit_parts(Preflight(shards[::-1], {}, skipped), rows_per_part=4)
    assert [[s.path for s in p.shards] for p in parts] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert [p.skipped for p in parts] == [skipped, [], []]  # skipped files: once, in the first part
    assert [[s.path for s in p.shards] for p in commit_parts(Preflight(shards, {}), 100)] == [["s0", "s1", "s2", "s3", "s4"]]
    only_skipped = commit_parts(Preflight([], {}, skipped), 4)
    assert len(only_skipped) == 1 and only_skipped[0].skipped == skipped


def test_limit_rows_cuts_row_groups():
    from transforms.preflight import ShardFile, limit_rows

    shards = [ShardFile("a", 7, (3, 3, 1)), ShardFile("b", 2, (2,))]
    assert limit_rows(shards, None) == shards
    assert limit_rows(shards, 4) == [ShardFile("a", 4, (3, 1, 0)), ShardFile("b", 2, (2,))]


# --- options and configs -----------------------------------------------------------------
def test_default_config_file_equals_built_in_defaults():
    shipped = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    assert shipped["input"] == "data/sample_shards/*.parquet"
    assert cli.DEFAULTS["input"] == str(REPO / "data" / "sample_shards" / "*.parquet")
    for key, value in shipped.items():
        if key != "input":
            assert cli.DEFAULTS[key] == value, key


@pytest.mark.parametrize("name", ["default.yaml", "nightly-reports.yaml", "dialogue.yaml"])
def test_shipped_configs_parse(name):
    options, _ = cli.resolve_options(["--config", str(REPO / "configs" / name)])
    expected = {"nightly-reports.yaml": 1024, "dialogue.yaml": 256, "default.yaml": 128}[name]
    assert options["max_new_tokens"] == expected


def test_flags_override_config_which_overrides_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_new_tokens: 64\nscheduler: ar\nkeep-columns: [domain]\nbeam_options: {direct_num_workers: 2}\n")
    options, beam_flags = cli.resolve_options(["--config", str(cfg), "--scheduler", "fixed:4", "--batch-size", "8"])
    assert options["max_new_tokens"] == 64  # config
    assert options["scheduler"] == "fixed:4"  # flag beats config
    assert options["batch_size"] == 8 and options["drafter"] == "auto"  # flag, default
    assert options["keep_columns"] == ["domain"]
    assert "--direct_num_workers=2" in beam_flags


def test_keep_columns_accepts_commas_and_spaces():
    options, _ = cli.resolve_options(["--keep-columns", "a,b", "c"])
    assert options["keep_columns"] == ["a", "b", "c"]


def test_beam_options_pass_through_and_typos_are_refused():
    _, beam_flags = cli.resolve_options(["--direct_running_mode=multi_processing", "--direct_num_workers", "2"])
    assert beam_flags == ["--direct_running_mode=multi_processing", "--direct_num_workers", "2"]
    with pytest.raises(SystemExit):
        cli.resolve_options(["--max-new-token", "5"])


@pytest.mark.parametrize(
    "text",
    ["unknown_key: 1\n", "max_new_tokens: -3\n", "chat: maybe\n", "- a\n- b\n", "x: !!python/object/apply:os.system ['true']\n"],
)
def test_bad_config_files_are_refused(tmp_path, text):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit):
        cli.resolve_options(["--config", str(cfg)])


def test_help_explains_outputs_and_bad_input(capsys):
    with pytest.raises(SystemExit):
        cli.resolve_options(["--help"])
    out = capsys.readouterr().out
    for needle in ["generations/", "shard_metrics/", "dead_letter/", "run_summary.json", "--skip-bad-files",
                   "prompt_too_long", "--sdk_container_image", "worker_accelerator", "--config", "--resume",
                   "_complete/", "out_of_memory", "time_limit", "--row-time-limit-s"]:
        assert needle in out, needle


def test_mixed_shard_calls_apportion_wall_time_by_tokens():
    from transforms.generation import split_batch_report

    rows = [PromptRow("a", 1, "p", {}), PromptRow("a", 2, "p", {}), PromptRow("b", 3, "p", {}), PromptRow("c", 4, "p", {})]
    usage = {"device": "cpu", "gpu_util_mean": None, "gpu_mem_peak_bytes": None, "cpu_util_mean": 0.5, "rss_peak_bytes": 7}
    reports = split_batch_report(rows, {"a": 30, "b": 10}, 8.0, usage)
    assert [(r.shard, r.num_rows, r.wall_s) for r in reports] == [("a", 2, 6.0), ("b", 1, 2.0), ("c", 1, 0.0)]
    assert sum(r.wall_s for r in reports) == pytest.approx(8.0)
    nothing = split_batch_report(rows, {}, 4.0, usage)  # every row failed: share by rows
    assert [r.wall_s for r in nothing] == [2.0, 1.0, 1.0]


def test_time_limit_is_a_flag_and_a_config_key(tmp_path):
    options, _ = cli.resolve_options(["--row-time-limit-s", "2.5"])
    assert cli.job_spec(options).decode.row_time_limit_s == 2.5
    cfg = tmp_path / "c.yaml"
    cfg.write_text("row_time_limit_s: 30\n")
    options, _ = cli.resolve_options(["--config", str(cfg)])
    assert cli.job_spec(options).decode.row_time_limit_s == 30.0
    assert cli.job_spec(cli.resolve_options([])[0]).decode.row_time_limit_s is None
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit):
            cli.resolve_options(["--row-time-limit-s", bad])


def test_time_limit_letter_names_limit_time_and_tokens():
    from types import SimpleNamespace

    from transforms.generation import time_limit_kwargs, time_limit_letter

    letter = time_limit_letter(PromptRow("s.parquet", "r1", "p", {}), SimpleNamespace(latency_s=0.71234, num_output_tokens=3), 0.5)
    assert (letter.id, letter.shard, letter.error_type) == ("r1", "s.parquet", "time_limit")
    assert letter.error == "row time limit 0.5 s reached after 0.712 s with 3 token(s) generated (--row-time-limit-s)"
    assert time_limit_kwargs(None) == {} and time_limit_kwargs(2.0) == {"time_limit_s": 2.0}


def test_preflight_an_odd_first_file_does_not_decide_the_schema(tmp_path):
    """A shard whose text column is all null (Arrow type null) sorts first: it is the one
    skipped, not every good file after it; other columns follow the type most files have."""
    pq.write_table(pa.table({"id": ["n0"], "text": pa.nulls(1)}), tmp_path / "a-null.parquet")
    pq.write_table(pa.table({"id": [1, 2], "text": ["x", "y"]}), tmp_path / "b-int-ids.parquet")
    for name in ("c.parquet", "d.parquet"):
        pq.write_table(good_table(), tmp_path / name)
    pre = check_inputs(str(tmp_path / "*.parquet"), ["id", "text"], skip_bad_files=True, text_column="text")
    assert [Path(s.path).name for s in pre.shards] == ["c.parquet", "d.parquet"]
    skipped = {Path(p.path).name: p.error for p in pre.skipped}
    assert set(skipped) == {"a-null.parquet", "b-int-ids.parquet"}
    assert "text: null (but string" in skipped["a-null.parquet"] and "id: int64 (but string" in skipped["b-int-ids.parquet"]


def test_spec_stats_carry_the_health_signals_and_add_up():
    from dspark.metrics import RequestStats

    engine = RequestStats(drafted=5, verified=4, accepted=2, rounds=3, prefills=1, emitted=6,
                          position_attempts=[3, 2, 1], position_accepts=[2, 1, 0], confidences=[0.9, 0.5, 0.99, 0.2])
    s = spec_stats(engine)
    c = np.array([0.9, 0.5, 0.99, 0.2])
    assert s.entropy_bits == pytest.approx(float(np.sum(-(c * np.log2(c) + (1 - c) * np.log2(1 - c)))))
    assert s.confidences == 4 and s.confidence_entropy() == pytest.approx(engine.confidence_entropy)
    assert s.acceptance_by_position() == [2 / 3, 1 / 2, 0.0]
    s.add(SpecStats(position_attempts=[1, 1, 1, 2], position_accepts=[1, 1, 1, 1], entropy_bits=1.0, confidences=1))
    assert s.position_attempts == [4, 3, 2, 2] and s.position_accepts == [3, 2, 1, 1]  # elementwise, padded
    assert s.acceptance_by_position() == [3 / 4, 2 / 3, 1 / 2, 1 / 2] and s.confidences == 5
    assert SpecStats().confidence_entropy() is None and SpecStats().acceptance_by_position() == []


def test_health_block_names_the_breaching_shards_and_signals():
    from transforms.health import HealthThresholds, check_health, health_line

    rows = [
        {"shard": "a", "correction_rate": 0.10, "confidence_entropy": 0.5, "gpu_mem_fragmentation_peak": None},
        {"shard": "b", "correction_rate": 0.40, "confidence_entropy": 0.9, "gpu_mem_fragmentation_peak": 0.02},
        {"shard": "c", "correction_rate": None, "confidence_entropy": None, "gpu_mem_fragmentation_peak": 0.20},  # nothing drafted
    ]
    totals = {"correction_rate": 0.3, "confidence_entropy": 0.7, "gpu_mem_fragmentation_peak": 0.20}
    health = check_health(rows, totals, HealthThresholds())
    assert [(b["shard"], b["signal"]) for b in health["shards"]] == [
        ("b", "correction_rate"), ("b", "confidence_entropy"), ("c", "gpu_mem_fragmentation_peak")]
    assert [b["signal"] for b in health["run"]] == ["correction_rate", "gpu_mem_fragmentation_peak"] and not health["ok"]
    assert health_line(health).startswith("Health: correction_rate 0.3 above 0.15; gpu_mem_fragmentation_peak 0.2 above 0.05;")
    relaxed = HealthThresholds(max_correction_rate=0.5, max_confidence_entropy=1.0, max_gpu_mem_fragmentation=0.5)
    assert check_health(rows, totals, relaxed)["ok"] and health_line(check_health(rows, totals, relaxed)) is None
