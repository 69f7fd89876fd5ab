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
    output_record,
    quality_summary,
    run_benchmark,
    split_method,
    summarise,
    write_outputs,
)

__all__ = [
    "HF_METHODS",
    "Output",
    "PromptRecord",
    "Run",
    "hf_generate",
    "latency_summary",
    "load_prompt_files",
    "load_prompts",
    "output_record",
    "quality_summary",
    "run_benchmark",
    "split_method",
    "summarise",
    "write_outputs",
]
