"""End-to-end tests of `python -m pipelines.generate` on the DirectRunner with a tiny random
Llama target (2 layers, its own 512-token BPE vocabulary, float32, greedy).

One job over three shards is run once per module and checked from several sides: the output
contract, conservation of rows, per-shard metrics against the generations, and equality with
the engine called directly. Further jobs cover reruns, multi-processing workers, Dataflow
construction and the no-argument default (embedded model)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_support import (  # noqa: E402
    build_tiny_model_dir,
    folder_columns,
    read_folder,
    read_summary,
    write_shard,
    TINY_NAME,
)

from pipelines import generate as cli
from transforms import outputs as O  # noqa: E402
from transforms.schema import DEAD_LETTER_COLUMNS, GENERATION_COLUMNS, SHARD_METRIC_COLUMNS, ErrorType  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 6
TEMPLATE = "Task ({domain}): {text}"
WORDS = ("the quick brown fox jumps over a lazy dog while seven cats count stars near the river bank "
         "and write short notes about numbers code tests summaries").split()


def sentence(seed: int, n: int = 12) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=n)).capitalize() + "."


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("models") / TINY_NAME)


def base_args(model: Path, output: Path, input_glob: str) -> list[str]:
    return [
        "--input", input_glob, "--output", str(output), "--target", str(model), "--dtype", "float32",
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "4", "--rows-per-call", "5", "--no-progress",
    ]


def main_shards(folder: Path) -> dict[str, list[dict]]:
    """Three shards: plain rows, a shard with a duplicate id and one empty text, a small one."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = {
        "a.parquet": [{"id": f"a{i}", "text": sentence(i), "domain": "math"} for i in range(7)],
        "b.parquet": [{"id": f"b{i}", "text": sentence(100 + i), "domain": "chat"} for i in range(4)]
        + [{"id": "b1", "text": sentence(200), "domain": "chat"}, {"id": "b9", "text": "", "domain": "chat"}],
        "c.parquet": [{"id": f"c{i}", "text": sentence(300 + i, 20), "domain": "code"} for i in range(3)],
    }
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("domain", pa.string())])
    for name, rows in shards.items():
        write_shard(folder / name, rows, schema, row_group_size=4)  # several row groups per shard
    return {str(folder / name): rows for name, rows in shards.items()}


