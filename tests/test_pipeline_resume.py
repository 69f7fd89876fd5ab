"""Reruns and `--resume`: per-input-file outputs with completion markers, a job crashed
part-way and resumed (every row exactly once, complete files not redone, partial ones redone),
resume refused under other settings, and output names that cannot leave the output folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_pipeline import base_args, sentence  # noqa: E402
from test_pipeline_bad_input import GOOD_OR_BAD, POISON, conserved, never_load, poisoned_factory, write_raw_shard  # noqa: E402
from pipeline_support import TINY_NAME, CrashAfterShards, build_tiny_model_dir, read_folder, read_summary, write_shard  # noqa: E402

from pipelines import generate as cli  # noqa: E402
from transforms import outputs as O  # noqa: E402
from transforms.generation import build_generator  # noqa: E402
from transforms.schema import ErrorType  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("generations", "dead_letter", "shard_metrics")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("models") / TINY_NAME)


def markers(out: Path) -> dict[str, O.Marker]:
    return {m.shard: m for m in O.read_markers(str(out))}


def snapshot(out: Path) -> dict[str, tuple[int, int]]:
    """Every file under DIR -> (inode, mtime_ns): shows which files a later run left alone."""
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()}


def crash_then_resume(model: Path, folder: Path, n: int, extra: list[str] = (), factory=None) -> tuple[Path, dict, dict]:
    """Run the job over folder/*.parquet, crashing after n complete shards, then --resume it.
    Returns (DIR, the markers left by the crash, the resumed run's summary)."""
    out = folder / "out"
    args = base_args(model, out, str(folder / "*.parquet")) + ["--max-new-tokens", "2", "--rows-per-call", "4", *extra]
    with pytest.raises(Exception, match="injected crash"):
        cli.run(args, generator_factory=factory, on_progress=CrashAfterShards(folder / "tokens", n))
    left = markers(out)
    before = snapshot(out)
    summary = cli.run(args + ["--resume"], generator_factory=factory)
    kept = {shard: all(before.get(f) == snapshot(out).get(f) for f in m.files(str(out))) for shard, m in left.items()}
    assert all(kept.values()), kept  # complete files were neither rewritten nor deleted
    return out, left, summary


def write_shards(folder: Path, shards: list[list[tuple]]) -> dict[str, list]:
    """folder/s{k}.parquet per shard of (id, text) rows; returns each file's ids."""
    ids_by_shard = {}
    for k, rows in enumerate(shards):
        path = write_raw_shard(folder / f"s{k}.parquet", [i for i, _ in rows], [t for _, t in rows])
        ids_by_shard[str(path)] = [i for i, _ in rows]
    return ids_by_shard


# --- crash and resume --------------------------------------------------------------------
SHARDS = st.lists(
    st.lists(st.tuples(st.one_of(st.sampled_from(["r1", "r2"]), st.uuids().map(str), st.none()), GOOD_OR_BAD),
             min_size=1, max_size=4),
    min_size=2, max_size=4,
)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(shards=SHARDS, bad_file=st.booleans(), data=st.data())
def test_property_resume_after_a_crash_keeps_every_row_exactly_once(tiny_model, tmp_path_factory, shards, bad_file, data):
    """In-process FnApiRunner: shards mixing good and bad rows (and rows the engine fails on),
    maybe an unreadable file skipped with --skip-bad-files; the job crashes after n input files
    are complete with the next one half written; --resume finishes it with every input row
    (and the skipped file) exactly once in generations or dead_letter."""
    folder = tmp_path_factory.mktemp("resume")
    ids_by_shard = write_shards(folder, shards)
    extra = []
    if bad_file:
        (folder / "s-bad.parquet").write_bytes(b"not parquet at all")
        ids_by_shard[str(folder / "s-bad.parquet")] = [None]  # one file-level dead letter
        extra = ["--skip-bad-files"]
    n = data.draw(st.integers(0, len(ids_by_shard) - 1), label="complete input files before the crash")
    out, left, summary = crash_then_resume(tiny_model, folder, n, extra, factory=poisoned_factory)
    assert len(left) == n  # one worker writes files one by one: exactly n complete at the crash
    got, expected = conserved(ids_by_shard, out)
    assert got == expected
    assert summary["resume"] == {"resumed": True, "files_already_complete": n, "files_processed": len(ids_by_shard) - n,
                                 "files_changed_since": [], "complete_files_kept_from_other_inputs": 0}
    assert set(markers(out)) == set(ids_by_shard)
    assert summary["totals"]["num_records"] == sum(len(rows) for rows in shards)
    metrics = read_folder(out, "shard_metrics")
    assert sorted(m["shard"] for m in metrics) == sorted(str(folder / f"s{k}.parquet") for k in range(len(shards)))


MP_FLAGS = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(shards=SHARDS, data=st.data())
def test_property_multi_processing_crash_and_resume_keep_every_row_exactly_once(tiny_model, tmp_path_factory, monkeypatch, shards, data):
    """The same conservation property with two worker processes (DirectRunner multi_processing),
    for the crashed run and the resumed one: engine calls mixing shards (--batch-scope global),
    rows the engine fails on, a crash in a worker as the (n+1)-th input file is written."""
    from pipeline_support import CrashAtFileWrite

    # the workers unpickle the fault-injecting factory and hook from the tests folder
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    folder = tmp_path_factory.mktemp("resume-mp")
    ids_by_shard = write_shards(folder, shards)
    n = data.draw(st.integers(0, len(shards) - 1), label="input files written before the crash")
    out = folder / "out"
    args = base_args(tiny_model, out, str(folder / "*.parquet")) + [
        "--max-new-tokens", "2", "--rows-per-call", "4", "--batch-scope", "global", *MP_FLAGS]
    with pytest.raises(Exception, match="injected crash"):
        cli.run(args, generator_factory=poisoned_factory, on_progress=CrashAtFileWrite(folder / "tokens", n))
    writers = {int(t.read_text()) for t in (folder / "tokens").iterdir()}
    assert os.getpid() not in writers  # the files were written in worker processes
    left = markers(out)
    assert len(left) <= n
    before = snapshot(out)
    summary = cli.run(args + ["--resume"], generator_factory=poisoned_factory)
    assert all(before[f] == snapshot(out)[f] for m in left.values() for f in m.files(str(out)))
    got, expected = conserved(ids_by_shard, out)
    assert got == expected
    assert summary["resume"]["files_already_complete"] == len(left)
    assert summary["resume"]["files_processed"] == len(shards) - len(left)
    assert set(markers(out)) == set(ids_by_shard)
    assert summary["totals"]["num_records"] == sum(len(rows) for rows in shards)


def start_job(args: list[str]) -> subprocess.Popen:
    """`python -m pipelines.generate ARGS` in a process group of its own (kill it with killpg)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "pipelines.generate", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def kill_after_markers(job: subprocess.Popen, out: Path, k: int, delay_s: float, timeout_s: float = 240) -> None:
    """SIGKILL the job's whole process group (launcher and worker processes) `delay_s` after
    its k-th input file is complete, wherever generation then is."""
    deadline = time.monotonic() + timeout_s
    while len(list((out / "_complete").glob("*.json"))) < k:
        assert job.poll() is None, f"the job ended before {k} input files were complete: {job.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.02)
    time.sleep(delay_s)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    job.stderr.close()


@pytest.mark.parametrize("mode", ["in_memory", "multi_processing"])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(shards=st.lists(st.lists(GOOD_OR_BAD, min_size=2, max_size=3), min_size=2, max_size=3), data=st.data())
def test_property_a_job_killed_during_generation_resumes_redoing_only_unfinished_files(
        tiny_model, tmp_path_factory, mode, shards, data):
    """`kill -9` of the whole job (launcher and workers) at a random moment of generation: input
    files finished before it keep their outputs, `--resume` reads and generates only the
    unfinished files' rows, and every row ends up exactly once in generations or dead_letter.
    A local runner commits the job in parts of whole shards of at least --rows-per-call rows per
    worker (here 1 x 2 at most: every file is a part of its own), so files complete while later
    ones are still generating; a long last file keeps the job busy until the kill."""
    folder = tmp_path_factory.mktemp(f"kill-{mode}")
    ids_by_shard = write_shards(folder, [[(f"s{k}-{i}", text) for i, text in enumerate(rows)] for k, rows in enumerate(shards)])
    last = write_raw_shard(folder / "z-last.parquet", [f"z{i}" for i in range(40)], [sentence(i, 8) for i in range(40)])
    ids_by_shard[str(last)] = [f"z{i}" for i in range(40)]
    rows = {shard: len(ids) for shard, ids in ids_by_shard.items()}
    out = folder / "out"
    flags = MP_FLAGS if mode == "multi_processing" else []
    args = base_args(tiny_model, out, str(folder / "*.parquet")) + ["--max-new-tokens", "8", "--rows-per-call", "1", *flags]
    k = data.draw(st.integers(1, len(shards)), label="input files complete before the kill")
    delay_s = data.draw(st.floats(0, 0.3), label="seconds after that")
    kill_after_markers(start_job(args), out, k, delay_s)

    left = markers(out)
    assert k <= len(left) < len(rows)  # committed part by part, and killed before the end
    assert not (out / "run_summary.json").exists()  # the folder does not claim a finished run
    before = snapshot(out)
    summary = cli.run(args + ["--resume"])
    assert all(before[f] == snapshot(out)[f] for m in left.values() for f in m.files(str(out)))
    unfinished = set(rows) - set(left)
    assert summary["resume"]["files_already_complete"] == len(left)
    assert summary["resume"]["files_processed"] == len(unfinished)
    assert summary["beam_counters"].get("dspark.rows_read", 0) == sum(rows[s] for s in unfinished)  # rows redone
    got, expected = conserved(ids_by_shard, out)
    assert got == expected
    assert summary["totals"]["num_records"] == sum(rows.values())


LOADS: list[str] = []


def counting_factory(spec):
    LOADS.append(spec.target)
    return build_generator(spec)


def test_a_run_in_parts_loads_the_model_once_per_process(tiny_model, tmp_path):
    """In-process runner, one file per part (--rows-per-call 1): three pipelines, one model load;
    a second run loads its own."""
    for k in range(3):
        write_shard(tmp_path / f"s{k}.parquet", [{"id": f"{k}-{i}", "text": sentence(i)} for i in range(2)])
    args = base_args(tiny_model, tmp_path / "out", str(tmp_path / "*.parquet")) + ["--rows-per-call", "1", "--max-new-tokens", "2"]
    LOADS.clear()
    summary = cli.run(args, generator_factory=counting_factory)
    assert len(LOADS) == 1 and summary["totals"]["num_ok"] == 6
    assert summary["beam_counters"]["dspark.shards_written"] == 3  # summed over the three parts
    cli.run(args, generator_factory=counting_factory)
    assert len(LOADS) == 2


def test_partial_shard_is_redone_and_stray_files_removed(tiny_model, tmp_path):
    """A shard whose data files exist but whose marker does not (a crash between the two), a
    torn temporary file and a stray part file from an older layout: --resume redoes that shard
    and removes the rest, and the outputs equal a clean run's."""
    for k in range(3):
        write_shard(tmp_path / f"p{k}.parquet", [{"id": f"p{k}-{i}", "text": sentence(800 + 10 * k + i)} for i in range(3)])
    out = tmp_path / "out"
    args = base_args(tiny_model, out, str(tmp_path / "*.parquet"))
    cli.run(args)
    clean = sorted((g["id"], g["output"]) for g in read_folder(out, "generations"))
    partial = str(tmp_path / "p1.parquet")
    name = O.output_name(partial)
    (out / "_complete" / f"{name}.json").unlink()
    (out / "generations" / f"{name}.parquet.tmp-deadbeef").write_bytes(b"PAR1 torn")
    (out / "generations" / "part-00000.parquet").write_bytes((out / "generations" / f"{name}.parquet").read_bytes())
    summary = cli.run(args + ["--resume"])
    assert summary["resume"]["files_already_complete"] == 2 and summary["resume"]["files_processed"] == 1
    assert sorted((g["id"], g["output"]) for g in read_folder(out, "generations")) == clean
    assert sorted(p.name for p in (out / "generations").iterdir()) == sorted(
        f"{O.output_name(str(tmp_path / f'p{k}.parquet'))}.parquet" for k in range(3)
    )


def test_resume_with_everything_complete_loads_no_model(tiny_model, tmp_path):
    write_shard(tmp_path / "a.parquet", [{"id": "a", "text": sentence(1)}, {"id": "b", "text": None}])
    out = tmp_path / "out"
    args = base_args(tiny_model, out, str(tmp_path / "*.parquet"))
    first = cli.run(args)
    again = cli.run(args + ["--resume"], generator_factory=never_load)
    this_run = ("job_wall_s", "model_load_s", "engine_wall_s", "run_output_tokens", "tokens_per_s", "engine_tokens_per_s")
    assert again["resume"]["files_processed"] == 0 and again["totals"] == first["totals"] | {
        k: again["totals"][k] for k in this_run
    }
    # nothing generated, so no speed: earlier tokens over this run's few milliseconds are no rate
    assert again["totals"]["run_output_tokens"] == 0 and again["totals"]["model_load_s"] == 0
    assert again["totals"]["tokens_per_s"] is None and again["totals"]["engine_tokens_per_s"] is None
    assert read_summary(out)["resume"]["files_already_complete"] == 1


def test_resume_refuses_outputs_of_other_settings_and_a_plain_rerun_replaces_them(tiny_model, tmp_path, capsys):
    write_shard(tmp_path / "a.parquet", [{"id": f"a{i}", "text": sentence(i)} for i in range(2)])
    write_shard(tmp_path / "b.parquet", [{"id": "b0", "text": sentence(5)}])
    out = tmp_path / "out"
    args = base_args(tiny_model, out, str(tmp_path / "*.parquet"))
    cli.run(args)
    with pytest.raises(O.ResumeError, match=r"decode.max_new_tokens: 6 -> 3"):
        cli.run(args + ["--max-new-tokens", "3", "--resume"], generator_factory=never_load)
    assert cli.main(args + ["--max-new-tokens", "3", "--resume"]) == 2  # the CLI: a message, exit status 2
    assert "error: --resume: the outputs of" in capsys.readouterr().err
    cli.run(args + ["--max-new-tokens", "3", "--limit-per-shard", "1"])  # no --resume: everything replaced
    assert sorted(g["id"] for g in read_folder(out, "generations")) == ["a0", "b0"]
    assert all(g["num_output_tokens"] <= 3 for g in read_folder(out, "generations"))
    # a shard whose rows changed since its marker was written is processed again
    write_shard(tmp_path / "b.parquet", [{"id": "b0", "text": sentence(5)}, {"id": "b1", "text": sentence(6)}])
    summary = cli.run(args + ["--max-new-tokens", "3", "--limit-per-shard", "1", "--resume"])
    # b's first row is unchanged, but the file is not: it is generated again (its size and footer changed)
    assert summary["resume"]["files_already_complete"] == 1
    assert summary["resume"]["files_changed_since"] == [str(tmp_path / "b.parquet")]
    summary = cli.run(args + ["--max-new-tokens", "3", "--limit-per-shard", "2", "--resume"])
    assert (summary["resume"]["files_already_complete"], summary["resume"]["files_processed"]) == (0, 2)
    assert sorted(g["id"] for g in read_folder(out, "generations")) == ["a0", "a1", "b0", "b1"]


def test_skipped_files_are_accounted_for_once_across_resumes(tiny_model, tmp_path):
    write_shard(tmp_path / "a.parquet", [{"id": "a0", "text": sentence(1)}])
    (tmp_path / "bad.parquet").write_text("not parquet")
    out = tmp_path / "out"
    args = base_args(tiny_model, out, str(tmp_path / "*.parquet")) + ["--skip-bad-files"]
    cli.run(args)
    cli.run(args + ["--resume"], generator_factory=never_load)
    dead = read_folder(out, "dead_letter")
    assert [(Path(d["shard"]).name, d["error_type"]) for d in dead] == [("bad.parquet", ErrorType.FILE_UNREADABLE)]


# --- output paths stay inside DIR --------------------------------------------------------
@given(st.text(min_size=0, max_size=60))
def test_output_names_are_plain_file_names(shard):
    name = O.output_name(shard)
    assert name and not name.startswith(".") and set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
    for folder in FOLDERS:
        path = O.data_file("gs://bucket/run", folder, name)
        assert path == f"gs://bucket/run/{folder}/{name}.parquet"
    assert O.marker_file("/data/out/", name) == f"/data/out/_complete/{name}.json"


@pytest.mark.parametrize("shard", ["../../etc/passwd.parquet", "gs://b/x/../../..", "..", "a/..\\..\\evil.parquet", "x\x00.parquet"])
def test_hostile_shard_names_stay_inside(shard):
    name = O.output_name(shard)
    path = O.data_file("/out", "generations", name)
    assert os.path.normpath(path).startswith("/out/generations/") and ".." not in name.split(".")[0:1]
    assert O.output_name(shard) != O.output_name(shard + "x")  # the path's hash keeps names apart


@pytest.mark.parametrize("part", ["..", ".", "", "a/b", "..\\x", "x\x00"])
def test_inside_refuses_parts_that_could_leave(part):
    with pytest.raises(ValueError, match="could leave the output folder"):
        O.inside("/out", "generations", part)


def test_a_shard_reached_through_dot_dot_writes_only_under_the_output_folder(tiny_model, tmp_path):
    """The input glob goes through '..' and the shard's own name is hostile: every file the job
    writes is under DIR, in its folders, with a safe name."""
    (tmp_path / "in").mkdir()
    write_shard(tmp_path / "in" / ".. ..;$(touch pwned).parquet", [{"id": "x", "text": sentence(3)}, {"id": "y", "text": ""}])
    before = {p for p in tmp_path.rglob("*")}
    out = tmp_path / "in" / "out"
    cli.run(base_args(tiny_model, out, str(tmp_path / "in" / ".." / "in" / "*.parquet")))
    new = {p for p in tmp_path.rglob("*")} - before
    assert new and all(p == out or out in p.parents for p in new), sorted(map(str, new))
    names = {p.relative_to(out).as_posix() for p in new if p.is_file()}
    stem = O.output_name(next(iter(read_folder(out, "generations")))["shard"])
    assert names == {f"generations/{stem}.parquet", f"dead_letter/{stem}.parquet", f"shard_metrics/{stem}.parquet",
                     f"_complete/{stem}.json", "run_summary.json", "report.md", "report_shards.png",
                     "report_acceptance_by_position.png"}
    assert stem.startswith("touch_pwned-")


# --- pure planning -----------------------------------------------------------------------
def test_plan_resume_keeps_matching_markers_only():
    ident = O.shard_identity(3, (2, 1))
    ms = [O.Marker("a", ident, {"k": 1}, {"generations": 3}), O.Marker("b", O.shard_identity(4, (4,)), {"k": 1}, {}),
          O.Marker("old", ident, {"k": 1}, {})]
    plan = O.plan_resume(ms, {"a": ident, "b": O.shard_identity(5, (5,)), "c": ident}, {"k": 1})
    assert (plan.complete, plan.todo, plan.kept_other) == (["a"], ["b", "c"], ["old"])
    with pytest.raises(O.ResumeError, match="k: 1 -> 2"):
        O.plan_resume(ms, {"a": ident}, {"k": 2})
    assert O.Marker.from_json(ms[0].to_json()) == ms[0]


def test_poison_rows_in_resumed_shards_are_still_generation_errors(tiny_model, tmp_path):
    write_raw_shard(tmp_path / "q0.parquet", ["ok", "bad"], [sentence(1), f"{POISON} {sentence(2)}"])
    write_raw_shard(tmp_path / "q1.parquet", ["ok2"], [sentence(3)])
    out, _, _ = crash_then_resume(tiny_model, tmp_path, 1, factory=poisoned_factory)
    assert [(d["id"], d["error_type"]) for d in read_folder(out, "dead_letter")] == [("bad", ErrorType.GENERATION_ERROR)]
    assert sorted(g["id"] for g in read_folder(out, "generations")) == ["ok", "ok2"]
