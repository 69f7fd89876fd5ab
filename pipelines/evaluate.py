"""Benchmark generation methods side by side and write the evaluation report.

    python -m pipelines.evaluate --prompts data/prompts/cnn_dailymail.jsonl \\
        --out runs/eval --methods hf,hf-pld,ar,fixed:4@ngram,dspark@ngram \\
        --batch-sizes 1,8 --max-new-tokens 128 --limit 16

    python -m pipelines.evaluate --preset long,dialogue --out runs/report \\
        --temperature 0.8 --seeds 3 --thresholds 0.5,0.7,0.9 --load-batch-sizes 1,2,4,8,16,32 \\
        --soak-minutes 5

Phases: compare (greedy, every method at every batch size, per scenario), sampling (hf and
the engine methods over several seeds), threshold sweep, load sweep, soak. Each optional
phase runs when its flag asks for it. Saves the raw measurements as each run ends
(DIR/outputs.jsonl: every output of every phase but the soak; DIR/runs.jsonl; DIR/measurement.json),
then computes DIR/results.json, DIR/report.md and its PNG plots from them; `--rebuild --out DIR`
does only that second step. The report is docs/evaluation.md; the methods are in
dspark/evaluation/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import yaml

from dspark.evaluation import RawWriter, load_prompt_files, read_measurement, read_runs, run_benchmark, split_method, summarise
from dspark.hardware import cpu_model

DEFAULT_METHODS = "hf,hf-pld,ar,fixed:2@ngram,fixed:4@ngram,fixed:8@ngram,threshold:0.7@ngram,dspark@ngram"
DEFAULT_LOAD_METHODS = "ar,fixed:2,fixed:4,fixed:8,dspark"


@dataclass(frozen=True)
class Scenario:
    name: str
    prompts: tuple[str, ...]  # file paths
    max_new_tokens: int


# Named workloads from the evaluation plan: file names are looked up in --prompts-dir.
PRESETS: dict[str, tuple[tuple[str, ...], int, str]] = {
    "long": (("cnn_dailymail.jsonl",), 1024, "long reports: news summarisation (ROUGE-L vs references), up to 1024 new tokens"),
    "dialogue": (("samsum.jsonl", "instructions.jsonl"), 256, "dialogue turns: samsum and user instructions (BLEU vs references), up to 256 new tokens"),
    "mixed": (("arena-hard-v2.jsonl", "humaneval.jsonl", "gsm8k.jsonl", "cnn_dailymail.jsonl", "samsum.jsonl"), 128,
              "mixed load: chat, code, math, summarisation and dialogue, one file each (the load sweep's workload)"),
}


def _csv(text) -> list[str]:
    if isinstance(text, (list, tuple)):
        return [str(t).strip() for t in text if str(t).strip()]
    return [t.strip() for t in str(text).split(",") if t.strip()]


def default_prompts_dir() -> str:
    """$DSPARK_PROMPTS_DIR, else the prompt sets bundled with the repository (data/prompts)."""
    return os.environ.get("DSPARK_PROMPTS_DIR") or "data/prompts"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("workload")
    g.add_argument("--prompts", help="JSON Lines (turns format) or Parquet prompt file(s), comma-separated")
    g.add_argument("--preset", default=None, help=f"named scenarios, comma-separated: {', '.join(PRESETS)} "
                   "(with --prompts too, the prompt files form one more scenario)")
    g.add_argument("--prompts-dir", default=None, help="where preset prompt files live (default: $DSPARK_PROMPTS_DIR or data/prompts)")
    g.add_argument("--out", help="output directory for results.json, outputs.jsonl and report.md")
    g.add_argument("--rebuild", action="store_true", default=None,
                   help="measure nothing: rebuild results.json, report.md and the plots in --out from the raw "
                   "measurements a run saved there (outputs.jsonl, runs.jsonl, measurement.json)")
    g.add_argument("--methods", default=None, help=f"comma-separated methods (default: {DEFAULT_METHODS})")
    g.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default: 1)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate per prompt (default: 128; overrides presets)")
    g.add_argument("--limit", type=int, default=None, help="use only the first N prompts of each prompt file")
    g.add_argument("--categories", default=None, help="only prompts of these categories/domains (comma-separated)")
    g.add_argument("--split", default=None, choices=["train", "calib", "eval"],
                   help="only prompts of this split of the drafter's training data (by a hash of the id; applied before --limit)")
    g.add_argument("--config", default=None, help="YAML file whose keys are these flags (flags override it)")
    g.add_argument("--target", default=None, help="smollm2-135m-instruct (embedded), a model directory or a .gguf file")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"], help="default: auto (bfloat16 on GPUs and bf16-capable CPUs, else float32)")
    g.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:1 ... (default: auto)")
    g.add_argument("--default-drafter", default=None, help="drafter for methods without @DRAFTER (default: auto, the DSpark drafter shipped for the target, else ngram)")
    s = p.add_argument_group("sampling (runs when --seeds >= 1; needs --temperature > 0)")
    s.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0: no sampling phase)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 1: off)")
    s.add_argument("--top-k", type=int, default=None, help="top-k sampling (default 0: off)")
    s.add_argument("--seeds", type=int, default=None, help="repetitions with different seeds (default 0)")
    s.add_argument("--seed", type=int, default=None, help="base seed: prompt i of repetition r uses seed + 100000 r + i (default 0)")
    s.add_argument("--sampling-methods", default=None, help="engine methods to sample with next to hf (default: the compare methods but hf-pld)")
    s.add_argument("--sampling-scenario", default=None, help="scenario to sample (default: the first with references)")
    s.add_argument("--sampling-limit", type=int, default=None, help="prompts per file for sampling (default: --limit)")
    s.add_argument("--sampling-max-new-tokens", type=int, default=None, help="default: the scenario's")
    s.add_argument("--sampling-batch-size", type=int, default=None, help="default: the first of --batch-sizes")
    w = p.add_argument_group("sweeps")
    w.add_argument("--thresholds", default=None, help="confidence thresholds to sweep, e.g. 0.5,0.7,0.9 (default: none)")
    w.add_argument("--sweep-batch-size", type=int, default=None, help="batch size of the threshold sweep (default 1)")
    w.add_argument("--load-batch-sizes", default=None, help="batch sizes of the load sweep, e.g. 1,2,4,8,16,32 (default: none)")
    w.add_argument("--load-methods", default=None, help=f"methods of the load sweep (default: {DEFAULT_LOAD_METHODS})")
    w.add_argument("--load-drafters", default=None, help="drafters the load sweep runs each method without @DRAFTER with, "
                   "e.g. ngram,auto (default: --default-drafter); ar runs once")
    w.add_argument("--load-repeats", type=int, default=None, help="pass over the load sweep's prompts this many times "
                   "(more interleaved batches per method: tighter ratios on a noisy machine; default 1)")
    w.add_argument("--load-lengths", default=None, help="new tokens per prompt in the load sweep, e.g. 128,1024 "
                   "(default: --sweep-max-new-tokens)")
    w.add_argument("--sweep-scenario", default=None, help="scenario whose prompt files the sweeps use (default: the last)")
    w.add_argument("--sweep-limit", type=int, default=None, help="prompts per file for the threshold sweep (default: --limit)")
    w.add_argument("--load-limit", type=int, default=None, help="prompts per file for the load sweep (default: enough to fill the largest batch)")
    w.add_argument("--sweep-max-new-tokens", type=int, default=None, help="new tokens in the sweeps (default 64)")
    k = p.add_argument_group("soak")
    k.add_argument("--soak-minutes", type=float, default=None, help="repeat the workload this long, recording memory over time (default 0: off)")
    k.add_argument("--soak-methods", default=None, help="methods the soak repeats (default: dspark@DEFAULT_DRAFTER)")
    k.add_argument("--soak-scenario", default=None, help="scenario whose prompts the soak repeats (default: the first)")
    k.add_argument("--soak-batch-size", type=int, default=None, help="default: the largest of --batch-sizes")
    k.add_argument("--soak-max-new-tokens", type=int, default=None, help="default: the first scenario's")
    k.add_argument("--sample-interval", type=float, default=None, help="seconds between background RSS/NVML samples (default 1)")
    return p


DEFAULTS = {
    "methods": DEFAULT_METHODS,
    "batch_sizes": "1",
    "max_new_tokens": None,  # None: the presets' values, else 128
    "limit": None,
    "categories": None,
    "split": None,
    "target": "smollm2-135m-instruct",
    "dtype": "auto",
    "device": "auto",
    "default_drafter": "auto",
    "preset": None,
    "prompts_dir": None,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seeds": 0,
    "seed": 0,
    "sampling_methods": None,
    "sampling_scenario": None,
    "sampling_limit": None,
    "sampling_max_new_tokens": None,
    "sampling_batch_size": None,
    "thresholds": None,
    "sweep_batch_size": 1,
    "load_batch_sizes": None,
    "load_methods": DEFAULT_LOAD_METHODS,
    "load_drafters": None,
    "load_lengths": None,
    "load_repeats": 1,
    "sweep_scenario": None,
    "sweep_limit": None,
    "load_limit": None,
    "sweep_max_new_tokens": 64,
    "soak_minutes": 0.0,
    "soak_methods": None,
    "soak_scenario": None,
    "soak_batch_size": None,
    "soak_max_new_tokens": None,
    "sample_interval": 1.0,
}


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = {}
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            config = {k.replace("-", "_"): v for k, v in (yaml.safe_load(f) or {}).items()}
        unknown = set(config) - set(DEFAULTS) - {"prompts", "out"}
        if unknown:
            parser.error(f"{args.config}: unknown keys {', '.join(sorted(unknown))}")
    for key, default in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, config.get(key, default))
    for key in ("prompts", "out"):
        if getattr(args, key) is None:
            setattr(args, key, config.get(key))
    if args.out is None:
        parser.error("--out is required (on the command line or in --config)")
    if args.prompts is None and not args.preset and not args.rebuild:
        parser.error("--prompts or --preset is required (on the command line or in --config)")
    for key in ("methods", "batch_sizes", "preset", "thresholds", "load_batch_sizes", "load_methods", "load_drafters", "load_lengths",
                "sampling_methods", "soak_methods", "prompts"):
        if isinstance(getattr(args, key), list):
            setattr(args, key, ",".join(str(x) for x in getattr(args, key)))
    for name in _csv(args.preset or ""):
        if name not in PRESETS:
            parser.error(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    if args.seeds and args.temperature <= 0:
        parser.error("--seeds needs --temperature > 0 (greedy outputs do not depend on the seed)")
    return args


def scenarios_from(args: argparse.Namespace) -> list[Scenario]:
    """Presets first, then the --prompts files as one scenario named after them."""
    prompts_dir = Path(args.prompts_dir or default_prompts_dir())
    out = []
    for name in _csv(args.preset or ""):
        files, mnt, _ = PRESETS[name]
        out.append(Scenario(name, tuple(str(prompts_dir / f) for f in files), args.max_new_tokens or mnt))
    if args.prompts:
        files = tuple(_csv(args.prompts))
        out.append(Scenario("+".join(Path(f).stem for f in files), files, args.max_new_tokens or 128))
    return out


def load_sweep_methods(methods: list[str], drafters: list[str]) -> list[str]:
    """Each method with each drafter ('fixed:4' x [ngram, auto] -> fixed:4@ngram, fixed:4@auto);
    a method naming its drafter, or drafting nothing (ar), once."""
    out: list[str] = []
    for m in methods:
        for d in drafters:
            named = with_drafter(m, d)
            if named not in out:
                out.append(named)
    return out


def repeated(prompts: list, times: int) -> list:
    """The prompts `times` over, later passes with ids suffixed `~2`, `~3` ... (ids stay unique)."""
    return list(prompts) + [replace(p, id=f"{p.id}~{r}") for r in range(2, max(1, times) + 1) for p in prompts]


def load_scenario(name: str, length: int) -> str:
    """A load-sweep run's scenario: the prompts and the output length (one panel each)."""
    return f"{name}, {length} tokens"


