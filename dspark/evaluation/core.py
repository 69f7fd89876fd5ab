"""Side-by-side benchmark of generation methods on one prompt set (engine side, no CLI).

Methods:
    hf                 transformers `generate` (batch > 1: its padded batched generate)
    hf-pld             transformers prompt lookup decoding (batch 1 only)
    ar                 this engine without speculation
    SCHED[@DRAFTER]    this engine with a scheduler (fixed:K, threshold:T, util, dspark) and a
                       drafter (any spec of dspark.drafters.make_drafter; default ngram)

All methods see the same prompts. Work is interleaved batch by batch, rotating the order of
methods, so that noise on a shared machine hits every method alike.

Sampling: prompt number i of a run uses seed `seed + i` in every method and at every batch
size, so an engine output does not depend on which batch the prompt lands in.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from dspark.evaluation.quality import corpus_bleu, mean, rouge_l
from dspark.generator import DSparkGenerator
from dspark.hardware import UtilizationReport, UtilizationSampler
from dspark.metrics import RequestStats, aggregate, percentile
from dspark.models import TargetModel
from dspark.sampling import SamplingParams
from dspark.training.data import SPLITS, split_of

HF_METHODS = ("hf", "hf-pld")


@dataclass
class PromptRecord:
    id: str
    text: str
    category: str = "all"
    reference: str | None = None


@dataclass
class Output:
    method: str
    batch_size: int
    prompt_id: str
    category: str
    token_ids: list[int]
    text: str
    latency_s: float
    ttft_s: float | None
    stats: RequestStats | None = None
    scenario: str = "default"
    phase: str = "compare"  # compare | sampling | threshold_sweep | load_sweep
    seed: int | None = None  # the prompt's sampling seed (None: greedy)
    seed_index: int | None = None  # which of the --seeds repetitions

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (the decode rate a streaming user sees)."""
        if self.ttft_s is None or len(self.token_ids) < 2:
            return None
        return (self.latency_s - self.ttft_s) / (len(self.token_ids) - 1)


def first_turn(row: dict) -> tuple[Any, Any]:
    """(text, reference) of the turn a benchmark answers: the first. `turns` and `reference`
    may be lists, one entry per turn (MT-bench and Spec-Bench files), or plain strings; a
    `text` or `prompt` field stands for the first turn. A reference that is not text (null,
    an empty list, a number) counts as none."""
    turns = row.get("turns")
    text = row.get("text") or row.get("prompt") or (turns[0] if isinstance(turns, list) and turns else turns)
    reference = row.get("reference")
    if isinstance(reference, list):
        reference = reference[0] if reference else None
    return text, reference if isinstance(reference, str) and reference.strip() else None


def load_prompts(
    path: str | Path, limit: int | None = None, categories: Sequence[str] | None = None, split: str | None = None
) -> list[PromptRecord]:
    """JSON Lines in the `turns` format (MT-bench style: a list of user turns, optionally a
    `reference` per turn and `category` or `domain`) or Parquet with id/text (or prompt/turns)
    and category/domain columns. The first turn is the prompt, and its reference the one scored
    (`first_turn`). split: keep only ids in that split of the drafter's training data (train,
    calib or eval; `dspark.training.data.split_of`), before `limit`."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = []
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    out = []
    for n, row in enumerate(rows):
        text, reference = first_turn(row)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: record {n} has no text/prompt/turns[0]")
        cat = row.get("category") or row.get("domain") or "all"
        if categories and cat not in categories:
            continue
        if split is not None and split_of(str(row.get("id", row.get("question_id", n)))) != split:
            continue
        out.append(PromptRecord(str(row.get("id", row.get("question_id", n))), text, str(cat), reference))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no prompts selected")
    return out


def load_prompt_files(
    paths: Sequence[str | Path], limit: int | None = None, categories: Sequence[str] | None = None, split: str | None = None
) -> list[PromptRecord]:
    """Several prompt files in order; `limit` applies per file so every file is represented.
    Ids repeated across files get the file's stem as a prefix."""
    out: list[PromptRecord] = []
    seen: set[str] = set()
    for path in paths:
        try:
            recs = load_prompts(path, limit, categories, split)
        except ValueError as e:
            if (categories or split) and "no prompts selected" in str(e):
                continue  # a category or split filter may rightly exclude a whole file
            raise
        for r in recs:
            if r.id in seen:
                r.id = f"{Path(path).stem}:{r.id}"
            seen.add(r.id)
        out.extend(recs)
    if not out:
        raise ValueError(f"no prompts selected from {', '.join(map(str, paths))}")
    return out