@pytest.fixture(scope="module")
def main_job(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("main_job")
    shards = main_shards(root / "in")
    out = root / "out"
    args = base_args(tiny_model, out, str(root / "in" / "*.parquet")) + [
        "--prompt-template", TEMPLATE, "--keep-columns", "domain",
    ]
    summary = cli.run(args)
    # kept now: a later test reruns into the same folder
    generations = collections.Counter((g["shard"], g["id"], g["output"]) for g in read_folder(out, "generations"))
    return {"root": root, "out": out, "shards": shards, "summary": summary, "args": args, "generations": generations}


def test_output_contract(main_job):
    out = main_job["out"]
    assert (out / "run_summary.json").is_file()
    for folder, columns in [
        ("generations", [*GENERATION_COLUMNS, "domain"]),
        ("shard_metrics", list(SHARD_METRIC_COLUMNS)),
        ("dead_letter", list(DEAD_LETTER_COLUMNS)),
    ]:
        found = folder_columns(out, folder)
        assert found and all(names == columns for names in found), (folder, found)
    summary = read_summary(out)
    assert set(summary) >= {"totals", "config", "versions", "beam_counters"}
    assert summary["config"]["max_new_tokens"] == MAX_NEW_TOKENS
    assert summary["versions"]["apache-beam"] and summary["versions"]["torch"]
    gens = read_folder(out, "generations")
    assert all(g["domain"] == next(r for r in main_job["shards"][g["shard"]] if r["id"] == g["id"])["domain"] for g in gens)
    assert all(g["finish_reason"] in ("eos", "length", "stop") for g in gens)
    assert all(1 <= g["num_output_tokens"] <= MAX_NEW_TOKENS for g in gens)


def test_every_row_exactly_once(main_job):
    out = main_job["out"]
    expected = collections.Counter((shard, r["id"]) for shard, rows in main_job["shards"].items() for r in rows)
    gens = read_folder(out, "generations")
    dead = read_folder(out, "dead_letter")
    got = collections.Counter([(g["shard"], g["id"]) for g in gens] + [(d["shard"], d["id"]) for d in dead])
    assert got == expected
    assert [(Path(d["shard"]).name, d["id"], d["error_type"]) for d in dead] == [("b.parquet", "b9", ErrorType.EMPTY_TEXT)]


def test_shard_metrics_match_generations(main_job):
    out = main_job["out"]
    gens = read_folder(out, "generations")
    dead = read_folder(out, "dead_letter")
    metrics = {m["shard"]: m for m in read_folder(out, "shard_metrics")}
    assert set(metrics) == set(main_job["shards"])
    for shard, rows in main_job["shards"].items():
        m, mine = metrics[shard], [g for g in gens if g["shard"] == shard]
        assert m["num_records"] == len(rows) == m["num_ok"] + m["num_failed"]
        assert m["num_ok"] == len(mine)
        assert m["num_failed"] == sum(d["shard"] == shard for d in dead)
        assert m["num_duplicate_ids"] == len(rows) - len({r["id"] for r in rows})
        assert m["output_tokens"] == sum(g["num_output_tokens"] for g in mine)
        latencies = [g["latency_s"] for g in mine]
        assert m["p50_latency_s"] == pytest.approx(np.percentile(latencies, 50))
        assert m["p99_latency_s"] == pytest.approx(np.percentile(latencies, 99))
        assert m["wall_s"] >= max(latencies) > 0
        assert m["tokens_per_s"] == pytest.approx(m["output_tokens"] / m["wall_s"])
        # a ratio of sums lies within the per-row ratios
        taus = [g["mean_accepted_length"] for g in mine if g["num_output_tokens"] > 1]
        assert min(taus) - 1e-9 <= m["mean_accepted_length"] <= max(taus) + 1e-9
        if torch.cuda.is_available():  # device "auto" ran the job on the GPU: NVML readings
            assert m["device"] == torch.cuda.get_device_name()
            assert 0.0 <= m["gpu_util_mean"] <= 1.0 and m["gpu_mem_peak_bytes"] > 0
        else:
            assert m["device"] and m["gpu_util_mean"] is None and m["gpu_mem_peak_bytes"] is None
        assert m["rss_peak_bytes"] > 0
        assert m["dtype"] == "float32"  # the job ran with --dtype float32
    assert metrics[str(main_job["root"] / "in" / "b.parquet")]["num_duplicate_ids"] == 1
    totals = read_summary(out)["totals"]
    assert totals["num_records"] == sum(len(r) for r in main_job["shards"].values())
    assert totals["output_tokens"] == sum(g["num_output_tokens"] for g in gens)
    assert totals["dtype"] == "float32"
    counters = read_summary(out)["beam_counters"]
    assert counters["dspark.rows_read"] == totals["num_records"]
    assert counters["dspark.output_tokens"] == totals["output_tokens"]
    # where the run's time went: loading the model (once per worker process) apart from generating
    assert totals["run_output_tokens"] == totals["output_tokens"]
    assert 0 < totals["model_load_s"] == counters["dspark.model_load_ms"] / 1000
    assert 0 < totals["engine_wall_s"] == pytest.approx(sum(m["wall_s"] for m in metrics.values()))
    assert totals["engine_tokens_per_s"] == pytest.approx(totals["output_tokens"] / totals["engine_wall_s"])
    assert totals["tokens_per_s"] == pytest.approx(totals["output_tokens"] / totals["job_wall_s"])


def test_health_signals_recomputed_from_each_shards_counters(main_job):
    """confidence_entropy and acceptance_by_position per shard and for the run follow from the
    summed counters each shard's completion marker holds; the health block lists exactly the
    shards whose signals exceed the thresholds."""
    from transforms.health import HealthThresholds

    out = main_job["out"]
    metrics = {m["shard"]: m for m in read_folder(out, "shard_metrics")}
    markers = {m.shard: m.spec for m in O.read_markers(str(out))}
    assert any(spec["confidences"] for spec in markers.values())  # some ngram drafts were verified
    for shard, m in metrics.items():
        spec = markers[shard]
        if spec["confidences"]:
            assert m["confidence_entropy"] == pytest.approx(spec["entropy_bits"] / spec["confidences"])
            assert 0 < m["confidence_entropy"] <= 1
        else:  # no draft verified in this shard: no signal, and nothing to check
            assert m["confidence_entropy"] is None and spec["verified"] == 0
        assert m["acceptance_by_position"] == pytest.approx(
            [a / n if n else None for a, n in zip(spec["position_accepts"], spec["position_attempts"])])
        assert len(m["acceptance_by_position"]) == len(spec["position_attempts"]) and sum(spec["position_attempts"]) <= spec["verified"]
        assert m["gpu_mem_fragmentation_peak"] is None or 0 <= m["gpu_mem_fragmentation_peak"] <= 1
    summary = read_summary(out)
    totals = summary["totals"]
    assert totals["confidence_entropy"] == pytest.approx(
        sum(s["entropy_bits"] for s in markers.values()) / sum(s["confidences"] for s in markers.values()))
    health, limits = summary["health"], HealthThresholds()
    assert health["thresholds"] == {"max_correction_rate": limits.max_correction_rate,
                                    "max_confidence_entropy": limits.max_confidence_entropy,
                                    "max_gpu_mem_fragmentation": limits.max_gpu_mem_fragmentation}
    expected = [(shard, "correction_rate") for shard, m in metrics.items()
                if m["correction_rate"] is not None and m["correction_rate"] > limits.max_correction_rate]
    expected += [(shard, "confidence_entropy") for shard, m in metrics.items()
                 if m["confidence_entropy"] is not None and m["confidence_entropy"] > limits.max_confidence_entropy]
    assert sorted((b["shard"], b["signal"]) for b in health["shards"]) == sorted(expected)
    assert health["ok"] == (not expected and not health["run"])


def test_run_report_shows_every_shard_health_and_plots(main_job):
    """OUT/report.md: the closing line, the health status, one table row per shard (the numbers
    of shard_metrics) and the two plots, written beside run_summary.json."""
    out = main_job["out"]
    report = (out / "report.md").read_text()
    summary = read_summary(out)
    assert report.startswith("# DSpark run report\n\nDone in ")
    assert ("**Health**: healthy" in report) == summary["health"]["ok"]
    for m in read_folder(out, "shard_metrics"):
        row = next(line for line in report.splitlines() if line.startswith(f"| `{Path(m['shard']).name}` |"))
        assert row.split(" | ")[1:4] == [str(m["num_records"]), str(m["num_ok"]), str(m["num_failed"])]
        assert f"{m['tokens_per_s']:.1f}" in row
    for png in ("report_shards.png", "report_acceptance_by_position.png"):
        assert f"]({png})" in report and (out / png).read_bytes().startswith(b"\x89PNG")


@pytest.fixture
def root_logging():
    """cli.main configures logging onto this test's captured stderr: put the handlers back after."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_fail_on_health_exits_3_after_writing_everything(main_job, tmp_path, capsys, root_logging):
    out = tmp_path / "out"
    args = main_job["args"][: main_job["args"].index("--output")] + ["--output", str(out)] + main_job["args"][main_job["args"].index("--output") + 2:]
    assert cli.main(args + ["--health-max-confidence-entropy", "0"]) == 0  # warns only
    assert cli.main(args + ["--health-max-confidence-entropy", "0", "--fail-on-health"]) == 3
    err = capsys.readouterr().err
    assert "error: Health: " in err and "confidence_entropy" in err and "--fail-on-health" in err
    summary = read_summary(out)
    assert not summary["health"]["ok"] and summary["totals"]["num_records"] == main_job["summary"]["totals"]["num_records"]


def test_outputs_equal_the_engines_greedy_outputs(main_job, tiny_model):
    from dspark.generator import DSparkGenerator

    gen = DSparkGenerator.from_names(str(tiny_model), drafter="ngram", scheduler="dspark", dtype="float32", max_batch_size=4)
    rows = [r for rows in main_job["shards"].values() for r in rows if r["text"]]
    prompts = [TEMPLATE.format(text=r["text"], domain=r["domain"]) for r in rows]
    results = gen.generate(prompts, max_new_tokens=MAX_NEW_TOKENS)
    expected = collections.Counter((r["id"], res.text, res.num_output_tokens, res.num_prompt_tokens) for r, res in zip(rows, results))
    gens = read_folder(main_job["out"], "generations")
    got = collections.Counter((g["id"], g["output"], g["num_output_tokens"], g["num_prompt_tokens"]) for g in gens)
    assert got == expected
    assert len({g["output"] for g in gens}) > 1  # the prompts really reach the model


def test_rerun_is_deterministic_and_replaces_old_outputs(main_job, tiny_model):
    """A second run into the same folder over fewer rows (one shard, its first 5 rows: all of its
    first row group and one row of the second) leaves only the new rows, with the same outputs."""
    out = main_job["out"]
    before = {(g["shard"], g["id"]): g["output"] for g in read_folder(out, "generations")}
    only_a = str(main_job["root"] / "in" / "a.parquet")
    args = base_args(tiny_model, out, only_a) + ["--prompt-template", TEMPLATE, "--keep-columns", "domain",
                                                 "--limit-per-shard", "5"]
    cli.run(args)
    after = {(g["shard"], g["id"]): g["output"] for g in read_folder(out, "generations")}
    assert after == {(only_a, f"a{i}"): before[(only_a, f"a{i}")] for i in range(5)}
    assert read_folder(out, "dead_letter") == []
    assert [(m["shard"], m["num_records"]) for m in read_folder(out, "shard_metrics")] == [(only_a, 5)]


def test_multi_processing_workers_crash_resume_and_global_batches_give_the_same_outputs(main_job, tiny_model, tmp_path, monkeypatch):
    """Two worker processes and engine calls that mix shards (--batch-scope global); the job
    crashes in a worker once one shard is complete (the next one half written) and --resume
    finishes it: every row exactly once, same outputs. (The resumed run is in-process: which
    files to redo is decided by the launcher, and a second start of worker processes would
    double this test's time.)"""
    from pipeline_support import CrashAfterShards

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "out"
    args = base_args(tiny_model, out, str(main_job["root"] / "in" / "*.parquet")) + [
        "--prompt-template", TEMPLATE, "--direct_running_mode=multi_processing", "--direct_num_workers=2",
        "--batch-scope", "global", "--rows-per-call", "8",
    ]
    with pytest.raises(Exception, match="injected crash"):
        cli.run(args, on_progress=CrashAfterShards(tmp_path / "tokens", 1))
    complete = len(list((out / "_complete").glob("*.json")))
    in_process = [a for a in args if not a.startswith("--direct_")]
    summary = cli.run(in_process + ["--resume"])
    assert 1 <= summary["resume"]["files_already_complete"] == complete < 3
    gens = read_folder(out, "generations")
    dead = read_folder(out, "dead_letter")
    expected = collections.Counter((shard, r["id"]) for shard, rows in main_job["shards"].items() for r in rows)
    assert collections.Counter([(g["shard"], g["id"]) for g in gens] + [(d["shard"], d["id"]) for d in dead]) == expected
    reference = main_job["generations"]
    assert collections.Counter((g["shard"], g["id"], g["output"]) for g in gens) == reference
    metrics = read_folder(out, "shard_metrics")
    assert sum(m["num_records"] for m in metrics) == sum(expected.values())
    assert sum(m["output_tokens"] for m in metrics) == sum(g["num_output_tokens"] for g in gens)
    assert all(m["wall_s"] > 0 and m["tokens_per_s"] == pytest.approx(m["output_tokens"] / m["wall_s"]) for m in metrics)


def test_pipeline_constructs_for_dataflow_without_submitting(monkeypatch):
    """Option parsing and graph construction with Dataflow options (nothing is submitted)."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions, WorkerOptions
    from transforms import launch, preflight

    fake = preflight.Preflight(
        shards=[preflight.ShardFile("gs://bucket/in/s-0.parquet", 10, (10,))],
        column_types={"id": pa.string(), "text": pa.string()},
    )
    monkeypatch.setattr(launch, "check_inputs", lambda *a, **k: fake)
    options, flags = cli.resolve_options([
        "--input", "gs://bucket/in/*.parquet", "--output", "gs://bucket/out", "--runner", "DataflowRunner",
        "--project", "demo-project", "--region", "us-central1", "--temp_location", "gs://bucket/tmp",
        "--sdk_container_image", "us-docker.pkg.dev/demo/dspark/worker:2.77.0",
        "--dataflow_service_options=worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver",
        "--machine_type", "g2-standard-8", "--experiments=no_use_multiple_sdk_containers",
    ])
    p, pre, job = cli.build_pipeline(options, flags)
    assert type(p.runner).__name__ == "DataflowRunner"
    assert p.options.view_as(GoogleCloudOptions).project == "demo-project"
    assert p.options.view_as(WorkerOptions).machine_type == "g2-standard-8"
    names = {t.unique_name for t in p.to_runner_api().components.transforms.values()}
    assert {"DSpark/ReadRowGroups", "DSpark/Generate", "DSpark/WriteShardOutputs", "DSpark/PerShard"} <= names


def test_remote_runner_refuses_local_paths():
    options, flags = cli.resolve_options(["--runner", "DataflowRunner", "--output", "gs://b/out"])
    with pytest.raises(cli.ConfigError, match="cannot read local paths"):
        cli.build_pipeline(options, flags)


@pytest.mark.embedded
def test_no_argument_default_end_to_end(tmp_path):
    """`python -m pipelines.generate` as shipped (embedded SmolLM2 target, bundled shards, DSpark
    scheduler, ./out), with shorter generations and the first 2 rows of each shard so that it
    stays quick on a shared CPU."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.generate", "--max-new-tokens", "16", "--limit-per-shard", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"  # the default output folder, under the working directory
    gens, dead = read_folder(out, "generations"), read_folder(out, "dead_letter")
    import pyarrow.parquet as pq

    inputs = [r for f in sorted((REPO / "data" / "sample_shards").glob("*.parquet")) for r in pq.read_table(f).to_pylist()[:2]]
    assert len(inputs) == 8
    assert sorted(g["id"] for g in gens) + sorted(d["id"] for d in dead) == sorted(r["id"] for r in inputs)
    assert dead == []
    assert all(g["output"].strip() and g["num_output_tokens"] >= 1 for g in gens)
    summary = read_summary(out)
    assert summary["config"]["target"] == "smollm2-135m-instruct" and summary["config"]["scheduler"] == "dspark"
    assert summary["config"]["drafter"] == "auto"
    assert "Drafter auto -> dspark" in proc.stderr  # the shipped checkpoint: the default config uses it
    assert summary["totals"]["num_shards"] == 4 and summary["totals"]["mean_accepted_length"] >= 1.0
    assert "Done in" in proc.stderr
