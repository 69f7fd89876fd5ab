"""An evaluation's raw measurements, saved as they are taken, so that neither a crash nor a
failure while summarising loses what was measured; the report is rebuilt from them.

    DIR/outputs.jsonl      one line per output (every phase but the soak), appended as each run
                           ends: the text and tokens, timings, the reference it is scored against,
                           the speculation counters (`counts`) and their ratios (`stats`)
    DIR/runs.jsonl         one line per run (method x batch size x scenario x phase x seed),
                           after its outputs: wall time and utilisation
    DIR/measurement.json   settings (written before the first run), then resources, soak and
                           failures (written when measuring ends)

`read_runs(DIR)` gives the runs back with their outputs; `pipelines.evaluate --rebuild` turns
the three files into results.json, report.md and the plots.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from dspark.evaluation.core import Output, Run
from dspark.metrics import RequestStats

OUTPUTS_FILE = "outputs.jsonl"
RUNS_FILE = "runs.jsonl"
MEASUREMENT_FILE = "measurement.json"
RUN_FIELDS = ("method", "batch_size", "scenario", "phase", "seed_index", "wall_s",
              "gpu_util_s", "gpu_sampled_s", "cpu_util_s", "cpu_sampled_s")
STATS_FIELDS = tuple(f.name for f in fields(RequestStats))


def run_key(record: dict) -> tuple:
    return record["method"], record["batch_size"], record["scenario"], record["phase"], record["seed_index"]


def output_record(o: Output, reference: str | None = None) -> dict:
    return {
        "method": o.method,
        "batch_size": o.batch_size,
        "scenario": o.scenario,
        "phase": o.phase,
        "seed": o.seed,
        "seed_index": o.seed_index,
        "prompt_id": o.prompt_id,
        "category": o.category,
        "text": o.text,
        "token_ids": o.token_ids,
        "num_output_tokens": len(o.token_ids),
        "latency_s": o.latency_s,
        "ttft_s": o.ttft_s,
        "tpot_s": o.tpot_s,
        "reference": reference,
        "stats": o.stats.summary() if o.stats else None,
        "counts": asdict(o.stats) if o.stats else None,
    }


def output_from_record(r: dict) -> Output:
    counts = r.get("counts")
    stats = RequestStats(**{k: v for k, v in counts.items() if k in STATS_FIELDS}) if counts else None
    return Output(r["method"], r["batch_size"], r["prompt_id"], r["category"], r["token_ids"], r["text"], r["latency_s"],
                  r["ttft_s"], stats, scenario=r["scenario"], phase=r["phase"], seed=r["seed"], seed_index=r["seed_index"])


class RawWriter:
    """Starts DIR's raw files afresh and appends each run as it completes (`add`, the
    `on_run` hook of `run_benchmark`). A run's line follows its outputs: a run torn by a crash
    has no line and is left out when reading back."""

    def __init__(self, out: Path, references: dict[str, str]):
        self.out = Path(out)
        self.references = references
        self.out.mkdir(parents=True, exist_ok=True)
        for name in (OUTPUTS_FILE, RUNS_FILE, MEASUREMENT_FILE):
            (self.out / name).unlink(missing_ok=True)

    def add(self, run: Run) -> None:
        with (self.out / OUTPUTS_FILE).open("a", encoding="utf-8") as f:
            for o in run.outputs:
                f.write(json.dumps(output_record(o, self.references.get(o.prompt_id)), ensure_ascii=False) + "\n")
        with (self.out / RUNS_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps({name: getattr(run, name) for name in RUN_FIELDS}) + "\n")

    def measurement(self, measurement: dict[str, Any], default=None) -> None:
        path = self.out / MEASUREMENT_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(measurement, indent=1, default=default), encoding="utf-8")
        tmp.replace(path)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a run killed while writing it
            continue
    return rows


def read_runs(out: Path) -> tuple[list[Run], dict[str, str]]:
    """(runs with their outputs, prompt id -> reference) from DIR's raw files."""
    out = Path(out)
    by_key: dict[tuple, list[Output]] = {}
    references: dict[str, str] = {}
    for r in read_jsonl(out / OUTPUTS_FILE):
        by_key.setdefault(run_key(r), []).append(output_from_record(r))
        if r.get("reference"):
            references[r["prompt_id"]] = r["reference"]
    runs = []
    for r in read_jsonl(out / RUNS_FILE):
        run = Run(**{name: r[name] for name in RUN_FIELDS})
        run.outputs = by_key.get(run_key(r), [])
        runs.append(run)
    return runs, references


def read_measurement(out: Path) -> dict[str, Any]:
    path = Path(out) / MEASUREMENT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {Path(out)} holds no evaluation run")
    return json.loads(path.read_text(encoding="utf-8"))
