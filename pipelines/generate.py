"""DSpark batch generation as an Apache Beam job: Parquet shards in; generations, per-shard
metrics, dead letters and a run summary out.

    python -m pipelines.generate                          # bundled sample shards -> ./out
    python -m pipelines.generate --input 'shards/*.parquet' --output out --config configs/dialogue.yaml

Order of precedence: built-in defaults (= configs/default.yaml) < --config FILE < flags.
Every flag not listed here is a Beam pipeline option and goes to the runner unchanged.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from transforms.launch import ConfigError  # options and the launch's checks share it

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_INPUT = str(REPO_ROOT / "data" / "sample_shards" / "*.parquet")
LOG = logging.getLogger("pipelines.generate")

# Built-in defaults; configs/default.yaml holds the same values (a test keeps them equal).
DEFAULTS: dict[str, Any] = {
    "input": SAMPLE_INPUT,
    "output": "out",
    "id_column": "id",
    "text_column": "text",
    "prompt_template": "{text}",
    "keep_columns": [],
    "chat": True,
    "parse_special_tokens": False,
    "target": "smollm2-135m-instruct",
    "drafter": "auto",
    "scheduler": "dspark",
    "dtype": "auto",
    "device": "auto",
    "max_new_tokens": 128,
    "batch_size": 16,
    "rows_per_call": 128,
    "batch_scope": "shard",
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "stop": [],
    "seed": 0,
    "row_time_limit_s": None,
    "skip_bad_files": False,
    "resume": False,
    "limit_per_shard": None,
    "strip_control_chars": False,
    "truncate_prompts": False,
    "trust_remote_code": False,
    "progress": None,  # None: on when stderr is a terminal
    "verbose": False,
    "fail_on_health": False,
    "health_max_correction_rate": 0.15,
    "health_max_confidence_entropy": 0.8,
    "health_max_gpu_fragmentation": 0.05,
    "runner": "DirectRunner",
    "beam_options": {},
}

DESCRIPTION = """\
Generate text for every row of a set of Parquet shards with the DSpark speculative-decoding
engine, as an Apache Beam batch job (DirectRunner locally, DataflowRunner on Google Cloud).