def split_method(method: str, default_drafter: str = "ngram") -> tuple[str, str | None]:
    """'dspark@ngram' -> ('dspark', 'ngram'); 'ar' -> ('ar', None)."""
    sched, _, drafter = method.partition("@")
    if sched in HF_METHODS or sched == "ar":
        return sched, None
    return sched, drafter or default_drafter


def _left_pad(batch: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


class StepClock(BaseStreamer):
    """Records when transformers hands over each step's tokens (the first put is the prompt),
    which gives `hf` a time to first token and per-row finish times inside a padded batch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@dataclass
class HFResult:
    token_ids: list[int]
    latency_s: float
    ttft_s: float | None


def hf_generate(
    target: TargetModel,
    batch: list[list[int]],
    max_new_tokens: int,
    prompt_lookup: bool = False,
    sampling: SamplingParams | None = None,
    seed: int | None = None,
    timed: bool = False,
) -> list[list[int]] | list[HFResult]:
    """transformers' own generate (greedy unless `sampling` samples), stopping at the target's
    EOS tokens. With `timed`, returns HFResult rows with latency and time to first token."""
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else target.eos_token_ids[0]
    ids, mask = _left_pad(batch, pad, target.device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=target.eos_token_ids, pad_token_id=pad)
    if sampling is not None and not sampling.greedy:
        # explicit values: the model's generation_config may carry other defaults (top_k=50)
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        if seed is not None:
            torch.manual_seed(seed)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = 10
    clock = StepClock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = target.model.generate(ids, attention_mask=mask, streamer=clock, **kwargs)
    t_end = time.perf_counter()
    eos = set(target.eos_token_ids)
    results: list[HFResult] = []
    steps = clock.times[1:]  # after the prompt
    for row in out[:, ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        # one put per step in plain decoding; prompt lookup puts several tokens at once
        done = steps[cut - 1] if (not prompt_lookup and len(batch) > 1 and cut - 1 < len(steps)) else t_end
        ttft = (steps[0] - t0) if steps else None
        results.append(HFResult(row[:cut], done - t0, ttft))
    if timed:
        return results
    return [r.token_ids for r in results]


@dataclass
class Run:
    method: str
    batch_size: int
    wall_s: float = 0.0
    outputs: list[Output] = field(default_factory=list)
    scenario: str = "default"
    phase: str = "compare"
    seed_index: int | None = None
    # utilisation while this run's items ran, weighted by their wall time (NVML on CUDA)
    gpu_util_s: float = 0.0
    gpu_sampled_s: float = 0.0
    cpu_util_s: float = 0.0
    cpu_sampled_s: float = 0.0

    def add_usage(self, wall: float, usage: UtilizationReport) -> None:
        if usage.gpu_util_mean is not None:
            self.gpu_util_s += usage.gpu_util_mean * wall
            self.gpu_sampled_s += wall
        if usage.cpu_util_mean is not None:
            self.cpu_util_s += usage.cpu_util_mean * wall
            self.cpu_sampled_s += wall

    def usage(self) -> dict:
        return {
            "gpu_util_mean": self.gpu_util_s / self.gpu_sampled_s if self.gpu_sampled_s > 0 else None,
            "cpu_util_mean": self.cpu_util_s / self.cpu_sampled_s if self.cpu_sampled_s > 0 else None,
        }


def run_benchmark(
    target: TargetModel,
    prompts: list[PromptRecord],
    methods: list[str],
    batch_sizes: list[int],
    max_new_tokens: int,
    make_generator: Callable[[str, int], DSparkGenerator],
    progress: Callable[[str], None] | None = None,
    *,
    on_run: Callable[[Run], None] | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    seed_index: int | None = None,
    scenario: str = "default",
    phase: str = "compare",
) -> list[Run]:
    """Run every method at every batch size over the same prompts, interleaved per batch.
    With a sampling `sampling`, prompt i is seeded `seed + i` (engine: exactly, whatever the
    batch; `hf`: its batch shares one torch seed, exact per prompt at batch size 1).
    `on_run(run)` is called as each run is complete, so its measurements can be saved then."""
    sampling = sampling or SamplingParams()
    encoded = [target.encode(p.text) for p in prompts]
    runs: list[Run] = []
    for bs in batch_sizes:
        active = [m for m in methods if not (m == "hf-pld" and bs > 1)]
        by_method = {m: Run(m, bs, scenario=scenario, phase=phase, seed_index=seed_index) for m in active}
        generators = {m: make_generator(m, bs) for m in active if m not in HF_METHODS}
        chunks = [list(range(i, min(i + bs, len(prompts)))) for i in range(0, len(prompts), bs)]
        for c, chunk in enumerate(chunks):
            order = active[c % len(active) :] + active[: c % len(active)]
            for m in order:
                batch = [encoded[i] for i in chunk]
                seeds = [None if sampling.greedy else seed + i for i in chunk]
                tag = dict(scenario=scenario, phase=phase, seed_index=seed_index)
                sampler = UtilizationSampler(interval_s=0.1, device=target.device).start()
                t0 = time.perf_counter()
                if m in HF_METHODS:
                    res = hf_generate(target, batch, max_new_tokens, m == "hf-pld", sampling, seeds[0], timed=True)
                    wall = time.perf_counter() - t0
                    outs = [
                        Output(m, bs, prompts[i].id, prompts[i].category, r.token_ids,
                               target.tokenizer.decode(r.token_ids, skip_special_tokens=True), r.latency_s, r.ttft_s,
                               seed=s, **tag)
                        for i, r, s in zip(chunk, res, seeds)
                    ]
                else:
                    # generate() seeds row j with seed + j: start at the chunk's first index
                    res = generators[m].generate(
                        batch, max_new_tokens=max_new_tokens, temperature=sampling.temperature,
                        top_k=sampling.top_k, top_p=sampling.top_p, seed=seed + chunk[0],
                    )
                    wall = time.perf_counter() - t0
                    outs = [
                        Output(m, bs, prompts[i].id, prompts[i].category, r.token_ids, r.text, r.latency_s, r.ttft_s,
                               r.stats, seed=s, **tag)
                        for i, r, s in zip(chunk, res, seeds)
                    ]
                by_method[m].wall_s += wall
                by_method[m].add_usage(wall, sampler.stop())
                by_method[m].outputs.extend(outs)
                if progress:
                    progress(m)
        for run in by_method.values():  # complete: every chunk of this batch size measured
            if on_run:
                on_run(run)
            runs.append(run)
    return runs


def _opt_percentile(values: list[float | None], q: float) -> float | None:
    vals = [v for v in values if v is not None]
    return percentile(vals, q) if vals else None


def latency_summary(outputs: list[Output]) -> dict:
    """Per-request latency, time to first token and time per output token percentiles."""
    lat = [o.latency_s for o in outputs]
    ttft = [o.ttft_s for o in outputs]
    tpot = [o.tpot_s for o in outputs]
    tpot_vals = [v for v in tpot if v is not None]
    return {
        "p50_latency_s": percentile(lat, 50),
        "p90_latency_s": percentile(lat, 90),
        "p99_latency_s": percentile(lat, 99),
        "p50_ttft_s": _opt_percentile(ttft, 50),
        "p90_ttft_s": _opt_percentile(ttft, 90),
        "p99_ttft_s": _opt_percentile(ttft, 99),
        "mean_tpot_s": mean(tpot_vals) if tpot_vals else None,
        "p50_tpot_s": _opt_percentile(tpot, 50),
        "p90_tpot_s": _opt_percentile(tpot, 90),
        "p99_tpot_s": _opt_percentile(tpot, 99),
    }


def quality_summary(outputs: list[Output], hf_text: dict[str, str] | None, references: dict[str, str] | None) -> dict:
    """ROUGE-L F1 (mean over outputs) and corpus BLEU against the `hf` outputs and against
    the prompt file's references; None where there is nothing to compare with."""
    vs_hf = [o for o in outputs if hf_text and o.prompt_id in hf_text]
    vs_ref = [o for o in outputs if references and references.get(o.prompt_id)]
    return {
        "rouge_l_vs_hf": mean([rouge_l(o.text, hf_text[o.prompt_id]) for o in vs_hf]) if vs_hf else None,
        "bleu_vs_hf": corpus_bleu([o.text for o in vs_hf], [hf_text[o.prompt_id] for o in vs_hf]) if vs_hf else None,
        "num_references": len(vs_ref),
        "rouge_l_vs_reference": mean([rouge_l(o.text, references[o.prompt_id]) for o in vs_ref]) if vs_ref else None,
        "bleu_vs_reference": corpus_bleu([o.text for o in vs_ref], [references[o.prompt_id] for o in vs_ref]) if vs_ref else None,
    }


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first output token that differs from the reference (a length difference
    counts at the shorter length); None when the two are identical."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _summary(outputs: list[Output], wall_s: float, ref: dict[str, list[int]] | None, hf_wall: float | None) -> dict:
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = aggregate([o.stats for o in outputs if o.stats is not None])
    has_stats = any(o.stats is not None for o in outputs)
    tps = tokens / wall_s if wall_s > 0 else 0.0
    same = [o.token_ids == ref[o.prompt_id] for o in outputs if ref and o.prompt_id in ref]
    divergence = [first_divergence(o.token_ids, ref[o.prompt_id]) for o in outputs if ref and o.prompt_id in ref]
    lat = latency_summary(outputs)
    return {
        "num_prompts": len(outputs),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tps,
        "speedup_vs_hf": (hf_wall / wall_s) if hf_wall and wall_s > 0 else None,
        "identical_to_hf": (sum(same) / len(same)) if same else None,
        # how early outputs leave hf's (expected only outside float32): one entry per differing prompt
        "first_divergence_tokens": sorted(i for i in divergence if i is not None) if ref else None,
        # transformers' generate reports no rounds: unknown for hf-pld, not 1
        "mean_accepted_length": stats.mean_accepted_length if has_stats else None,
        "acceptance_rate": stats.acceptance_rate if has_stats else None,
        "correction_rate": stats.correction_rate if has_stats else None,
        "mean_verify_budget": stats.mean_verify_budget if has_stats else 0.0,
        # rounds that drafted at all (the rest skipped it: the draft gate or back-off)
        "draft_share": stats.draft_share if has_stats else 0.0,
        # the same per request, then averaged: every request counts once, however long
        "mean_request_verify_budget": mean([o.stats.mean_verify_budget for o in outputs if o.stats]) if has_stats else 0.0,
        "confidence_entropy": (stats.confidence_entropy if stats.confidences else None) if has_stats else None,
        "p50_latency_s": lat.pop("p50_latency_s"),
        "p99_latency_s": lat.pop("p99_latency_s"),
        **lat,
    }


def summarise(runs: list[Run], references: dict[str, str] | None = None) -> list[dict]:
    """results.json rows. Speedups compare tokens/s against `hf` of the same scenario, phase
    and batch size (per category: tokens over summed request latencies). Quality compares
    texts with that `hf` run and with `references` (prompt id -> reference text)."""
    rows = []
    hf_runs = {(r.scenario, r.phase, r.seed_index, r.batch_size): r for r in runs if r.method == "hf"}
    # `ar` is the engine without drafts: a method's speed-up over it is speculation alone
    ar_runs = {(r.scenario, r.phase, r.seed_index, r.batch_size): r for r in runs if r.method == "ar"}
    for run in runs:
        hf = hf_runs.get((run.scenario, run.phase, run.seed_index, run.batch_size))
        ref = {o.prompt_id: o.token_ids for o in hf.outputs} if hf else None
        hf_text = {o.prompt_id: o.text for o in hf.outputs} if hf else None
        row = {"method": run.method, "batch_size": run.batch_size, "scenario": run.scenario}
        if run.seed_index is not None:
            row["seed_index"] = run.seed_index
        row.update(_summary(run.outputs, run.wall_s, ref, None))
        row.update(run.usage())
        row.update(quality_summary(run.outputs, hf_text, references))
        if hf:
            hf_tps = sum(len(o.token_ids) for o in hf.outputs) / hf.wall_s if hf.wall_s > 0 else 0.0
            row["speedup_vs_hf"] = row["tokens_per_s"] / hf_tps if hf_tps > 0 else None
        ar = ar_runs.get((run.scenario, run.phase, run.seed_index, run.batch_size))
        if ar and ar.wall_s > 0:
            ar_tps = sum(len(o.token_ids) for o in ar.outputs) / ar.wall_s
            row["speedup_vs_ar"] = row["tokens_per_s"] / ar_tps if ar_tps > 0 else None
        by_cat = defaultdict(list)
        for o in run.outputs:
            by_cat[o.category].append(o)
        hf_cat = defaultdict(list)
        if hf:
            for o in hf.outputs:
                hf_cat[o.category].append(o)
        row["by_category"] = {}
        for cat, outs in sorted(by_cat.items()):
            busy = sum(o.latency_s for o in outs)
            s = _summary(outs, busy, ref, None)
            s.update(quality_summary(outs, hf_text, references))
            if hf_cat.get(cat):
                hf_busy = sum(o.latency_s for o in hf_cat[cat])
                hf_tps = sum(len(o.token_ids) for o in hf_cat[cat]) / hf_busy if hf_busy > 0 else 0.0
                s["speedup_vs_hf"] = s["tokens_per_s"] / hf_tps if hf_tps > 0 else None
            row["by_category"][cat] = s
        rows.append(row)
    return rows
