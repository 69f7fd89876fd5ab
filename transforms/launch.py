"""Launching the job from the launcher machine: what can be checked without a model, the output
folder, the run (in committed parts on local runners) and the run summary.

    check_launch -> check_writable -> prepare_output (clears or plans --resume) -> run_parts
                 -> build_summary -> write_run_report (report.md) -> write_summary

Everything that can fail on the user's input fails before anything is deleted or any model
loads. `pipelines.generate` turns options into a `Launch` and calls `run`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from transforms.health import HealthThresholds, health_line
from transforms.job import GenerateFromShards, JobSpec, commit_parts, job_settings, unit_identities
from transforms.outputs import ProgressHook, check_writable, delete_files, inside, literal, matching, prepare_output
from transforms.preflight import Preflight, check_inputs, limit_rows
from transforms.run_report import REPORT_FILES, write_run_report
from transforms.schema import SHARD_METRICS_DIR
from transforms.summary import beam_counters, build_summary, read_output_table, write_summary

LOG = logging.getLogger("pipelines.generate")
LOCAL_RUNNERS = ("DirectRunner", "direct", "PrismRunner", "prism", "InteractiveRunner")


class HealthError(RuntimeError):
    """--fail-on-health: the run finished and wrote everything, but a health signal breached."""


class ConfigError(ValueError):
    """Options that cannot work: a bad template, a model or drafter that is not there, local
    paths for a remote runner, a malformed config file."""


@dataclass(frozen=True)
class Launch:
    """One run of the job: what to generate (`job`) and where and how to run it."""

    job: JobSpec
    input: str
    runner: str = "DirectRunner"
    beam_flags: tuple[str, ...] = ()
    resume: bool = False
    limit_per_shard: int | None = None
    health: HealthThresholds = HealthThresholds()
    fail_on_health: bool = False
    config: dict[str, Any] = field(default_factory=dict)  # the resolved options, for run_summary.json


# --- checks (nothing loaded, nothing written) ----------------------------------------------
def check_job(job: JobSpec) -> None:
    """Checks that need no data: a malformed template or a kept column that is also an output
    column fails here, before the files are even listed."""
    from transforms.prompts import template_fields
    from transforms.schema import GENERATION_COLUMNS, TRUNCATED_COLUMN

    try:
        template_fields(job.prompt.template)
    except ValueError as exc:
        raise ConfigError(f"--prompt-template: {exc}") from exc
    clashes = [c for c in job.prompt.keep_columns if c in GENERATION_COLUMNS or c == TRUNCATED_COLUMN]
    if clashes:
        raise ConfigError(f"--keep-columns {', '.join(clashes)}: these names are output columns already")


def check_engine(job: JobSpec) -> None:
    """The target, drafter and scheduler named by the options exist and parse, checked before
    anything is written or deleted (no weights are read: the workers load the models)."""
    from dspark.drafters import check_drafter_spec
    from dspark.models import locate_model
    from dspark.schedulers import make_scheduler

    try:
        _, target_name = locate_model(job.engine.target)
    except FileNotFoundError as exc:
        raise ConfigError(f"--target: {exc}") from exc
    for flag, check in (("--drafter", lambda: check_drafter_spec(job.engine.drafter, target_name)),
                        ("--scheduler", lambda: make_scheduler(job.engine.scheduler))):
        try:
            check()
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"{flag}: {exc}") from exc


def check_remote_paths(runner: str, paths: dict[str, str]) -> None:
    """A remote runner's workers cannot see this machine's files: refuse local paths up front."""
    if runner in LOCAL_RUNNERS:
        return
    local = [f"{flag} {path}" for flag, path in paths.items() if "://" not in path]
    if local:
        raise ConfigError(
            f"{runner} workers cannot read local paths ({'; '.join(local)}): put shards and the output on a "
            "shared filesystem such as gs://bucket/..."
        )


def check_launch(launch: Launch) -> Preflight:
    """The options and the input files checked; nothing loaded, nothing written. Raises
    ConfigError / BadInputError."""
    job = launch.job
    check_job(job)
    check_remote_paths(launch.runner, {"--input": launch.input, "--output": job.output})
    pre = check_inputs(launch.input, job.prompt.required_columns(), skip_bad_files=job.skip_bad_files,
                       text_column=job.prompt.text_column)
    pre.shards = limit_rows(pre.shards, launch.limit_per_shard)
    check_engine(job)
    for problem in pre.skipped:
        LOG.warning("Skipping %s", problem.message())
    LOG.info("Input: %d shard(s), %d row(s)%s", len(pre.shards), pre.num_rows,
             f"; {len(pre.skipped)} file(s) skipped" if pre.skipped else "")
    return pre


def without_files(pre: Preflight, paths: set[str]) -> Preflight:
    """The preflight minus the input files in `paths` (those already complete, on --resume)."""
    return Preflight(
        shards=[s for s in pre.shards if s.path not in paths],
        column_types=pre.column_types,
        skipped=[f for f in pre.skipped if f.path not in paths],
    )


# --- the Beam pipeline ---------------------------------------------------------------------
def pipeline_options(launch: Launch):
    from apache_beam.options.pipeline_options import PipelineOptions, SetupOptions

    flags = list(launch.beam_flags)
    if launch.runner not in ("DirectRunner", "direct"):
        flags.append(f"--runner={launch.runner}")
    po = PipelineOptions(flags)
    # Workers must import transforms/ and dspark/: ship the main session's imports by reference.
    po.view_as(SetupOptions).save_main_session = False
    return po


def make_runner(runner: str):
    """DirectRunner -> the FnApiRunner it would fall back to: Beam 2.77's DirectRunner first tries
    Prism (downloads a Go binary, ignores --direct_running_mode); this job wants neither."""
    if runner in ("DirectRunner", "direct"):
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return FnApiRunner()
    return None


def build_pipeline(launch: Launch, pre: Preflight, generator_factory=None, on_progress: ProgressHook | None = None,
                   share_key: str | None = None):
    """The job's graph over the input files in `pre` (nothing runs yet)."""
    import apache_beam as beam

    from transforms.generation import build_generator

    p = beam.Pipeline(runner=make_runner(launch.runner), options=pipeline_options(launch))
    _ = p | "DSpark" >> GenerateFromShards(pre, launch.job, generator_factory or build_generator, on_progress, share_key)
    return p


