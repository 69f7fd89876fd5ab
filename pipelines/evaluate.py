"""Benchmark generation methods side by side on one prompt file.

    python -m pipelines.evaluate --prompts ../shared/data/prompts/cnn_dailymail.jsonl \\
        --out runs/eval --methods hf,hf-pld,ar,fixed:4@ngram,dspark@ngram \\
        --batch-sizes 1,8 --max-new-tokens 128 --limit 16

Writes DIR/results.json (one row per method and batch size) and DIR/outputs.jsonl (every
output of every method) and prints a table. See dspark/evaluation.py for the methods.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import yaml

from dspark.evaluation import load_prompts, run_benchmark, split_method, summarise, write_outputs

DEFAULT_METHODS = "hf,hf-pld,ar,fixed:2@ngram,fixed:4@ngram,fixed:8@ngram,threshold:0.7@ngram,dspark@ngram"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompts", help="JSON Lines (turns format) or Parquet prompt file")
    p.add_argument("--out", help="output directory for results.json and outputs.jsonl")
    p.add_argument("--methods", default=None, help=f"comma-separated methods (default: {DEFAULT_METHODS})")
    p.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default: 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate per prompt (default: 128)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--categories", default=None, help="only prompts of these categories/domains (comma-separated)")
    p.add_argument("--config", default=None, help="YAML file whose keys are these flags (flags override it)")
    p.add_argument("--target", default=None, help="smollm2-135m-instruct (embedded), a model directory or a .gguf file")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"], help="default: auto (bfloat16 on GPUs and bf16-capable CPUs, else float32)")
    p.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:1 ... (default: auto)")
    p.add_argument("--default-drafter", default=None, help="drafter for methods without @DRAFTER (default: ngram)")
    return p


DEFAULTS = {
    "methods": DEFAULT_METHODS,
    "batch_sizes": "1",
    "max_new_tokens": 128,
    "limit": None,
    "categories": None,
    "target": "smollm2-135m-instruct",
    "dtype": "auto",
    "device": "auto",
    "default_drafter": "ngram",
}


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    config = {}
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            config = {k.replace("-", "_"): v for k, v in (yaml.safe_load(f) or {}).items()}
    for key, default in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, config.get(key, default))
    for key in ("prompts", "out"):
        if getattr(args, key) is None:
            setattr(args, key, config.get(key))
        if getattr(args, key) is None:
            build_parser().error(f"--{key} is required (on the command line or in --config)")
    if isinstance(args.methods, list):
        args.methods = ",".join(args.methods)
    if isinstance(args.batch_sizes, list):
        args.batch_sizes = ",".join(str(b) for b in args.batch_sizes)
    return args


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from dspark.generator import DSparkGenerator
    from dspark.hardware import device_name
    from dspark.models import load_model

    args = resolve_args(argv)
    console = Console(stderr=True)
    methods = _csv(args.methods)
    batch_sizes = [int(b) for b in _csv(args.batch_sizes)]
    categories = _csv(args.categories) if args.categories else None
    prompts = load_prompts(args.prompts, args.limit, categories)
    for m in methods:  # fail on a bad name before loading anything heavy
        sched, _ = split_method(m, args.default_drafter)
        if sched not in ("hf", "hf-pld"):
            from dspark.schedulers import make_scheduler

            make_scheduler(sched if sched != "dspark" else "ar")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    console.print(f"loading target {args.target} ({args.dtype}, {args.device})")
    target = load_model(args.target, device=args.device, dtype=args.dtype)

    def make_generator(method: str, batch_size: int) -> DSparkGenerator:
        # a fresh drafter per (method, batch size): online statistics must not leak between runs
        sched, drafter = split_method(method, args.default_drafter)
        return DSparkGenerator(target, drafter, sched, max_batch_size=batch_size)

    steps = sum(
        len([m for m in methods if not (m == "hf-pld" and bs > 1)]) * -(-len(prompts) // bs) for bs in batch_sizes
    )
    t0 = time.perf_counter()
    with Progress(console=console, transient=False) as bar:
        task = bar.add_task("benchmark", total=steps)
        runs = run_benchmark(
            target,
            prompts,
            methods,
            batch_sizes,
            args.max_new_tokens,
            make_generator,
            progress=lambda m: bar.update(task, advance=1, description=f"benchmark [{m}]"),
        )
    rows = summarise(runs)
    header = {
        "command": " ".join(["python -m pipelines.evaluate", *(argv if argv is not None else sys.argv[1:])]),
        "prompts": str(args.prompts),
        "num_prompts": len(prompts),
        "target": target.name,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": device_name(target.device),
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "elapsed_s": time.perf_counter() - t0,
    }
    (out / "results.json").write_text(json.dumps({"settings": header, "runs": rows}, indent=1))
    write_outputs(runs, out / "outputs.jsonl")

    table = Table(title=f"{target.name} {header['dtype']} on {header['device']}, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    for col in ("method", "batch", "tok/s", "vs hf", "same as hf", "tau", "accept", "correct", "p50 s", "p99 s"):
        table.add_column(col, justify="right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        table.add_row(
            r["method"],
            str(r["batch_size"]),
            fmt(r["tokens_per_s"], ".1f"),
            fmt(r["speedup_vs_hf"], ".2f"),
            fmt(r["identical_to_hf"], ".0%"),
            fmt(r["mean_accepted_length"], ".2f"),
            fmt(r["acceptance_rate"], ".0%"),
            fmt(r["correction_rate"], ".0%"),
            fmt(r["p50_latency_s"], ".2f"),
            fmt(r["p99_latency_s"], ".2f"),
        )
    Console().print(table)
    console.print(f"wrote {out / 'results.json'} and {out / 'outputs.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