def with_drafter(method: str, drafter: str) -> str:
    """'fixed:4' -> 'fixed:4@ngram' (explicit names in the report)."""
    sched, d = split_method(method, drafter)
    return method if d is None or "@" in method else f"{sched}@{d}"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("dspark", "torch", "transformers", "numpy", "rouge-score", "sacrebleu", "matplotlib"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _machine() -> str:
    import psutil
    import torch

    ram = psutil.virtual_memory().total / 2**30
    return (f"{platform.platform()}, {cpu_model()}, {os.cpu_count()} CPUs, {ram:.0f} GiB RAM, "
            f"torch threads {torch.get_num_threads()}")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _steps(n_prompts: int, methods: list[str], batch_sizes: list[int]) -> int:
    return sum(len([m for m in methods if not (m == "hf-pld" and bs > 1)]) * -(-n_prompts // bs) for bs in batch_sizes)


def main(argv: list[str] | None = None) -> int:
    import torch
    from tqdm.auto import tqdm

    from dspark.drafters import make_drafter
    from dspark.evaluation.resources import cuda_memory, measure_drafter, run_soak, tensor_bytes
    from dspark.generator import DSparkGenerator
    from dspark.hardware import UtilizationSampler, device_name
    from dspark.models import load_model
    from dspark.sampling import SamplingParams
    from dspark.schedulers import make_scheduler

    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve_args(argv)
    if args.rebuild:
        return report_from_raw(Path(args.out))
    drafter = args.default_drafter
    methods = [with_drafter(m, drafter) for m in _csv(args.methods)]
    batch_sizes = [int(b) for b in _csv(args.batch_sizes)]
    categories = _csv(args.categories) if args.categories else None
    scenarios = scenarios_from(args)
    prompts = {sc.name: load_prompt_files(sc.prompts, args.limit, categories, args.split) for sc in scenarios}
    by_name = {sc.name: sc for sc in scenarios}
    references = {p.id: p.reference for ps in prompts.values() for p in ps if p.reference}

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)  # validates the values
    sampling_methods = ["hf"] + [
        with_drafter(m, drafter) for m in _csv(args.sampling_methods or ",".join(methods)) if m not in ("hf", "hf-pld")
    ]
    thresholds = [float(t) for t in _csv(args.thresholds or "")]
    load_bs = [int(b) for b in _csv(args.load_batch_sizes or "")]
    load_methods = load_sweep_methods(_csv(args.load_methods), _csv(args.load_drafters or drafter))
    load_lengths = [int(n) for n in _csv(args.load_lengths or str(args.sweep_max_new_tokens))]
    soak_methods = [with_drafter(m, drafter) for m in _csv(args.soak_methods or f"dspark@{drafter}")]
    sweep_methods = [f"threshold:{t}@{drafter}" for t in thresholds]
    all_engine = {m for m in methods + sampling_methods + load_methods + soak_methods + sweep_methods if m not in ("hf", "hf-pld")}
    for m in sorted(all_engine):  # fail on a bad name before loading anything heavy
        make_scheduler(split_method(m, drafter)[0] if not m.startswith("dspark") else "ar")
    for name in (args.sampling_scenario, args.sweep_scenario, args.soak_scenario):
        if name and name not in by_name:
            raise SystemExit(f"unknown scenario {name!r}; scenarios: {', '.join(by_name)}")
    sample_sc = by_name.get(args.sampling_scenario) or next((sc for sc in scenarios if any(p.reference for p in prompts[sc.name])), scenarios[0])
    sweep_sc = by_name.get(args.sweep_scenario) or scenarios[-1]
    soak_sc = by_name.get(args.soak_scenario) or scenarios[0]
    out = Path(args.out)
    raw = RawWriter(out, references)  # measurements are saved as each run ends
    for stale in ("results.json", "report.md"):  # an earlier run's: until this one is summarised, none
        (out / stale).unlink(missing_ok=True)

    log(f"loading target {args.target} ({args.dtype}, {args.device})")
    target = load_model(args.target, device=args.device, dtype=args.dtype)
    dev = torch.device(target.device)

    def make_generator(method: str, batch_size: int) -> DSparkGenerator:
        # a fresh drafter per (method, batch size): online statistics must not leak between runs
        sched, d = split_method(method, drafter)
        return DSparkGenerator(target, d, sched, max_batch_size=batch_size)

    # --- prompt sets of the optional phases -------------------------------------------------
    sample_prompts = load_prompt_files(sample_sc.prompts, args.sampling_limit or args.limit, categories, args.split) if args.seeds else []
    sweep_prompts = load_prompt_files(sweep_sc.prompts, args.sweep_limit or args.limit, categories, args.split) if thresholds else []
    load_limit = args.load_limit or (-(-max(load_bs) // len(sweep_sc.prompts)) if load_bs else None)
    load_prompts_ = repeated(load_prompt_files(sweep_sc.prompts, load_limit, categories, args.split), args.load_repeats) if load_bs else []
    sample_bs = args.sampling_batch_size or batch_sizes[0]
    sample_mnt = args.sampling_max_new_tokens or sample_sc.max_new_tokens
    soak_bs = args.soak_batch_size or max(batch_sizes)
    soak_mnt = args.soak_max_new_tokens or soak_sc.max_new_tokens

    total = sum(_steps(len(prompts[sc.name]), methods, batch_sizes) for sc in scenarios)
    total += args.seeds * _steps(len(sample_prompts), sampling_methods, [sample_bs])
    total += _steps(len(sweep_prompts), sweep_methods, [args.sweep_batch_size])
    total += len(load_lengths) * _steps(len(load_prompts_), load_methods, load_bs)

    # --- resources: the drafters' footprint, measured on their own --------------------------
    drafter_specs = sorted({split_method(m, drafter)[1] for m in all_engine} - {None, "none"})
    drafter_mem = [measure_drafter(spec, target, make_drafter) for spec in drafter_specs]
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(dev)

    # the dspark scheduler's view of the hardware: shown because a table profiled on a busy
    # machine makes it verify too little (DSPARK_REPROFILE=1 measures again)
    cost_table = None
    if any(split_method(m, drafter)[0].split(":")[0] == "dspark" for m in all_engine):
        from dspark.cost_model import load_or_profile

        log("cost table: verify costs by batch and width (measured once per machine, then cached)")
        cost_table = load_or_profile(target, max_rows=max(batch_sizes + load_bs)).describe()

    settings = {
        "command": shlex.join(["python", "-m", "pipelines.evaluate", *argv]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "device": device_name(dev),
        "target": target.name,
        "target_parameters": sum(p.numel() for p in target.model.parameters()),
        "dtype": str(target.dtype).replace("torch.", ""),
        "drafters": drafter_specs,
        "cost_table": cost_table,  # target forward time per rows x tokens per row (dspark scheduler)
        "scenarios": {sc.name: f"{len(prompts[sc.name])} prompts from {', '.join(Path(f).name for f in sc.prompts)}, "
                      f"{sc.max_new_tokens} new tokens" for sc in scenarios},
        "methods": methods,
        "batch_sizes": batch_sizes,
        "prompts": args.prompts,  # the original results.json keys
        "num_prompts": sum(len(p) for p in prompts.values()),
        "max_new_tokens": scenarios[0].max_new_tokens,
        "sampling": (f"temperature {sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}, {args.seeds} seeds, "
                     f"{len(sample_prompts)} prompts of {sample_sc.name}, batch {sample_bs}, {sample_mnt} new tokens, "
                     f"methods {', '.join(sampling_methods)}") if args.seeds else "off",
        "thresholds": (f"{', '.join(map(str, thresholds))} with {drafter}, batch {args.sweep_batch_size}, "
                       f"{len(sweep_prompts)} prompts of {sweep_sc.name}, {args.sweep_max_new_tokens} new tokens") if thresholds else "off",
        "load_sweep": (f"batch {', '.join(map(str, load_bs))}; {', '.join(load_methods)}; {len(load_prompts_)} prompts of "
                       f"{sweep_sc.name}, {' and '.join(map(str, load_lengths))} new tokens") if load_bs else "off",
        "soak": (f"{args.soak_minutes:g} min of {', '.join(soak_methods)} at batch {soak_bs} on {soak_sc.name}, "
                 f"{soak_mnt} new tokens") if args.soak_minutes > 0 else "off",
        "versions": _versions(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "elapsed_s": None,  # set when measuring ends
    }
    measurement: dict = {
        "settings": settings,
        "phases_run": {"sampling": bool(args.seeds), "threshold_sweep": bool(thresholds), "load_sweep": bool(load_bs)},
        "sampling_params": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                            "seeds": args.seeds, "seed": args.seed, "scenario": sample_sc.name,
                            "max_new_tokens": sample_mnt} if args.seeds else None,
    }
    raw.measurement(measurement, default=_json_default)
    runs, phases, failures = [], [], []
    t0 = time.perf_counter()
    sampler = UtilizationSampler(interval_s=args.sample_interval, device=dev).start()
    soak_result = None
    done = 0
    # disable=None: a bar on a terminal; in a log file, one plain line per step instead
    with tqdm(total=total, desc="benchmark", file=sys.stderr, disable=None, dynamic_ncols=True) as bar:

        def tick(phase: str):
            def step(m: str) -> None:
                nonlocal done
                done += 1
                bar.set_description(f"{phase} [{m}]", refresh=False)
                bar.update(1)
                if bar.disable:
                    log(f"{done}/{total} {phase} [{m}] {time.perf_counter() - t0:.0f} s")

            return step

        def phase(name: str, fn) -> list:
            """Run one phase; a failure is recorded and the next phases still run (a long run
            keeps what it measured), and the command exits with status 1."""
            phases.append({"name": name, "start_s": time.perf_counter() - t0})
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - reported in report.md and the exit status
                failures.append({"phase": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
                log(f"phase {name} failed: {type(e).__name__}: {e}")
                return []

        for sc in scenarios if methods else []:  # `methods: []`: only the sweeps
            runs += phase(f"compare:{sc.name}", lambda sc=sc: run_benchmark(
                target, prompts[sc.name], methods, batch_sizes, sc.max_new_tokens, make_generator, tick(sc.name), on_run=raw.add, scenario=sc.name))
        if args.seeds:
            runs += phase("sampling", lambda: [run for r in range(args.seeds) for run in run_benchmark(
                target, sample_prompts, sampling_methods, [sample_bs], sample_mnt, make_generator, tick(f"sampling seed {r}"),
                on_run=raw.add, sampling=sampling, seed=args.seed + 100_000 * r, seed_index=r, scenario=sample_sc.name, phase="sampling")])
        if thresholds:
            runs += phase("threshold_sweep", lambda: run_benchmark(
                target, sweep_prompts, sweep_methods, [args.sweep_batch_size], args.sweep_max_new_tokens, make_generator,
                tick("threshold sweep"), on_run=raw.add, scenario=sweep_sc.name, phase="threshold_sweep"))
        for length in load_lengths if load_bs else []:
            runs += phase(f"load_sweep:{length}", lambda length=length: run_benchmark(
                target, load_prompts_, load_methods, load_bs, length, make_generator, tick(f"load sweep, {length} tokens"),
                on_run=raw.add, scenario=load_scenario(sweep_sc.name, length), phase="load_sweep"))
        if args.soak_minutes > 0:

            def soak():
                log(f"soak: {args.soak_minutes:g} min of {', '.join(soak_methods)}")
                enc = [target.encode(p.text) for p in prompts[soak_sc.name]]
                gens = {m: make_generator(m, soak_bs) for m in soak_methods}
                chunks = [enc[i : i + soak_bs] for i in range(0, len(enc), soak_bs)]
                workload = [
                    (lambda g=g, c=c: [r.token_ids for r in g.generate(c, max_new_tokens=soak_mnt)]) for g in gens.values() for c in chunks
                ]
                return [run_soak(args.soak_minutes, workload, dev, on_step=lambda res: bar.set_description(
                    f"soak: {res.iterations} passes, {res.errors} errors"))]

            soak_result = (phase("soak", soak) or [None])[0]
    report = sampler.stop()
    elapsed = time.perf_counter() - t0

    measurement["failures"] = failures
    measurement["resources"] = {
        **report.as_dict(),
        "target_tensor_bytes": tensor_bytes(target.model),
        "cuda": cuda_memory(dev),
        "drafters": drafter_mem,
        "rss_samples": report.samples,
        "phases": phases,
    }
    if soak_result is not None:
        measurement["soak"] = {**soak_result.as_dict(), "methods": soak_methods, "batch_size": soak_bs,
                               "max_new_tokens": soak_mnt, "scenario": soak_sc.name}
    settings["elapsed_s"] = elapsed
    raw.measurement(measurement, default=_json_default)

    try:
        results = write_report(out)
    except Exception:
        log(f"summarising failed; the measurements are saved in {out}: after a fix, rebuild the report with "
            f"`python -m pipelines.evaluate --rebuild --out {out}`")
        raise

    print_summary(results)
    log(f"wrote {out / 'report.md'}, {out / 'results.json'} and the raw measurements ({out / 'outputs.jsonl'}, runs.jsonl, measurement.json)")
    if failures:
        log(f"{len(failures)} phase(s) failed: {', '.join(f['phase'] for f in failures)} (see report.md)")
    return 1 if failures else 0


def build_results(measurement: dict, runs: list, references: dict[str, str]) -> dict:
    """results.json from the raw measurements: every figure is computed here, from the runs'
    outputs and timings, never while measuring."""
    from dspark.evaluation.analysis import load_sweep_rows, sampling_summary, threshold_sweep_rows

    by_phase = lambda name: [r for r in runs if r.phase == name]  # noqa: E731
    ran = measurement.get("phases_run", {})
    results: dict = {"settings": measurement["settings"], "runs": summarise(by_phase("compare"), references),
                     "failures": measurement.get("failures", [])}
    if ran.get("sampling"):
        results["sampling"] = sampling_summary(by_phase("sampling"), references)
        results["sampling"]["params"] = measurement.get("sampling_params")
        results["sampling_runs"] = summarise(by_phase("sampling"), references)
    if ran.get("threshold_sweep"):
        results["threshold_sweep"] = threshold_sweep_rows(summarise(by_phase("threshold_sweep")))
    if ran.get("load_sweep"):
        rows, checks = load_sweep_rows(summarise(by_phase("load_sweep")))
        results["load_sweep"] = {"rows": rows, "checks": checks}
    results["resources"] = measurement.get("resources") or {}
    if measurement.get("soak"):
        results["soak"] = measurement["soak"]
    return results


def write_report(out: Path) -> dict:
    """results.json, report.md and the plots in `out`, from the raw measurements saved there."""
    from dspark.evaluation.report import plot_all, render_markdown

    runs, references = read_runs(out)
    results = build_results(read_measurement(out), runs, references)
    results["plots"] = plot_all(results, [o for r in runs for o in r.outputs], out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_json_default))
    (out / "report.md").write_text(render_markdown(results, results["plots"]), encoding="utf-8")
    return results


def report_from_raw(out: Path) -> int:
    """`--rebuild`: the report of an earlier (or interrupted) run, measuring nothing."""
    results = write_report(out)
    if results["settings"].get("elapsed_s") is None:
        log(f"{out}: measuring did not finish; the report covers the runs that completed")
    print_summary(results)
    log(f"wrote {out / 'report.md'} and {out / 'results.json'}")
    return 0


def print_summary(results: dict) -> None:
    """The compare table on stdout, as Markdown (a log file gets it uncut)."""
    from dspark.evaluation.report import md_table

    first = results["runs"]
    if not first:  # only sweeps ran: their tables are in report.md
        return
    f = lambda v, spec: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)  # noqa: E731
    rows = [[r["scenario"], r["method"], str(r["batch_size"]), f(r["tokens_per_s"], ".1f"), f(r["speedup_vs_hf"], ".2f"),
             f(r.get("speedup_vs_ar"), ".2f"), f(r["identical_to_hf"], ".0%"), f(r["mean_accepted_length"], ".2f"), f(r["acceptance_rate"], ".0%"),
             f(r["correction_rate"], ".0%"), f(r["p50_latency_s"], ".2f"), f(r["p99_latency_s"], ".2f")] for r in first]
    print(f"{results['settings']['target']} {results['settings']['dtype']} on {results['settings']['device']}")
    print(md_table(["scenario", "method", "batch", "tok/s", "vs hf", "vs ar", "same as hf", "tau", "accept", "correct", "p50 s", "p99 s"], rows))


def _json_default(obj):
    from dataclasses import asdict, is_dataclass

    if is_dataclass(obj):
        return asdict(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


if __name__ == "__main__":
    from pipelines import run_main

    raise SystemExit(run_main(main))
