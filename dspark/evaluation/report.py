"""DIR/report.md and its PNG plots, rendered from the results dictionary (results.json)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from dspark.evaluation.core import Output  # noqa: E402


# --- formatting ----------------------------------------------------------------------------
def fmt(value, spec: str = ".2f") -> str:
    """A table cell: '-' for missing values and NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if spec == "%":
        return f"{100 * value:.1f}%"
    if spec == "MiB":
        return f"{value / 2**20:.1f}"
    return format(value, spec)


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def parse_md_table(markdown: str, heading: str) -> list[dict[str, str]]:
    """The first table after `heading` as dicts (header -> cell); for tests and tools."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    table = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
        elif line.startswith("#"):
            break
    if len(table) < 2:
        return []
    cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    headers = cells(table[0])
    return [dict(zip(headers, cells(line))) for line in table[2:]]


# --- tables ----------------------------------------------------------------------------------
RESULTS_COLUMNS = [
    ("scenario", "scenario", None),
    ("method", "method", None),
    ("batch", "batch_size", "d"),
    ("prompts", "num_prompts", "d"),
    ("tokens", "output_tokens", "d"),
    ("tok/s", "tokens_per_s", ".2f"),
    ("vs hf", "speedup_vs_hf", ".3f"),
    ("vs ar", "speedup_vs_ar", ".3f"),
    ("same as hf", "identical_to_hf", "%"),
    ("tau", "mean_accepted_length", ".3f"),
    ("accept", "acceptance_rate", "%"),
    ("correct", "correction_rate", "%"),
    ("budget", "mean_verify_budget", ".3f"),
    ("drafted", "draft_share", "%"),
    ("ROUGE-L vs hf", "rouge_l_vs_hf", ".4f"),
    ("BLEU vs hf", "bleu_vs_hf", ".2f"),
    ("ROUGE-L vs ref", "rouge_l_vs_reference", ".4f"),
    ("BLEU vs ref", "bleu_vs_reference", ".2f"),
    ("p50 s", "p50_latency_s", ".3f"),
    ("p99 s", "p99_latency_s", ".3f"),
    ("CPU util", "cpu_util_mean", "%"),
    ("GPU util", "gpu_util_mean", "%"),
]

CATEGORY_COLUMNS = [
    ("tok/s", "tokens_per_s", ".2f"),
    ("vs hf", "speedup_vs_hf", ".3f"),
    ("tau", "mean_accepted_length", ".3f"),
    ("accept", "acceptance_rate", "%"),
    ("correct", "correction_rate", "%"),
    ("ROUGE-L vs ref", "rouge_l_vs_reference", ".4f"),
    ("BLEU vs ref", "bleu_vs_reference", ".2f"),
]

LATENCY_COLUMNS = [
    ("p50 s", "p50_latency_s", ".3f"),
    ("p90 s", "p90_latency_s", ".3f"),
    ("p99 s", "p99_latency_s", ".3f"),
    ("TTFT p50 s", "p50_ttft_s", ".3f"),
    ("TTFT p99 s", "p99_ttft_s", ".3f"),
    ("TPOT mean ms", "mean_tpot_s", "ms"),
    ("TPOT p50 ms", "p50_tpot_s", "ms"),
    ("TPOT p99 ms", "p99_tpot_s", "ms"),
]

SWEEP_COLUMNS = [
    ("tok/s", "tokens_per_s", ".2f"),
    ("budget", "mean_verify_budget", ".3f"),
    ("budget per request", "mean_request_verify_budget", ".3f"),
    ("tau", "mean_accepted_length", ".3f"),
    ("accept", "acceptance_rate", "%"),
    ("correct", "correction_rate", "%"),
    ("conf. entropy", "confidence_entropy", ".3f"),
    ("TPOT ms", "mean_tpot_s", "ms"),
]


def _cell(row: dict, key: str, spec: str | None) -> str:
    v = row.get(key)
    if spec is None:
        return str(v)
    if spec == "d":
        return "-" if v is None else str(int(v))
    if spec == "ms":
        return fmt(None if v is None else 1000 * v, ".1f")
    return fmt(v, spec)


def _table(rows: list[dict], columns: list[tuple[str, str, str | None]]) -> str:
    return md_table([c[0] for c in columns], [[_cell(r, k, s) for _, k, s in columns] for r in rows])


def header_section(settings: dict) -> str:
    keys = [
        ("date", "date"), ("machine", "machine"), ("device", "device"), ("target", "target"),
        ("target parameters", "target_parameters"), ("dtype", "dtype"), ("drafters", "drafters"), ("cost table (rows: forward time by width)", "cost_table"),
        ("scenarios", "scenarios"), ("methods", "methods"), ("batch sizes", "batch_sizes"),
        ("sampling", "sampling"), ("threshold sweep", "thresholds"), ("load sweep", "load_sweep"),
        ("soak", "soak"), ("versions", "versions"), ("elapsed", "elapsed_s"),
    ]
    rows = []
    for label, key in keys:
        v = settings.get(key)
        if v is None:
            continue
        if isinstance(v, dict):
            v = ", ".join(f"{k} {x}" for k, x in v.items())
        elif isinstance(v, list):
            v = ", ".join(map(str, v))
        elif key == "elapsed_s":
            v = f"{v:.0f} s"
        rows.append([label, str(v).replace("|", "/")])
    return "\n\n".join([md_table(["setting", "value"], rows), "Command:", f"```bash\n{settings.get('command', '')}\n```"])


def _category_rows(runs: list[dict]) -> list[dict]:
    out = []
    for r in runs:
        for cat, s in r.get("by_category", {}).items():
            out.append({"scenario": r.get("scenario"), "method": r["method"], "batch_size": r["batch_size"], "category": cat, **s})
    return out


def compare_sections(runs: list[dict], plots: dict[str, str]) -> list[str]:
    """Results, By category and Latency: the comparison phase (absent when it did not run)."""
    parts: list[str] = []

    def img(key: str, alt: str) -> None:
        if key in plots:
            parts.append(f"![{alt}]({plots[key]})")
    parts += ["## Results", "Greedy decoding; every method on the same prompts, interleaved batch by batch. "
              "`vs hf` = tokens/s over transformers `generate` at the same batch size; `same as hf` = outputs "
              "token-identical to it; quality columns compare texts with the `hf` outputs and with the prompt "
              "file's references (ROUGE-L F1 with stemming; corpus BLEU).", _table(runs, RESULTS_COLUMNS)]
    diverged = divergence_text(runs)
    if diverged:
        parts.append(diverged)

    parts += ["## By category", _table(_category_rows(runs), RESULTS_COLUMNS[:3] + [("category", "category", None)] + CATEGORY_COLUMNS)]
    img("speedup_by_category", "speedup by category")
    img("tau_acceptance_by_category", "tau and acceptance by category")

    parts += ["## Latency", "Per request: latency from admission to last token, TTFT = time to first token, "
              "TPOT = time per output token after the first. `hf` rows in a padded batch finish when their "
              "last token is produced.", _table(runs, RESULTS_COLUMNS[:3] + LATENCY_COLUMNS)]
    img("latency", "latency distributions")
    return parts


def render_markdown(results: dict, plots: dict[str, str]) -> str:
    s = results["settings"]
    parts = [f"# DSpark evaluation report: {s.get('target')} on {s.get('device')}", header_section(s)]
    if results.get("failures"):
        parts += ["## Failed phases", "These phases stopped with an error; the sections below lack their results.",
                  "\n".join(f"- {f['phase']}: `{f['error']}`" for f in results["failures"])]

    def img(key: str, alt: str) -> None:
        if key in plots:
            parts.append(f"![{alt}]({plots[key]})")

    runs = results.get("runs") or []
    if runs:
        parts += compare_sections(runs, plots)

    sampling = results.get("sampling")
    if sampling and sampling.get("methods"):
        parts += ["## Sampling", sampling_text(sampling), sampling_table(sampling)]
        img("sampling", "sampled output distributions")

    if results.get("threshold_sweep"):
        parts += ["## Threshold sweep", "Verify budget = draft tokens sent to the target per row and round.",
                  _table(results["threshold_sweep"], [("threshold", "threshold", ".2f"), ("method", "method", None), ("batch", "batch_size", "d")] + SWEEP_COLUMNS)]
        img("threshold_sweep", "threshold sweep")

    load = results.get("load_sweep")
    if load and load.get("rows"):
        parts += ["## Load sweep", "Tokens/s and mean verify budget per row and round as the batch grows "
                  "(paper Figure 8: the budget should fall with load and `dspark` stay at or above every fixed K). "
                  "Tokens/s includes prefill, which dominates when prompts are long and outputs short; TPOT "
                  "(mean time per output token after the first) is the decode-only view.",
                  _table(load["rows"], [("scenario", "scenario", None), ("method", "method", None), ("batch", "batch_size", "d")]
                         + SWEEP_COLUMNS)]
        if load.get("checks"):
            parts += ["### dspark vs fixed K and plain decoding",
                      "Per output length, drafter and batch size: `dspark` over the best fixed K of the same drafter, "
                      "over `ar`, and over the fastest of both (never slower means at least about 1).",
                      _table(load["checks"], [
                          ("scenario", "scenario", None), ("batch", "batch_size", "d"), ("method", "method", None),
                          ("best fixed", "best_fixed", None), ("vs best fixed", "vs_best_fixed", ".3f"), ("vs ar", "vs_ar", ".3f"),
                          ("vs best of ar and fixed", "vs_best_of_ar_and_fixed", ".3f"),
                          ("at or above every fixed K", "at_or_above_every_fixed", "b")])]
        img("load_sweep", "load sweep")

    parts += ["## Plan targets", "The evaluation plan's monitoring targets: correction rate < 15 % per method "
              "(greedy comparison), CUDA memory fragmentation < 5 % (GPU only).", targets_table(results)]
    parts += ["## Resources", resources_table(results.get("resources") or {})]
    img("memory", "memory over the run")

    soak = results.get("soak")
    if soak:
        parts += ["## Soak", soak_table(soak)]
        img("soak", "memory over the soak run")
    return "\n\n".join(parts) + "\n"


def divergence_text(runs: list[dict]) -> str:
    """One line per run whose outputs are not all token-identical to `hf`: how many prompts
    differ and at which output token each first differs (near-ties flip in bf16/fp16)."""
    lines = []
    for r in runs:
        first = r.get("first_divergence_tokens")
        if first:
            lines.append(f"- {r['method']} (batch {r['batch_size']}): {len(first)} of {r['num_prompts']} prompts differ "
                         f"from `hf`, first at output token {', '.join(str(i) for i in first)}")
    return ("Outputs that differ from `hf`:\n" + "\n".join(lines)) if lines else ""


def sampling_text(sampling: dict) -> str:
    p = sampling.get("params", {})
    return (f"temperature {p.get('temperature')}, top-k {p.get('top_k')}, top-p {p.get('top_p')}, "
            f"{p.get('seeds')} seeds; prompt i uses seed base + i in every method. Statistics per seed, then "
            "mean +- sd over seeds; `overlap` = every statistic's mean +- 2 sd interval meets hf's; p = permutation "
            "test on pooled per-output values (a lossless method should not give small p values).")


def sampling_table(sampling: dict) -> str:
    rows = []
    for method, info in sampling["methods"].items():
        st = info["stats"]
        ms = lambda k: f"{st[k]['mean']:.3f} ± {st[k]['sd']:.3f}" if k in st else "-"  # noqa: E731
        ov = info.get("overlaps_hf")
        pv = info.get("p_value_vs_hf", {})
        rows.append([
            method, str(info["batch_size"]), str(len(info["per_seed"])), ms("mean_output_tokens"),
            ms("rouge_l_vs_reference"), ms("bleu_vs_reference"), ms("tokens_per_s"),
            "-" if ov is None else ("yes" if all(ov.values()) else "no"),
            fmt(pv.get("output_tokens"), ".3f"), fmt(pv.get("rouge_l_vs_reference"), ".3f"),
        ])
    return md_table(["method", "batch", "seeds", "output tokens", "ROUGE-L vs ref", "BLEU vs ref", "tok/s",
                     "overlap with hf", "p (length)", "p (ROUGE-L)"], rows)


CORRECTION_TARGET = 0.15
FRAGMENTATION_TARGET = 0.05


def targets_table(results: dict) -> str:
    rows = []
    for r in results.get("runs") or []:
        c = r.get("correction_rate")
        if c is not None and r.get("mean_verify_budget"):  # nothing verified: no rate to judge
            rows.append([f"correction rate: {r['scenario']} {r['method']} batch {r['batch_size']}", fmt(c, "%"),
                         "< 15%", "yes" if c < CORRECTION_TARGET else "no"])
    frag = ((results.get("resources") or {}).get("cuda") or {}).get("peak_fragmentation")
    rows.append(["CUDA fragmentation at peak", fmt(frag, "%"), "< 5%", "-" if frag is None else ("yes" if frag < FRAGMENTATION_TARGET else "no")])
    return md_table(["check", "value", "target", "met"], rows)


def resources_table(res: dict) -> str:
    rows = [
        ["peak RSS MiB", fmt(res.get("rss_peak_bytes"), "MiB")],
        ["target tensors MiB", fmt(res.get("target_tensor_bytes"), "MiB")],
        ["CPU utilisation (mean)", fmt(res.get("cpu_util_mean"), "%")],
        ["GPU utilisation (NVML mean)", fmt(res.get("gpu_util_mean"), "%")],
        ["GPU memory used, peak (NVML) MiB", fmt(res.get("gpu_mem_peak_bytes"), "MiB")],
    ]
    cuda = res.get("cuda") or {}
    rows += [
        ["CUDA peak allocated MiB", fmt(cuda.get("peak_allocated_bytes"), "MiB")],
        ["CUDA peak reserved MiB", fmt(cuda.get("peak_reserved_bytes"), "MiB")],
        ["CUDA fragmentation at end", fmt(cuda.get("fragmentation"), "%")],
        ["CUDA fragmentation at peak", fmt(cuda.get("peak_fragmentation"), "%")],
    ]
    for d in res.get("drafters", []):
        rows.append([f"drafter {d['drafter']}: own tensors MiB", fmt(d["tensor_bytes"], "MiB")])
        rows.append([f"drafter {d['drafter']}: RSS growth on load MiB", fmt(d["rss_delta_bytes"], "MiB")])
        if d.get("cuda_allocated_delta_bytes") is not None:
            rows.append([f"drafter {d['drafter']}: CUDA growth on load MiB", fmt(d["cuda_allocated_delta_bytes"], "MiB")])
    return md_table(["resource", "value"], rows)


def soak_table(soak: dict) -> str:
    rows = [
        ["methods", ", ".join(soak.get("methods", []))],
        ["minutes requested / run", f"{soak['minutes_requested']:g} / {soak['minutes_run']:.2f}"],
        ["iterations", str(soak["iterations"])],
        ["requests", str(soak["requests"])],
        ["output tokens", str(soak["output_tokens"])],
        ["errors", str(soak["errors"])],
        ["greedy outputs changed vs first iteration", str(soak["changed_outputs"])],
        ["RSS slope bytes/min", fmt(soak.get("rss_slope_bytes_per_min"), ".0f")],
        ["CUDA allocated slope bytes/min", fmt(soak.get("cuda_allocated_slope_bytes_per_min"), ".0f")],
        ["CUDA reserved slope bytes/min", fmt(soak.get("cuda_reserved_slope_bytes_per_min"), ".0f")],
        ["RSS first / last MiB", f"{fmt(soak['samples'][0]['rss_bytes'], 'MiB')} / {fmt(soak['samples'][-1]['rss_bytes'], 'MiB')}" if soak.get("samples") else "-"],
    ]
    text = md_table(["soak", "value"], rows)
    if soak.get("error_messages"):
        text += "\n\nFirst errors:\n\n" + "\n".join(f"- `{m}`" for m in soak["error_messages"])
    return text


# --- plots -----------------------------------------------------------------------------------
def _save(fig, out_dir: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png", dpi=110)
    plt.close(fig)
    return f"{name}.png"


def _first_bs_runs(runs: list[dict]) -> dict[str, list[dict]]:
    """Per scenario, the rows at its smallest batch size (one comparable set per scenario)."""
    by = defaultdict(list)
    for r in runs:
        by[r.get("scenario")].append(r)
    return {sc: [r for r in rs if r["batch_size"] == min(x["batch_size"] for x in rs)] for sc, rs in by.items()}


def _legend_outside(ax) -> None:
    """Legend to the right of the axes, so that it never covers a bar or a line."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _grouped_bars(ax, rows: list[dict], key: str, title: str, ylabel: str) -> None:
    cats = sorted({c for r in rows for c in r["by_category"]})
    methods = [r for r in rows if r["method"] not in ("hf",)]
    width = 0.8 / max(1, len(methods))
    for k, r in enumerate(methods):
        vals = [r["by_category"].get(c, {}).get(key) for c in cats]
        ax.bar([i + k * width for i in range(len(cats))], [v if v is not None else 0 for v in vals], width, label=r["method"])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=20)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)