With no arguments: processes the sample shards bundled in data/sample_shards with the embedded
SmolLM2-135M-Instruct target, its trained DSpark drafter (drafter auto) and the DSpark scheduler, and
writes ./out.
"""

EPILOG = """\
outputs (under --output DIR; one file per input shard in each folder, named after the shard):
  generations/*.parquet         one row per generated input row: id, shard, output,
                                num_prompt_tokens, num_output_tokens, finish_reason (eos|length|stop),
                                latency_s, mean_accepted_length (output tokens per target forward,
                                the prefill counted; 1.0 = no speculation; docs/metrics.md), [prompt_truncated with --truncate-prompts],
                                then the --keep-columns
  shard_metrics/*.parquet       one row per input shard: shard, num_records, num_ok, num_failed,
                                num_duplicate_ids, output_tokens, wall_s (engine time on the shard),
                                tokens_per_s, mean_accepted_length, acceptance_rate, correction_rate,
                                mean_verify_budget, confidence_entropy, acceptance_by_position,
                                p50_latency_s, p99_latency_s, device,
                                dtype (the target's, auto resolved), gpu_util_mean,
                                gpu_mem_peak_bytes, gpu_mem_fragmentation_peak (null without a GPU),
                                cpu_util_mean, rss_peak_bytes
  dead_letter/*.parquet         one row per input row that could not be generated (and per skipped
                                file): id, shard, error_type, error
  _complete/*.json              a marker per input file, written once all its outputs are in place
  report.md, report_*.png       the run at a glance: health, a table of shards, plots
  run_summary.json              totals, health checks, the resolved configuration, package versions,
                                Beam counters
  Every input row appears exactly once in generations or dead_letter. A rerun into the same DIR
  first deletes all previous outputs; with --resume it keeps the input files that have a marker
  (same settings; the same file: row counts, size, modification time, footer hash), deletes every
  other output file (partial ones from a crash) and processes only the rest. Local runners
  commit in parts of whole shards (at least --rows-per-call rows per worker), so a crash keeps
  every part that finished. Details: docs/pipeline.md.

bad input:
  Row level (the job goes on; the row goes to dead_letter with error_type):
    null_id, null_text, non_string_text, empty_text, invalid_utf8, control_characters
    (C0/C1 controls other than tab/newline/CR; or --strip-control-chars), template_error,
    prompt_too_long (prompt + max_new_tokens exceed the context; or --truncate-prompts),
    prompt_error (any other refusal by the tokenizer/engine), generation_error (the engine raised
    on that row alone: a failing batch is retried in halves, so the other rows still complete),
    time_limit (the row decoded for longer than --row-time-limit-s; the error gives the limit, the
    time taken and the tokens produced),
    out_of_memory (out of accelerator memory: the batch is retried with half as many rows decoding
    together, down to one, then without speculation, and only a row that still does not fit alone
    gets this).
    Duplicate ids are generated and counted in shard_metrics.num_duplicate_ids.
  File level (checked before any model loads; the job stops with the file and problem named):
    no file matches --input, file not Parquet or truncated (file_unreadable), a missing id/text/
    template/kept column (file_missing_columns, lists the columns found), column types that
    differ between shards (file_schema_mismatch). --skip-bad-files records such files in
    dead_letter (id null, shard = the file) and processes the rest. A row group that fails to
    decode during the job (a file changed after the check) stops the job, or with
    --skip-bad-files becomes one file_row_group_unreadable entry (its rows count as failed).

config files (--config FILE, YAML, parsed with yaml.safe_load):
  keys are the flags above without dashes (e.g. max_new_tokens: 1024); `beam_options:` maps
  Beam option names to values (e.g. {direct_num_workers: 2}). Shipped: configs/default.yaml,
  configs/nightly-reports.yaml (1024 tokens, deep drafts), configs/dialogue.yaml (256 tokens).

Beam options (any other --flag): e.g. --direct_running_mode=multi_processing
  --direct_num_workers=2 for local parallelism; for Dataflow --project, --region,
  --temp_location, --sdk_container_image (see Dockerfile), --machine_type,
  --dataflow_service_options="worker_accelerator=type:nvidia-l4;count:1;install-nvidia-driver",
  --experiments=no_use_multiple_sdk_containers (one model copy per worker VM).
  --runner DirectRunner runs on Beam's FnApiRunner (the DirectRunner's portable engine, which
  honours --direct_running_mode); pass --runner PrismRunner to use Prism instead.
"""


def build_parser() -> argparse.ArgumentParser:
    """Every option defaults to SUPPRESS, so the parsed namespace holds only what was given and
    config files can sit between the built-in defaults and the command line."""
    p = argparse.ArgumentParser(
        prog="python -m pipelines.generate",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    io = p.add_argument_group("input and output")
    io.add_argument("--input", metavar="GLOB", help="Parquet shards: a local path or glob, or gs://, s3://... "
                    "(default: the bundled data/sample_shards/*.parquet)")
    io.add_argument("--output", metavar="DIR", help="output folder, local or gs://... (default: out)")
    io.add_argument("--config", metavar="FILE", help="YAML file of option values (see 'config files' below)")
    io.add_argument("--id-column", dest="id_column", metavar="NAME", help="column that identifies a row (default: id)")
    io.add_argument("--text-column", dest="text_column", metavar="NAME", help="the text to answer (default: text)")
    io.add_argument("--prompt-template", dest="prompt_template", metavar="TEXT",
                    help="how a row becomes the user message; {text} and any other {column} are filled in "
                    "(literal braces as {{ }}); the target's chat template is applied after (default: {text})")
    io.add_argument("--keep-columns", dest="keep_columns", nargs="+", metavar="NAME",
                    help="input columns copied into generations (space or comma separated)")
    io.add_argument("--limit-per-shard", dest="limit_per_shard", type=positive_int, metavar="N",
                    help="process only the first N rows of each shard (smoke tests of a config)")
    io.add_argument("--resume", action=argparse.BooleanOptionalAction,
                    help="keep the outputs of input files already complete in --output (per-file completion "
                    "markers) and process only the others; without it, previous outputs are deleted first")
    io.add_argument("--skip-bad-files", dest="skip_bad_files", action=argparse.BooleanOptionalAction,
                    help="record unreadable / mismatched input files in dead_letter instead of failing")
    io.add_argument("--strip-control-chars", dest="strip_control_chars", action=argparse.BooleanOptionalAction,
                    help="remove control characters from prompts instead of rejecting those rows")
    io.add_argument("--truncate-prompts", dest="truncate_prompts", action=argparse.BooleanOptionalAction,
                    help="cut the end of an over-long text to fit the context (flagged in generations."
                    "prompt_truncated) instead of rejecting the row")

    model = p.add_argument_group("models and engine")
    model.add_argument("--target", metavar="NAME_OR_PATH",
                       help="target model: smollm2-135m-instruct (embedded), a local HF folder (safetensors) or a .gguf file")
    model.add_argument("--drafter", metavar="NAME", help="auto (dspark where a checkpoint is shipped for the target, else ngram), "
        "ngram[:MAX[:MIN]], draft-model:PATH, dspark[:PATH] (the trained block drafter), none, "
        "or a union such as dspark+ngram (default: auto; docs/drafters-and-schedulers.md)")
    model.add_argument("--scheduler", metavar="NAME",
                       help="verification scheduler: dspark[:MAX_DEPTH], ar (no speculation), fixed:K, threshold:T, util "
                       "(default: dspark)")
    model.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="model dtype (auto = bfloat16 on GPUs and bf16-capable CPUs, else float32)")
    model.add_argument("--device", metavar="DEVICE", help="auto (cuda when available), cpu, cuda, cuda:1 ...")
    model.add_argument("--batch-size", dest="batch_size", type=positive_int, metavar="N",
                       help="rows the engine decodes together (continuous batching; default: 16)")
    model.add_argument("--rows-per-call", dest="rows_per_call", type=positive_int, metavar="N",
                       help="rows of one shard handed to one engine call (default: 128)")
    model.add_argument("--batch-scope", dest="batch_scope", choices=["shard", "global"],
                       help="shard (default): each engine call holds rows of one shard, so shard_metrics times are "
                       "exact; global: calls mix shards (fuller batches when shards are small; times apportioned "
                       "to shards by tokens)")
    model.add_argument("--trust-remote-code", dest="trust_remote_code", action=argparse.BooleanOptionalAction,
                       help="allow model code from the model folder (off by default)")

    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", dest="max_new_tokens", type=positive_int, metavar="N", help="default: 128")
    gen.add_argument("--temperature", type=non_negative_float, help="0 = greedy (default)")
    gen.add_argument("--top-k", dest="top_k", type=non_negative_int, help="0 = off")
    gen.add_argument("--top-p", dest="top_p", type=probability, help="1.0 = off")
    gen.add_argument("--stop", nargs="+", metavar="TEXT", help="stop strings")
    gen.add_argument("--seed", type=int, help="sampling seed (ignored when greedy)")
    gen.add_argument("--row-time-limit-s", dest="row_time_limit_s", type=positive_float, metavar="SECONDS",
                     help="wall time a row may take from when it starts decoding; a row past it stops and goes to "
                     "dead_letter as time_limit (default: no limit)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, help="apply the target's chat template (default: on)")
    gen.add_argument("--parse-special-tokens", dest="parse_special_tokens", action=argparse.BooleanOptionalAction,
                     help="tokenize text that spells a control token (<|im_end|>, <|im_start|>) as that token; off by "
                     "default, so row text stays text and cannot open or close a chat turn (for prompts templated on purpose)")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction,
                     help="show a progress bar per engine call (default: when stderr is a terminal)")

    health = p.add_argument_group("health (the evaluation plan's signals; run_summary.json's health block)")
    health.add_argument("--fail-on-health", dest="fail_on_health", action=argparse.BooleanOptionalAction,
                        help="exit with status 3 when a shard or the run breaches a threshold below (default: warn only)")
    health.add_argument("--health-max-correction-rate", dest="health_max_correction_rate", type=probability_or_zero,
                        metavar="RATE", help="rejected / verified draft tokens (default: 0.15)")
    health.add_argument("--health-max-confidence-entropy", dest="health_max_confidence_entropy", type=non_negative_float,
                        metavar="BITS", help="mean binary entropy of verified confidences; near 1 = uncalibrated (default: 0.8)")
    health.add_argument("--health-max-gpu-fragmentation", dest="health_max_gpu_fragmentation", type=probability_or_zero,
                        metavar="SHARE", help="(reserved - allocated) / reserved GPU memory at the peak (default: 0.05)")

    run = p.add_argument_group("runner")
    run.add_argument("--runner", metavar="NAME", help="DirectRunner (default), DataflowRunner, PrismRunner, ...")
    run.add_argument("--verbose", action=argparse.BooleanOptionalAction,
                     help="on an unexpected failure, print the whole traceback instead of one error line")
    return p


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def probability_or_zero(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def config_to_argv(config: dict, parser: argparse.ArgumentParser, source: str) -> tuple[list[str], dict]:
    """YAML values as command-line tokens, so they go through the same parsing and checks as
    flags. Returns (tokens, beam_options)."""
    flags = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    argv: list[str] = []
    beam_options = {}
    for raw_key, value in config.items():
        key = str(raw_key).replace("-", "_")
        if key == "beam_options":
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: beam_options must be a mapping of Beam option names to values")
            beam_options = dict(value)
            continue
        if key not in flags:
            raise ConfigError(f"{source}: unknown key {raw_key!r}; valid keys: {', '.join(sorted([*flags, 'beam_options']))}")
        action = flags[key]
        option = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: {raw_key} must be true or false, got {value!r}")
            argv.append(option if value else "--no-" + option[2:])
        elif action.nargs == "+":
            values = value if isinstance(value, list) else [value]
            if values:
                argv += [option, *map(str, values)]
        elif value is not None:
            argv += [option, str(value)]
    return argv, beam_options


def load_config_file(path: str) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read: {exc}") from exc
    try:
        data = yaml.safe_load(text)  # safe_load: no arbitrary Python objects from a config file
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values, got {type(data).__name__}")
    return data


def split_list(values: list[str]) -> list[str]:
    """`--keep-columns a b,c` -> [a, b, c]."""
    return [v.strip() for item in values for v in str(item).split(",") if v.strip()]


def resolve_options(argv: list[str]) -> tuple[dict, list[str]]:
    """(options, beam_flags): defaults < config file < flags. Unknown flags are Beam's."""
    parser = build_parser()
    given, beam_flags = parser.parse_known_args(argv)
    given = vars(given)
    options = dict(DEFAULTS)
    config_beam: dict = {}
    if "config" in given:
        try:
            config_argv, config_beam = config_to_argv(load_config_file(given["config"]), parser, given["config"])
        except ConfigError as exc:
            parser.error(str(exc))
        from_config, leftover = parser.parse_known_args(config_argv)
        options.update(vars(from_config))
        options["config"] = given["config"]
    options.update(given)
    options["keep_columns"] = split_list(options["keep_columns"])
    options["stop"] = list(options["stop"] or [])
    options["beam_options"] = {**DEFAULTS["beam_options"], **config_beam}
    beam_flags = [f"--{k}={v}" for k, v in options["beam_options"].items()] + beam_flags
    unknown = unknown_beam_flags(beam_flags)
    if unknown:
        parser.error(f"unrecognised option(s) {' '.join(unknown)}: neither a pipeline option (see --help) nor a Beam option")
    if options["progress"] is None:
        options["progress"] = sys.stderr.isatty()
    return options, beam_flags


def unknown_beam_flags(flags: list[str]) -> list[str]:
    """Flags that no Beam PipelineOptions class defines (a typo would otherwise be dropped
    with only a warning)."""
    from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser

    parser = _BeamArgumentParser(allow_abbrev=False)
    seen = {}
    for cls in PipelineOptions.__subclasses__():
        seen.setdefault(str(cls), cls)
    for cls in seen.values():
        cls._add_argparse_args(parser)  # noqa: SLF001 - the way Beam itself collects its options
    _, unknown = parser.parse_known_args(flags)
    return [u for u in unknown if u.startswith("-")]


def job_spec(options: dict):
    from transforms.generation import DecodeSpec, EngineSpec
    from transforms.job import JobSpec
    from transforms.prompts import PromptSpec

    return JobSpec(
        output=options["output"],
        prompt=PromptSpec(
            id_column=options["id_column"],
            text_column=options["text_column"],
            template=options["prompt_template"],
            keep_columns=tuple(options["keep_columns"]),
            strip_control_chars=bool(options["strip_control_chars"]),
        ),
        engine=EngineSpec(
            target=options["target"],
            drafter=options["drafter"],
            scheduler=options["scheduler"],
            dtype=options["dtype"],
            device=options["device"],
            batch_size=int(options["batch_size"]),
            trust_remote_code=bool(options["trust_remote_code"]),
        ),
        decode=DecodeSpec(
            max_new_tokens=int(options["max_new_tokens"]),
            temperature=float(options["temperature"]),
            top_k=int(options["top_k"]),
            top_p=float(options["top_p"]),
            stop=tuple(options["stop"]),
            seed=int(options["seed"]),
            chat=bool(options["chat"]),
            parse_special_tokens=bool(options["parse_special_tokens"]),
            truncate_prompts=bool(options["truncate_prompts"]),
            progress=bool(options["progress"]),
            row_time_limit_s=None if options["row_time_limit_s"] is None else float(options["row_time_limit_s"]),
        ),
        rows_per_call=int(options["rows_per_call"]),
        batch_scope=options["batch_scope"],
        skip_bad_files=bool(options["skip_bad_files"]),
    )


def launch_from(options: dict, beam_flags: list[str]):
    """The resolved options as a `transforms.launch.Launch`."""
    from transforms.launch import Launch

    from transforms.health import HealthThresholds

    health = HealthThresholds(max_correction_rate=float(options["health_max_correction_rate"]),
                              max_confidence_entropy=float(options["health_max_confidence_entropy"]),
                              max_gpu_mem_fragmentation=float(options["health_max_gpu_fragmentation"]))
    return Launch(job=job_spec(options), input=options["input"], runner=options["runner"], beam_flags=tuple(beam_flags),
                  resume=bool(options["resume"]), limit_per_shard=options["limit_per_shard"], health=health,
                  fail_on_health=bool(options["fail_on_health"]), config={k: v for k, v in sorted(options.items())})


def build_pipeline(options: dict, beam_flags: list[str]):
    """(pipeline, preflight, job) for the resolved options, after the checks (nothing runs)."""
    from transforms import launch as L

    launch = launch_from(options, beam_flags)
    pre = L.check_launch(launch)
    return L.build_pipeline(launch, pre), pre, launch.job


def run(argv: list[str] | None = None, generator_factory=None, on_progress=None) -> dict:
    """Run the job to completion and return the run summary (`transforms.launch.run`)."""
    from transforms import launch as L

    options, beam_flags = resolve_options(list(sys.argv[1:] if argv is None else argv))
    return L.run(launch_from(options, beam_flags), generator_factory, on_progress)


def configure_logging() -> None:
    """Progress lines from this job at INFO; Beam's own chatter only from WARNING up."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    from transforms.launch import HealthError
    from transforms.outputs import OutputError, ResumeError
    from transforms.preflight import BadInputError  # imports Beam before logging is configured: less noise

    configure_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    try:
        verbose = bool(resolve_options(argv)[0].get("verbose"))
        run(argv)
    except (BadInputError, ConfigError, ResumeError, OutputError) as exc:  # the user's to fix: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except HealthError as exc:  # --fail-on-health: the outputs are complete, a signal breached its threshold
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except Exception as exc:  # a failure during the run (a worker's error comes back here)
        if verbose:
            raise
        print(f"error: {one_line(exc)} (--verbose shows the traceback)", file=sys.stderr)
        return 1
    return 0


def one_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message: Beam re-raises a worker's error
    with the worker's traceback folded into the message."""
    from transforms.prompts import clip

    lines = str(exc).strip().splitlines()
    return clip(f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)


if __name__ == "__main__":
    sys.exit(main())