def local_workers(beam_flags: tuple[str, ...] | list[str]) -> int:
    """Worker processes (or threads) a local runner uses: --direct_num_workers, 0 = one per CPU."""
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions

    n = PipelineOptions(list(beam_flags)).view_as(DirectOptions).direct_num_workers or 0
    return n if n > 0 else (os.cpu_count() or 1)


def run_parts(launch: Launch, pre: Preflight, generator_factory=None, on_progress: ProgressHook | None = None) -> dict[str, int]:
    """Run the job over `pre` and return its Beam counters. A local runner runs it in parts of
    whole shards, one pipeline after the other, each committing its shards' outputs when it
    ends (a Beam batch pipeline writes nothing until its grouping step has every row), so a
    crash in hour 3 keeps hours 1 and 2 for --resume. A part holds at least --rows-per-call rows
    per worker, so engine calls stay full; the model is loaded once per process for all parts.
    Remote runners take the whole job at once (their service retries failed work)."""
    local = launch.runner in LOCAL_RUNNERS
    parts = commit_parts(pre, launch.job.rows_per_call * local_workers(launch.beam_flags)) if local else [pre]
    share_key = uuid.uuid4().hex
    counters: dict[str, int] = {}
    LOG.info("Running on %s; writing %s%s", launch.runner, launch.job.output,
             f" in {len(parts)} parts, each committed as it ends" if len(parts) > 1 else "")
    for k, part in enumerate(parts, 1):
        if len(parts) > 1:
            LOG.info("Part %d of %d: %d shard(s), %d row(s)", k, len(parts), len(part.shards), part.num_rows)
        result = build_pipeline(launch, part, generator_factory, on_progress, share_key).run()
        result.wait_until_finish()
        for name, value in beam_counters(result).items():
            counters[name] = counters.get(name, 0) + value
    return dict(sorted(counters.items()))