def load_sweep_figure(rows: list[dict]):
    """Tokens/s against batch size, one line per method; one panel per output length (rows)
    and drafter (columns), `ar` drawn in every panel as the plain-decoding baseline. A bottom
    row of panels shows the mean verify budget (the paper's Figure 8: it should fall with load)."""
    from dspark.evaluation.analysis import drafter_of

    def short(drafter: str | None) -> str:  # draft-model:/long/path/model -> draft-model:model
        return str(drafter).rstrip("/").rsplit("/", 1)[-1] if drafter and "/" in drafter else str(drafter)

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    batch_sizes = sorted({r["batch_size"] for r in rows})
    drafters = list(dict.fromkeys(d for r in rows if (d := drafter_of(r["method"])) is not None)) or [None]
    fig, axes = plt.subplots(len(scenarios) + 1, len(drafters), figsize=(5.5 * len(drafters), 3.6 * (len(scenarios) + 1)),
                             squeeze=False)
    for j, drafter in enumerate(drafters):
        for i, scenario in enumerate(scenarios):
            ax = axes[i][j]
            mine = [r for r in rows if r["scenario"] == scenario and drafter_of(r["method"]) in (None, drafter)]
            for m in dict.fromkeys(r["method"] for r in mine):
                rs = sorted((r for r in mine if r["method"] == m), key=lambda r: r["batch_size"])
                style = "k--" if m == "ar" else ("o-" if m.startswith("dspark") else ".-")
                ax.plot([r["batch_size"] for r in rs], [r["tokens_per_s"] for r in rs], style, label=m.partition("@")[0],
                        linewidth=2.2 if m.startswith("dspark") else 1.2)
            ax.set_title(f"{scenario}, drafter {short(drafter)}", fontsize=9)
            ax.set_ylabel("output tokens per second", fontsize=8)
        ax = axes[-1][j]
        for scenario in scenarios:
            rs = sorted((r for r in rows if r["scenario"] == scenario and r["method"].startswith("dspark")
                         and drafter_of(r["method"]) == drafter), key=lambda r: r["batch_size"])
            ax.plot([r["batch_size"] for r in rs], [r["mean_verify_budget"] for r in rs], "o-", label=f"dspark, {scenario}")
        ax.set_title(f"dspark's mean verify budget, drafter {short(drafter)}", fontsize=9)
        ax.set_ylabel("draft tokens per row and round", fontsize=8)
    for ax in [a for row in axes for a in row]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size (rows decoding together)", fontsize=8)
    for row in axes:
        _legend_outside(row[-1])
    return fig


