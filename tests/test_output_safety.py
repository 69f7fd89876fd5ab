"""Nothing a run can fail on runs after it has deleted anything, output paths are literal,
and a folder claims a finished run only when one finished there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_pipeline import base_args, sentence  # noqa: E402
from test_pipeline_bad_input import never_load  # noqa: E402
from pipeline_support import TINY_NAME, CrashAfterShards, build_tiny_model_dir, read_folder, read_summary, write_shard  # noqa: E402

from pipelines import generate as cli  # noqa: E402
from transforms.outputs import OutputError  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("models") / TINY_NAME)


@pytest.fixture
def shards(tmp_path) -> str:
    folder = tmp_path / "in"
    folder.mkdir()
    for k in range(2):
        write_shard(folder / f"s{k}.parquet", [{"id": f"{k}-{i}", "text": sentence(10 * k + i)} for i in range(3)])
    return str(folder / "*.parquet")


def files(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--target", "/no/such/model", "--target"),
    ("--drafter", "ngrams", "--drafter: unknown drafter"),
    ("--drafter", "dspark:/no/such/checkpoint", "--drafter: no DSpark drafter checkpoint"),
    ("--drafter", "ngram:2:3", "--drafter"),
    ("--scheduler", "fixed:many", "--scheduler"),
])
def test_a_refused_model_or_drafter_deletes_nothing(tmp_path, tiny_model, shards, flag, value, message):
    out = tmp_path / "out"
    cli.run(base_args(tiny_model, out, shards))
    before = files(out)
    with pytest.raises(cli.ConfigError, match=message):
        cli.run(base_args(tiny_model, out, shards) + [flag, value], generator_factory=never_load)
    assert files(out) == before


def test_output_paths_are_literal_not_globs(tmp_path, tiny_model, shards):
    """`out/g[1]` is that folder: a run there leaves `out/g1` alone, and --resume finds its own markers."""
    sibling, odd = tmp_path / "out" / "g1", tmp_path / "out" / "g[1]"
    cli.run(base_args(tiny_model, sibling, shards))
    before = files(sibling)
    cli.run(base_args(tiny_model, odd, shards))
    assert files(sibling) == before
    assert read_summary(odd)["totals"]["num_ok"] == 6 and len(read_folder(odd, "generations")) == 6
    resumed = cli.run(base_args(tiny_model, odd, shards) + ["--resume"], generator_factory=never_load)
    assert resumed["resume"]["files_already_complete"] == 2 and resumed["totals"]["num_ok"] == 6
    assert files(sibling) == before


def test_a_rerun_killed_part_way_leaves_no_summary(tmp_path, tiny_model, shards):
    out = tmp_path / "out"
    cli.run(base_args(tiny_model, out, shards))
    assert (out / "run_summary.json").is_file()
    with pytest.raises(Exception, match="injected crash"):
        cli.run(base_args(tiny_model, out, shards), on_progress=CrashAfterShards(tmp_path / "tokens", 1))
    assert not (out / "run_summary.json").exists()  # the folder no longer claims a finished run
    assert not list(out.rglob("*.tmp-*"))


def test_an_unwritable_output_fails_before_any_model_loads_or_deletion(tmp_path, shards, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    args = ["--input", shards, "--output", str(blocker / "out"), "--no-progress"]
    with pytest.raises(OutputError, match="cannot write to --output"):
        cli.run(args, generator_factory=never_load)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "error: cannot write to --output" in err and "Traceback" not in err


def test_resume_redoes_an_input_file_rewritten_with_the_same_row_count(tmp_path, tiny_model, shards):
    out = tmp_path / "out"
    cli.run(base_args(tiny_model, out, shards))
    rewritten = tmp_path / "in" / "s1.parquet"
    write_shard(rewritten, [{"id": f"new-{i}", "text": sentence(500 + i)} for i in range(3)])
    summary = cli.run(base_args(tiny_model, out, shards) + ["--resume"])
    ids = sorted(g["id"] for g in read_folder(out, "generations"))
    assert ids == sorted([f"0-{i}" for i in range(3)] + [f"new-{i}" for i in range(3)])
    assert summary["resume"]["files_already_complete"] == 1 and summary["resume"]["files_changed_since"] == [str(rewritten)]


def test_a_failure_during_the_run_is_one_error_line_unless_verbose(monkeypatch, capsys, tmp_path):
    """Beam re-raises a worker's error with its traceback folded into the message: the user
    sees its first line and exit status 1; --verbose lets the traceback through."""

    def fails(argv=None, **_):
        raise RuntimeError("worker died on shard a.parquet\nTraceback (most recent call last):\n  ...")

    monkeypatch.setattr(cli, "run", fails)
    args = ["--output", str(tmp_path / "out")]
    assert cli.main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: RuntimeError: worker died on shard a.parquet (--verbose shows the traceback)"]
    with pytest.raises(RuntimeError, match="worker died"):
        cli.main(args + ["--verbose"])
