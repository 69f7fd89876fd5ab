"""Evaluation: the side-by-side benchmark (core), text quality, sweeps, resources, the report."""

from dspark.evaluation.core import (
    HF_METHODS,
    Output,
    PromptRecord,
    Run,
    hf_generate,
    latency_summary,
    load_prompt_files,
    load_prompts,
    quality_summary,
    run_benchmark,
    split_method,
    summarise,
)
from dspark.evaluation.raw import RawWriter, output_record, read_measurement, read_runs

__all__ = [
    "HF_METHODS",
    "Output",
    "PromptRecord",
    "Run",
    "hf_generate",
    "latency_summary",
    "load_prompt_files",
    "load_prompts",
    "RawWriter",
    "output_record",
    "quality_summary",
    "read_measurement",
    "read_runs",
    "run_benchmark",
    "split_method",
    "summarise",
]