# --- the run -------------------------------------------------------------------------------
def run(launch: Launch, generator_factory=None, on_progress: ProgressHook | None = None) -> dict:
    """Run the job to completion and return the run summary (also written to run_summary.json).
    `on_progress(shard, stage)` is called as each input file's outputs are written (tests use it
    to crash a job part-way)."""
    started = time.perf_counter()
    job = launch.job
    pre = check_launch(launch)
    check_writable(job.output)  # before anything is deleted or any model loads
    plan = prepare_output(job.output, launch.resume, unit_identities(pre), job_settings(job))
    delete_files([f for name in REPORT_FILES for f in matching(literal(inside(job.output, name)))])  # the old run's report
    for shard in plan.changed:
        LOG.warning("Input file changed since its outputs were written; generating it again: %s", shard)
    if launch.resume:
        LOG.info("Resuming: %d input file(s) already complete, %d to process%s", len(plan.complete), len(plan.todo),
                 f"; keeping {len(plan.kept_other)} complete file(s) not in this input" if plan.kept_other else "")
    counters: dict[str, int] = {}
    if plan.todo:
        counters = run_parts(launch, without_files(pre, set(plan.complete)), generator_factory, on_progress)
    wall_s = time.perf_counter() - started
    skipped = [{"file": f.path, "error_type": f.error_type, "error": f.error} for f in pre.skipped]
    resume = {"resumed": launch.resume, "files_already_complete": len(plan.complete),
              "files_processed": len(plan.todo), "files_changed_since": plan.changed,
              "complete_files_kept_from_other_inputs": len(plan.kept_other)}
    summary = build_summary(job.output, wall_s, launch.config | {"beam_flags": list(launch.beam_flags)},
                            counters, skipped, processed=set(plan.todo), thresholds=launch.health) | {"resume": resume}
    closing = end_of_run(summary["totals"])
    try:  # the report is for reading: it never fails a run whose outputs are all written
        report = write_run_report(job.output, summary, read_output_table(job.output, SHARD_METRICS_DIR), closing)
    except Exception as exc:  # noqa: BLE001
        report = f"not written ({type(exc).__name__}: {exc})"
        LOG.warning("Run report %s", report)
    path = write_summary(job.output, summary)  # last: its presence says the run finished
    LOG.info("%s; summary: %s; report: %s", closing, path, report)
    unhealthy = health_line(summary["health"])
    if unhealthy:
        LOG.warning("%s", unhealthy)
        if launch.fail_on_health:
            raise HealthError(f"{unhealthy}; the outputs are complete (--fail-on-health)")
    return summary


def end_of_run(t: dict) -> str:
    """The closing log line: what happened to the rows, then where this run's time went."""
    rows = f"{t['num_records']} rows: {t['num_ok']} generated, {t['num_failed']} in dead_letter"
    if not t["run_output_tokens"]:
        return f"Done in {t['job_wall_s']:.1f} s, nothing to generate; {rows}"
    spec = "" if t["mean_accepted_length"] is None else (
        f", tau {t['mean_accepted_length']:.2f}"
        + ("" if t["acceptance_rate"] is None else f", acceptance {t['acceptance_rate']:.0%}"))
    return (f"Done in {t['job_wall_s']:.1f} s ({t['model_load_s']:.1f} s loading and warming up the model, "
            f"{t['engine_wall_s']:.1f} s generating); {rows}; {t['run_output_tokens']} tokens at "
            f"{t['engine_tokens_per_s']:.1f} tokens/s while generating{spec}")
