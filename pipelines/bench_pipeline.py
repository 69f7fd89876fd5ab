"""Benchmark of the Beam pipeline: tokens/s with the `dspark` scheduler vs `ar` (no
speculation) at batch 16, and the pipeline's overhead over calling the engine directly on the
same prompts.

    python -m pipelines.bench_pipeline                      # 4 shards x 16 prompts, 256 new tokens, batch 16
    python -m pipelines.bench_pipeline --max-new-tokens 1024 --dtype float32 --out runs/bench-1024

What it does:
  1. builds Parquet shards from the bundled prompt sets (data/prompts): the
     drafter's evaluation split of each file (`dspark.training.data.split_of`, so prompts the
     shipped drafter was trained or calibrated on never appear), mixed domains, deterministic;
  2. runs `python -m pipelines.generate` on them (DirectRunner, in this process) once per
     scheduler, same target, drafter, dtype, batch size and max_new_tokens;
  3. calls `DSparkGenerator.generate` directly on the same rendered prompts (one call, same
     batch size), timing model loading separately;
  4. with `--repeats N`, runs steps 2-3 N times, rotating their order so that load from other
     work on a shared machine hits every run alike; figures are per-field medians;
  5. writes OUT/bench.json (every repeat included) and prints a table.
Figures: `job tok/s` = output tokens / the whole job's wall time (model load, Beam, writes
included); `engine tok/s` = output tokens / time inside engine calls. speedup = dspark / ar;
overhead = pipeline job wall / (direct load + generate wall) - 1; outputs_equal_to_<s> = share
of rows whose output equals scheduler s's job (1.0 in float32; bfloat16 verify blocks flip near-ties).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dspark.training.data import split_of

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = Path("data/prompts")  # the bundled prompt sets, from the repository root
# (file, max characters of the first turn): short enough to keep CPU prefill cheap
SOURCES = (
    ("instructions.jsonl", 1000),
    ("gsm8k.jsonl", 1000),
    ("mbpp.jsonl", 1000),
    ("humaneval.jsonl", 1500),
    ("cnn_dailymail.jsonl", 3000),
    ("arena-hard-v2.jsonl", 1000),
)
LOG = logging.getLogger("pipelines.bench_pipeline")


def eval_split(record_id: str) -> bool:
    """The drafter's held-out evaluation split (dspark.training.data.split_of), so a
    `--drafter dspark` run never sees prompts its checkpoint was trained or calibrated on."""
    return split_of(record_id) == "eval"


def pick_prompts(prompts_dir: Path, total: int) -> list[dict]:
    """Round-robin over the sources' evaluation split, file order within each source."""
    pools = []
    for name, max_chars in SOURCES:
        rows = []
        if not (prompts_dir / name).is_file():
            raise FileNotFoundError(f"prompt file {prompts_dir / name} not found (--prompts: a folder of prompt sets, "
                                    "such as the bundled data/prompts)")
        with (prompts_dir / name).open(encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                if eval_split(r["id"]) and len(r["turns"][0]) <= max_chars:
                    rows.append({"id": r["id"], "text": r["turns"][0], "domain": r["domain"]})
        pools.append(rows)
    picked: list[dict] = []
    for i in range(max(len(p) for p in pools)):
        for pool in pools:
            if i < len(pool) and len(picked) < total:
                picked.append(pool[i])
    if len(picked) < total:
        raise SystemExit(f"only {len(picked)} prompts available; ask for fewer")
    return picked


def write_shards(rows: list[dict], folder: Path, num_shards: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(num_shards):
        path = folder / f"bench-{k:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[k::num_shards]), path)
        paths.append(path)
    return paths


def run_pipeline(args: argparse.Namespace, shards_glob: str, scheduler: str, out: Path) -> dict:
    from pipelines.generate import run

    argv = [
        "--input", shards_glob, "--output", str(out), "--target", args.target, "--drafter", args.drafter,
        "--scheduler", scheduler, "--dtype", args.dtype, "--batch-size", str(args.batch_size),
        "--rows-per-call", str(args.rows_per_call), "--batch-scope", args.batch_scope, "--max-new-tokens", str(args.max_new_tokens), "--no-progress",
    ]
    summary = run(argv)
    t = summary["totals"]
    return {
        "scheduler": scheduler,
        "rows": t["num_ok"],
        "output_tokens": t["output_tokens"],
        "job_wall_s": t["job_wall_s"],
        "job_tokens_per_s": t["tokens_per_s"],
        "engine_wall_s": t["engine_wall_s"],
        "engine_tokens_per_s": t["engine_tokens_per_s"],
        "mean_accepted_length": t["mean_accepted_length"],
        "acceptance_rate": t["acceptance_rate"],
        "failed": t["num_failed"],
    }


def run_direct(args: argparse.Namespace, rows: list[dict], scheduler: str) -> tuple[dict, list[str]]:
    from dspark.generator import DSparkGenerator

    started = time.perf_counter()
    gen = DSparkGenerator.from_names(args.target, drafter=args.drafter, scheduler=scheduler, dtype=args.dtype,
                                     max_batch_size=args.batch_size)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    results = gen.generate([r["text"] for r in rows], max_new_tokens=args.max_new_tokens)
    generate_s = time.perf_counter() - started
    tokens = sum(r.num_output_tokens for r in results)
    return {
        "scheduler": scheduler,
        "rows": len(results),
        "output_tokens": tokens,
        "load_s": load_s,
        "generate_s": generate_s,
        "tokens_per_s": tokens / generate_s,
        "tokens_per_s_with_load": tokens / (load_s + generate_s),
    }, [r.text for r in results]


def median_run(runs: list[dict]) -> dict:
    """Per-field median over repeats of one run (numbers only, missing values skipped; other
    fields from the first)."""
    out = dict(runs[0])
    for key in runs[0]:
        numbers = [r[key] for r in runs if isinstance(r[key], (int, float)) and not isinstance(r[key], bool)]
        if numbers:
            out[key] = statistics.median(numbers)
    out["repeats"] = len(runs)
    return out


def warm_up(args: argparse.Namespace) -> None:
    """Untimed: import torch/transformers, de-quantise and cache the target, profile the DSpark
    cost table, so that whichever run comes first does not pay these one-off costs."""
    from dspark.generator import DSparkGenerator

    started = time.perf_counter()
    for scheduler in args.schedulers:
        DSparkGenerator.from_names(args.target, drafter=args.drafter, scheduler=scheduler, dtype=args.dtype, max_batch_size=args.batch_size)
    LOG.info("Warm-up (imports, model cache, cost table) took %.1f s", time.perf_counter() - started)


def share_equal(ours: dict[str, str], theirs: dict[str, str]) -> float:
    """Share of our rows (by id) whose output is the same text in theirs (a missing row differs)."""
    return sum(theirs.get(i) == t for i, t in ours.items()) / len(ours) if ours else float("nan")


def pipeline_dir(args: argparse.Namespace, scheduler: str) -> Path:
    return args.out / f"pipeline-{scheduler.replace(':', '_')}"


def outputs_by_id(out: Path) -> dict[str, str]:
    from transforms.summary import read_output_table

    return {g["id"]: g["output"] for g in read_output_table(str(out), "generations")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipelines.bench_pipeline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                   help="folder of prompt .jsonl files (default: data/prompts, from the repository root)")
    p.add_argument("--shards", type=int, default=4, help="Parquet shards to build (default: 4)")
    p.add_argument("--rows-per-shard", type=int, default=16, help="prompts per shard (default: 16)")
    p.add_argument("--rows-per-call", type=int, default=64, help="rows per engine call in the pipeline (default: 64)")
    p.add_argument("--batch-scope", choices=["shard", "global"], default="global",
                   help="the pipeline's batching; global (default) fills engine calls across shards like the direct call")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default: 256")
    p.add_argument("--batch-size", type=int, default=16, help="rows decoded together (default: 16)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="target model (default: the embedded smollm2-135m-instruct)")
    p.add_argument("--drafter", default="ngram", help="drafter for every run, as in pipelines.generate (default: ngram)")
    p.add_argument("--dtype", default="auto", help="auto (default), float32, bfloat16, float16")
    p.add_argument("--schedulers", nargs="+", default=["dspark", "ar"], help="the first is compared with the others (default: dspark ar)")
    p.add_argument("--skip-direct", action="store_true", help="do not call the engine directly")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every job this many times, rotating their order; figures are per-field medians")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_pipeline",
                   help="output folder: shards, one pipeline output per scheduler, bench.json (default: runs/bench_pipeline)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    main_s = args.schedulers[0]
    from pipelines.generate import configure_logging

    configure_logging()

    warm_up(args)
    rows = pick_prompts(args.prompts, args.shards * args.rows_per_shard)
    paths = write_shards(rows, args.out / "shards", args.shards)
    shard_rows = [r for path in paths for r in pq.read_table(path).to_pylist()]  # pipeline order, for the direct call
    LOG.info("Benchmark shards: %d x %d prompts in %s", args.shards, args.rows_per_shard, args.out / "shards")

    runs = [f"pipeline {s}" for s in args.schedulers] + ([] if args.skip_direct else [f"direct {main_s}"])
    per_repeat: dict[str, list[dict]] = {name: [] for name in runs}
    got: dict[str, str] = {}
    direct_rows: list[dict] = []
    texts: list[str] = []
    for rep in range(args.repeats):
        # rotate the order each repeat, so load from other work hits every run alike
        for name in runs[rep % len(runs):] + runs[: rep % len(runs)]:
            kind, _, sched = name.partition(" ")
            LOG.info("Repeat %d/%d: %s", rep + 1, args.repeats, name)
            if kind == "pipeline":
                out = pipeline_dir(args, sched)
                per_repeat[name].append(run_pipeline(args, str(args.out / "shards" / "*.parquet"), sched, out))
                if sched == main_s and not got:
                    got = outputs_by_id(out)
            else:
                # rows the pipeline refused would fail the whole direct call; the main pipeline
                # runs first in repeat 1, so `got` is known by then
                direct_rows = direct_rows or [r for r in shard_rows if r["id"] in got]
                result, texts = run_direct(args, direct_rows, main_s)
                per_repeat[name].append(result)
    pipeline = {s: median_run(per_repeat[f"pipeline {s}"]) for s in args.schedulers}
    report: dict = {"config": {k: str(v) for k, v in vars(args).items()}, "pipeline": pipeline,
                    "repeats": per_repeat}
    for other in args.schedulers[1:]:
        report[f"speedup_{main_s}_vs_{other}"] = {
            "job": pipeline[main_s]["job_tokens_per_s"] / pipeline[other]["job_tokens_per_s"],
            "engine": pipeline[main_s]["engine_tokens_per_s"] / pipeline[other]["engine_tokens_per_s"],
        }
        # lossless in float32; in bfloat16 a multi-token verify can flip greedy near-ties
        report[f"outputs_equal_to_{other}"] = share_equal(got, outputs_by_id(pipeline_dir(args, other)))
    if not args.skip_direct:
        direct = median_run(per_repeat[f"direct {main_s}"])
        report["direct"] = direct
        report["pipeline_overhead"] = {
            "job_wall_vs_direct_load_plus_generate": pipeline[main_s]["job_wall_s"] / (direct["load_s"] + direct["generate_s"]) - 1,
            "engine_tokens_per_s_vs_direct": 1 - pipeline[main_s]["engine_tokens_per_s"] / direct["tokens_per_s"],
        }
        report["outputs_equal_to_direct"] = share_equal({r["id"]: t for r, t in zip(direct_rows, texts)}, got)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2))

    print(f"\n{'run':<22}{'tokens':>8}{'wall s':>9}{'job tok/s':>11}{'engine tok/s':>14}{'tau':>7}")
    for s, r in pipeline.items():
        print(f"{'pipeline ' + s:<22}{r['output_tokens']:>8}{r['job_wall_s']:>9.1f}{r['job_tokens_per_s']:>11.1f}"
              f"{r['engine_tokens_per_s']:>14.1f}{(r['mean_accepted_length'] or 0):>7.2f}")
    if "direct" in report:
        d = report["direct"]
        print(f"{'direct ' + main_s:<22}{d['output_tokens']:>8}{d['load_s'] + d['generate_s']:>9.1f}"
              f"{d['tokens_per_s_with_load']:>11.1f}{d['tokens_per_s']:>14.1f}")
    for key in [k for k in report if k.startswith(("speedup", "outputs_equal_to_")) or k == "pipeline_overhead"]:
        print(f"{key}: {json.dumps(report[key])}")
    print(f"report: {args.out / 'bench.json'}")


if __name__ == "__main__":
    from pipelines import run_main

    raise SystemExit(run_main(main))
