"""Side-by-side benchmark of generation methods on one prompt set (engine side, no CLI).

Methods:
    hf                 transformers `generate`, greedy (batch > 1: its padded batched generate)
    hf-pld             transformers prompt lookup decoding (batch 1 only)
    ar                 this engine without speculation
    SCHED[@DRAFTER]    this engine with a scheduler (fixed:K, threshold:T, util, dspark) and a
                       drafter (ngram, draft-model:PATH, dspark[:PATH]; default ngram)

All methods see the same prompts. Work is interleaved batch by batch, rotating the order of
methods, so that noise on a shared machine hits every method alike.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.generator import DSparkGenerator
from dspark.metrics import RequestStats, aggregate, percentile
from dspark.models import TargetModel

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


def load_prompts(path: str | Path, limit: int | None = None, categories: Sequence[str] | None = None) -> list[PromptRecord]:
    """JSON Lines in the `turns` format (first turn is the user message; `category` or
    `domain` optional) or Parquet with id/text (or prompt/turns) and category/domain columns."""
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
        text = row.get("text") or row.get("prompt") or (row.get("turns") or [None])[0]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: record {n} has no text/prompt/turns[0]")
        cat = row.get("category") or row.get("domain") or "all"
        if categories and cat not in categories:
            continue
        out.append(PromptRecord(str(row.get("id", n)), text, str(cat), row.get("reference")))
        if limit and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no prompts selected")
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


def hf_generate(target: TargetModel, batch: list[list[int]], max_new_tokens: int, prompt_lookup: bool = False) -> list[list[int]]:
    """transformers' own greedy generate, stopping at the target's EOS tokens."""
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else target.eos_token_ids[0]
    ids, mask = _left_pad(batch, pad, target.device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=target.eos_token_ids, pad_token_id=pad)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = 10
    with torch.no_grad():
        out = target.model.generate(ids, attention_mask=mask, **kwargs)
    eos = set(target.eos_token_ids)
    results = []
    for row in out[:, ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        results.append(row[:cut])
    return results


@dataclass
class Run:
    method: str
    batch_size: int
    wall_s: float = 0.0
    outputs: list[Output] = field(default_factory=list)


def run_benchmark(
    target: TargetModel,
    prompts: list[PromptRecord],
    methods: list[str],
    batch_sizes: list[int],
    max_new_tokens: int,
    make_generator: Callable[[str, int], DSparkGenerator],
    progress: Callable[[str], None] | None = None,
) -> list[Run]:
    """Run every method at every batch size over the same prompts, interleaved per batch."""
    encoded = [target.encode(p.text) for p in prompts]
    runs: list[Run] = []
    for bs in batch_sizes:
        active = [m for m in methods if not (m == "hf-pld" and bs > 1)]
        by_method = {m: Run(m, bs) for m in active}
        generators = {m: make_generator(m, bs) for m in active if m not in HF_METHODS}
        chunks = [list(range(i, min(i + bs, len(prompts)))) for i in range(0, len(prompts), bs)]
        for c, chunk in enumerate(chunks):
            order = active[c % len(active) :] + active[: c % len(active)]
            for m in order:
                batch = [encoded[i] for i in chunk]
                t0 = time.perf_counter()
                if m in HF_METHODS:
                    toks = hf_generate(target, batch, max_new_tokens, prompt_lookup=(m == "hf-pld"))
                    wall = time.perf_counter() - t0
                    outs = [
                        Output(m, bs, prompts[i].id, prompts[i].category, t, target.tokenizer.decode(t, skip_special_tokens=True), wall, None)
                        for i, t in zip(chunk, toks)
                    ]
                else:
                    res = generators[m].generate(batch, max_new_tokens=max_new_tokens)
                    wall = time.perf_counter() - t0
                    outs = [
                        Output(m, bs, prompts[i].id, prompts[i].category, r.token_ids, r.text, r.latency_s, r.ttft_s, r.stats)
                        for i, r in zip(chunk, res)
                    ]
                by_method[m].wall_s += wall
                by_method[m].outputs.extend(outs)
                if progress:
                    progress(m)
        runs.extend(by_method.values())
    return runs


def _summary(outputs: list[Output], wall_s: float, ref: dict[str, list[int]] | None, hf_wall: float | None) -> dict:
    tokens = sum(len(o.token_ids) for o in outputs)
    stats = aggregate([o.stats for o in outputs if o.stats is not None])
    has_stats = any(o.stats is not None for o in outputs)
    lat = [o.latency_s for o in outputs]
    tps = tokens / wall_s if wall_s > 0 else 0.0
    same = [o.token_ids == ref[o.prompt_id] for o in outputs if ref and o.prompt_id in ref]
    return {
        "num_prompts": len(outputs),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tps,
        "speedup_vs_hf": (hf_wall / wall_s) if hf_wall and wall_s > 0 else None,
        "identical_to_hf": (sum(same) / len(same)) if same else None,
        "mean_accepted_length": stats.mean_accepted_length if has_stats else 1.0,
        "acceptance_rate": stats.acceptance_rate if has_stats else None,
        "correction_rate": stats.correction_rate if has_stats else None,
        "mean_verify_budget": stats.mean_verify_budget if has_stats else 0.0,
        "p50_latency_s": percentile(lat, 50),
        "p99_latency_s": percentile(lat, 99),
    }


def summarise(runs: list[Run]) -> list[dict]:
    """results.json rows. Speedups compare wall time for the same tokens-worth of prompts
    against `hf` at the same batch size (per category: summed request latencies)."""
    rows = []
    hf_by_bs = {r.batch_size: r for r in runs if r.method == "hf"}
    for run in runs:
        hf = hf_by_bs.get(run.batch_size)
        ref = {o.prompt_id: o.token_ids for o in hf.outputs} if hf else None
        # per-method wall time normalised by tokens: compare time for equal work
        row = {"method": run.method, "batch_size": run.batch_size}
        row.update(_summary(run.outputs, run.wall_s, ref, None))
        if hf:
            hf_tps = sum(len(o.token_ids) for o in hf.outputs) / hf.wall_s if hf.wall_s > 0 else 0.0
            row["speedup_vs_hf"] = row["tokens_per_s"] / hf_tps if hf_tps > 0 else None
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
            if hf_cat.get(cat):
                hf_busy = sum(o.latency_s for o in hf_cat[cat])
                hf_tps = sum(len(o.token_ids) for o in hf_cat[cat]) / hf_busy if hf_busy > 0 else 0.0
                s["speedup_vs_hf"] = s["tokens_per_s"] / hf_tps if hf_tps > 0 else None
            row["by_category"][cat] = s
        rows.append(row)
    return rows


def write_outputs(runs: list[Run], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for run in runs:
            for o in run.outputs:
                rec = {
                    "method": o.method,
                    "batch_size": o.batch_size,
                    "prompt_id": o.prompt_id,
                    "category": o.category,
                    "text": o.text,
                    "token_ids": o.token_ids,
                    "num_output_tokens": len(o.token_ids),
                    "latency_s": o.latency_s,
                    "ttft_s": o.ttft_s,
                    "stats": o.stats.summary() if o.stats else None,
                }
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