def plot_all(results: dict, outputs: list[Output], out_dir: Path) -> dict[str, str]:
    out_dir = Path(out_dir)
    plots: dict[str, str] = {}
    groups = _first_bs_runs(results.get("runs") or [])
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
        for ax, (sc, rows) in zip(axes[0], groups.items()):
            _grouped_bars(ax, rows, "speedup_vs_hf", f"{sc}: tokens/s vs hf (batch {rows[0]['batch_size']})",
                          "speed-up over hf (x)")
            ax.axhline(1.0, color="grey", lw=0.8)
        _legend_outside(axes[0][-1])
        plots["speedup_by_category"] = _save(fig, out_dir, "speedup_by_category")

        fig, axes = plt.subplots(2, len(groups), figsize=(6 * len(groups), 7), squeeze=False)
        for j, (sc, rows) in enumerate(groups.items()):
            _grouped_bars(axes[0][j], rows, "mean_accepted_length", f"{sc}: tau", "tokens per target forward")
            _grouped_bars(axes[1][j], rows, "acceptance_rate", f"{sc}: acceptance rate", "accepted / verified draft tokens")
        _legend_outside(axes[0][-1])
        plots["tau_acceptance_by_category"] = _save(fig, out_dir, "tau_acceptance_by_category")

        fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.5 * len(groups)), squeeze=False)
        for i, (sc, rows) in enumerate(groups.items()):
            bs = rows[0]["batch_size"]
            methods = [r["method"] for r in rows]
            mine = lambda m: [o for o in outputs if o.phase == "compare" and o.scenario == sc and o.batch_size == bs and o.method == m]  # noqa: E731
            axes[i][0].boxplot([[o.latency_s for o in mine(m)] for m in methods], tick_labels=methods)
            axes[i][0].set_title(f"{sc}: request latency (batch {bs})", fontsize=9)
            axes[i][0].set_ylabel("seconds", fontsize=8)
            tp = [[1000 * o.tpot_s for o in mine(m) if o.tpot_s is not None] or [math.nan] for m in methods]
            axes[i][1].boxplot(tp, tick_labels=methods)
            axes[i][1].set_title(f"{sc}: time per output token after the first (batch {bs})", fontsize=9)
            axes[i][1].set_ylabel("milliseconds", fontsize=8)
            for ax in axes[i]:
                ax.tick_params(axis="x", rotation=25, labelsize=7)
        plots["latency"] = _save(fig, out_dir, "latency")

    sampling = results.get("sampling")
    if sampling and sampling.get("methods"):
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(sampling["methods"])
        for k, name in enumerate(names):
            vals = [s["mean_output_tokens"] for s in sampling["methods"][name]["per_seed"]]
            ax.scatter([k] * len(vals), vals, s=18)
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_ylabel("mean output tokens per prompt", fontsize=8)
        ax.set_title("sampling: one point per seed", fontsize=9)
        plots["sampling"] = _save(fig, out_dir, "sampling")

    sweep = results.get("threshold_sweep")
    if sweep:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
        t = [r["threshold"] for r in sweep]
        for ax, key, title, ylabel in zip(axes, ("mean_verify_budget", "correction_rate", "tokens_per_s"),
                                          ("mean verify budget", "correction rate", "tokens/s"),
                                          ("draft tokens per row and round", "rejected / verified draft tokens", "output tokens per second")):
            ax.plot(t, [r[key] if r[key] is not None else math.nan for r in sweep], "o-")
            ax.set_xlabel("confidence threshold")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(title, fontsize=9)
        plots["threshold_sweep"] = _save(fig, out_dir, "threshold_sweep")

    load = results.get("load_sweep")
    if load and load.get("rows"):
        plots["load_sweep"] = _save(load_sweep_figure(load["rows"]), out_dir, "load_sweep")

    samples = (results.get("resources") or {}).get("rss_samples")
    if samples:
        fig, ax = plt.subplots(figsize=(10, 3.5))
        end = samples[-1][0] / 60
        phases = (results.get("resources") or {}).get("phases", [])
        # Phases as shaded spans named in the legend: text at each start overlaps when phases are short.
        for k, ph in enumerate(phases):
            stop = phases[k + 1]["start_s"] / 60 if k + 1 < len(phases) else end
            ax.axvspan(ph["start_s"] / 60, stop, color=plt.cm.tab10(k % 10), alpha=0.15, lw=0, label=ph["name"])
        ax.plot([s[0] / 60 for s in samples], [s[1] / 2**20 for s in samples], color="black", lw=1, label="RSS")
        ax.set_xlabel("minutes since start")
        ax.set_ylabel("resident memory (MiB)")
        ax.set_title("process memory by phase", fontsize=9)
        _legend_outside(ax)
        plots["memory"] = _save(fig, out_dir, "memory")

    soak = results.get("soak")
    if soak and soak.get("samples"):
        ss = soak["samples"]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot([s["minutes"] for s in ss], [s["rss_bytes"] / 2**20 for s in ss], ".-", label="RSS")
        if any(s["cuda_allocated_bytes"] is not None for s in ss):
            ax.plot([s["minutes"] for s in ss], [(s["cuda_allocated_bytes"] or 0) / 2**20 for s in ss], ".-", label="CUDA allocated")
            ax.plot([s["minutes"] for s in ss], [(s["cuda_reserved_bytes"] or 0) / 2**20 for s in ss], ".-", label="CUDA reserved")
        ax.set_xlabel("minutes")
        ax.set_ylabel("memory (MiB)")
        ax.set_title(f"soak: RSS slope {fmt(soak.get('rss_slope_bytes_per_min'), '.0f')} bytes/min, {soak['errors']} errors", fontsize=9)
        _legend_outside(ax)
        plots["soak"] = _save(fig, out_dir, "soak")
    return plots
