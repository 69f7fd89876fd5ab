"""Offline report of a DSpark drafter on the evaluation split of its target cache:
`python -m pipelines.drafter_report --config configs/train_smollm2.yaml [--out DIR]`.

Writes DIR/report.md and PNG plots:
  tau per domain at fixed gamma (greedy, bonus token counted, tokens per round as decoding
  realises them) for DSpark and the parallel-only ablation (paper Table 1 shape); per-position
  conditional acceptance (Fig. 2); a threshold sweep of tokens per step (per round) and
  acceptance rate (Fig. 5); reliability diagrams with ECE and
  ROC-AUC of prefix survival for the raw confidence head and after calibration (Fig. 6); where
  greedy rounds end (outside the draft vocabulary? seen earlier in the sequence?) and how far a
  perfect copy decision would take tau. With a copy prior in the checkpoint, tau rows with and
  without it. DIR/report.json holds every figure and what the plots are drawn from:
  `--replot DIR` redraws them without evaluating.

Everything is computed from cached target states of the eval split (no engine run): the
drafter's free-running greedy chain is compared with the target's argmax at every block
position, which is exactly what greedy verification does. tau walks each answer round by round
(a round at position p gains 1 + accepted tokens; the next starts where it ended), which needs
every anchor (stride 1, the default). The average over all anchors is reported beside it: it
weighs an easy stretch once per position in it, where decoding crosses it in a few rounds, so
it overstates tokens per round. The ablation is a checkpoint with markov_rank 0: trained from
random weights (configs/train_smollm2_parallel.yaml), or made from a trained drafter with
`--init-from` and `model.markov_rank: 0` (docs/training.md); without one, the report falls back
to the DSpark model with its Markov bias switched off at inference and says so.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np


def _bonus_text(prior: dict) -> str:
    """A copy rule as the report prints it: a prior's bonuses per order, then per (order,
    kind); a scorer's orders and its largest weights."""
    if "scorer" in prior:
        weights = sorted(prior["scorer"]["weights"].items(), key=lambda kv: -abs(kv[1]))[:6]
        return f"learned scorer over orders {prior['scorer']['orders']}, largest weights " + ", ".join(f"{k} {w:+.2f}" for k, w in weights)
    kinds = prior.get("kind_bonuses")
    return f"{prior['bonuses']}" + (f", per kind {kinds}" if kinds else "")


def threshold_sweep(
    accepted: np.ndarray, survival_conf: np.ndarray, thresholds: np.ndarray, rows: np.ndarray | None = None, anchors: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Static policy "verify while c_k >= t": per threshold, mean tokens per step (accepted
    within the verified prefix + 1), acceptance rate (accepted / verified) and mean verified.
    With the blocks' `rows` and `anchors` (every anchor present) all three are over the rounds
    decoding with that policy visits (`walk_rounds`): tokens per step is then tokens per round."""
    from dspark.training.trainer import walk_rounds

    pre = np.cumprod(accepted, axis=1)
    tps, rate, ver = [], [], []
    for t in thresholds:
        ok = np.cumprod(survival_conf >= t, axis=1)  # verified positions: every c_j >= t so far
        verified = ok.sum(1)
        acc = (pre * ok).sum(1)
        if rows is not None and anchors is not None:
            seen = walk_rounds(rows, anchors, 1 + acc.astype(np.int64))
            verified, acc = verified[seen], acc[seen]
        tps.append(1.0 + acc.mean())
        rate.append(acc.sum() / max(verified.sum(), 1))
        ver.append(verified.mean())
    return np.array(tps), np.array(rate), np.array(ver)


def _legend_below(ax, below: float = -0.1, width: int = 90) -> None:
    """The legend under the axes, labels wrapped: drafter labels run to a hundred characters,
    and a legend inside the axes squeezed the plot and hid the bars."""
    import textwrap

    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, [textwrap.fill(label, width) for label in labels], fontsize=7, frameon=False,
              loc="upper center", bbox_to_anchor=(0.5, below))


def plot_tau_per_domain(path: Path, results: dict, gamma: int) -> None:
    import matplotlib.pyplot as plt

    doms = [d for d in results["dspark"]["tau"] if d != "all"] + ["all"]
    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    w = 0.8 / len(results)
    for i, res in enumerate(results.values()):
        offset = (i - (len(results) - 1) / 2) * w
        ax.bar(np.arange(len(doms)) + offset, [res["tau"].get(d, np.nan) for d in doms], w, label=res["label"])
    ax.set_xticks(np.arange(len(doms)), doms)
    ax.set_ylabel(f"tau (greedy, gamma {gamma})")
    ax.axhline(1.0, color="grey", lw=0.8)
    _legend_below(ax)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_per_position(path: Path, results: dict, gamma: int) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.5))
    for res in results.values():
        ax.plot(np.arange(1, gamma + 1), res["per_position"], marker="o", label=res["label"])
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1)
    _legend_below(ax, below=-0.18)  # under the x label
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _plots(out: Path, results: dict, sts: dict, gamma: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # 1. tau per domain, 2. per-position conditional acceptance
    plot_tau_per_domain(out / "tau_per_domain.png", results, gamma)
    plot_per_position(out / "per_position_acceptance.png", results, gamma)
    files = ["tau_per_domain.png", "per_position_acceptance.png"]
    # 3. threshold sweep
    sw = results["dspark"]["sweep"]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(sw["threshold"], sw["tokens_per_step"], marker=".", label="tokens per step")
    ax.set_xlabel("confidence threshold t (verify while calibrated c_k >= t)")
    ax.set_ylabel("tokens per step")
    ax2 = ax.twinx()
    ax2.plot(sw["threshold"], sw["acceptance_rate"], color="C1", marker=".", label="acceptance rate")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1)
    fig.legend(loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "threshold_sweep.png", dpi=120)
    files.append("threshold_sweep.png")
    plt.close(fig)
    # 4. reliability diagrams (drawn only when the summary holds their bins)
    if not all("freq" in sts.get(key, {}) for key in ("before", "after")):
        return files
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
    for ax, key, title in zip(axes, ("before", "after"), ("raw confidence head", "calibrated")):
        r = sts[key]
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.bar(r["bin_centers"], r["freq"], width=0.1, alpha=0.6, edgecolor="k", label="observed")
        ax.plot(r["pred"], r["freq"], marker="o", color="C3", label="mean predicted vs observed")
        ax.set_title(f"{title}: ECE {r['ece']:.3f}, AUC {r['auc']:.3f}")
        ax.set_xlabel("prefix survival a_k")
        ax.set_ylabel("fraction with 1..k accepted")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reliability.png", dpi=120)
    files.append("reliability.png")
    plt.close(fig)
    return files


def replot(out: Path) -> list[str]:
    """Redraw the PNGs and report.md of a report folder from its report.json (no evaluation):
    after a change to the plots, or to render a report copied from another machine. A
    report.json without reliability bins keeps the diagram already in DIR."""
    s = json.loads((out / "report.json").read_text())
    files = _plots(out, s["results"], s["calibration"], s["gamma"])
    if "reliability.png" not in files and (out / "reliability.png").is_file():
        files.append("reliability.png")
    (out / "report.md").write_text(_markdown(s, files))
    return files


def build_report(cfg: dict, out: Path, checkpoint: Path, ablation: Path | None, max_blocks: int | None, stride: int) -> dict:
    import torch

    from dspark.dspark_drafter import load_model_for_target
    from dspark.dspark_drafter.calibration import ece, reliability, roc_auc, survival, prefix_accepted
    from dspark.dspark_drafter.copy_prior import adjust_logits
    from dspark.training.cache import CacheReader
    from dspark.training.copy_bound import copy_bounds
    from dspark.training.round_ends import round_ends_by_domain
    from dspark.training.trainer import evaluate
    from pipelines.train_drafter import load_target, setup_torch

    setup_torch(cfg)
    work = Path(cfg.get("work_dir", "/tmp/dspark-train"))
    target = load_target(cfg)
    reader = CacheReader(work / "cache" / "eval")
    rows = list(range(len(reader.rows)))
    model, ck = load_model_for_target(checkpoint, target, dtype=torch.float32)
    vocab = ck.draft_vocab  # what the drafter proposes from at run time; the ablation gets the same
    vocab_note = "" if vocab is None else f", draft vocabulary {len(vocab)}"
    t0 = time.time()
    copy = ck.copy_prior
    copy_note = ""
    if copy is not None:  # a scorer's weights are too many for a legend: the report's text lists them
        rule = copy.to_dict()
        copy_note = f", learned copy decision (orders {rule['scorer']['orders']})" if "scorer" in rule else f", copy prior {_bonus_text(rule)}"
    walk = stride == 1 and max_blocks is None  # a per-round walk needs every anchor
    res = evaluate(model, reader, rows, stride, max_blocks, draft_vocab=vocab, copy=copy)
    steps = {"dspark": _trained_steps(ck)}
    runs = {"dspark": (res, f"DSpark (Markov rank {model.cfg.markov_rank}){_steps_label(steps['dspark'])}{vocab_note}{copy_note}")}
    if copy is not None:  # the model alone: what the Markov-vs-parallel comparison below is about
        runs["dspark_no_copy"] = (evaluate(model, reader, rows, stride, max_blocks, draft_vocab=vocab), f"DSpark without the copy prior{vocab_note}")
    if ablation is not None and (ablation / "config.json").is_file():
        abl, abl_ck = load_model_for_target(ablation, target, dtype=torch.float32)
        steps["parallel"] = _trained_steps(abl_ck)
        origin = markov_origin(_warm_source(abl_ck))
        if origin:  # started --init-from a drafter with a Markov head (markov_rank 0 drops it)
            source, steps_between = origin
            steps["parallel_from"] = source
            steps["parallel"] = (steps["parallel"] or 0) + steps_between
            label = (f"parallel-only (the Markov head removed from {Path(source['checkpoint']).name}, "
                     f"{source.get('steps')} steps, then {steps['parallel']} steps without it){vocab_note}")
        else:
            label = f"parallel-only (trained without Markov head){_steps_label(steps['parallel'])}{vocab_note}"
        runs["parallel"] = (evaluate(abl, reader, rows, stride, max_blocks, draft_vocab=vocab), label)
    else:
        label = f"parallel-only (Markov bias off at inference; no retrained ablation){vocab_note}"
        runs["parallel"] = (evaluate(model, reader, rows, stride, max_blocks, markov=False, draft_vocab=vocab), label)
    if vocab is not None:
        label = "DSpark, whole vocabulary" + ("" if copy is None else ", without the copy prior")
        runs["dspark_full_vocab"] = (evaluate(model, reader, rows, stride, max_blocks), label)
    eval_s = time.time() - t0
    gamma = model.cfg.gamma
    results = {}
    for name, (r, label) in runs.items():
        results[name] = {
            "label": label,
            "tau": r.tau_by_domain(decoded=walk),
            "tau_per_anchor": r.tau_by_domain(),
            "per_position": r.per_position_acceptance().tolist(),
            "sampling_acceptance_T1": (1.0 - 0.5 * r.l1).mean(0).tolist(),
            "blocks": len(r.domains),
        }
    temps = ck.temperatures or [1.0] * gamma
    offsets = ck.offsets or [0.0] * gamma
    labels = prefix_accepted(res.accepted)
    # calibrated logits: the copy prior's per-match-class correction, then STS
    z_cal = res.conf_logits if copy is None else adjust_logits(copy, res.conf_logits, res.copy_class)
    sts = {}
    for key, z, t, b in (("before", res.conf_logits, None, None), ("after", z_cal, temps, offsets)):
        a = survival(z, t, b)
        pred, freq, count = reliability(a, labels, 10)
        sts[key] = {
            "ece": ece(a, labels),
            "auc": roc_auc(a, labels),
            "pred": pred.tolist(),
            "freq": freq.tolist(),
            "count": count.tolist(),
            "bin_centers": (np.arange(10) / 10 + 0.05).tolist(),
        }
    c_cal = 1.0 / (1.0 + np.exp(-(z_cal / np.asarray(temps)[None, :] + np.asarray(offsets)[None, :])))
    thr = np.round(np.arange(0.0, 1.0001, 0.05), 2)
    tps, rate, ver = threshold_sweep(res.accepted, c_cal, thr, *((res.rows, res.anchors) if walk else ()))
    if walk:  # needs every anchor, like tau per round
        ends = round_ends_by_domain(res, None if vocab is None else vocab.numpy())
        results["dspark"]["round_ends"] = {d: asdict(e) for d, e in ends.items()}
        if copy is not None:
            results["dspark"]["copy_bounds"] = copy_bounds(model, reader, rows, copy, vocab).tau_by_domain()
    results["dspark"]["sweep"] = {"threshold": thr.tolist(), "tokens_per_step": tps.tolist(), "acceptance_rate": rate.tolist(), "mean_verified": ver.tolist()}
    out.mkdir(parents=True, exist_ok=True)
    files = _plots(out, results, sts, gamma)
    summary = {
        "checkpoint": str(checkpoint),
        "ablation": str(ablation) if ablation else None,
        "target": target.name,
        "split": "eval",
        "eval_sequences": len(rows),
        "blocks": len(res.domains),
        "anchor_stride": stride,
        "tau_kind": "per round" if walk else "per anchor",
        "gamma": gamma,
        "temperatures": temps,
        "offsets": ck.offsets,
        "copy_prior": None if copy is None else copy.to_dict(),
        "results": results,
        "calibration": sts,  # ECE, AUC and the reliability bins: `--replot` redraws the diagrams from them
        "eval_seconds": eval_s,
        "training": (ck.extra or {}).get("training"),
        "trained_steps": steps,
    }
    (out / "report.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(_markdown(summary, files))
    return summary


def _trained_steps(ck) -> int | None:
    return ((ck.extra or {}).get("training") or {}).get("steps")


def _warm_source(ck) -> dict | None:
    """The checkpoint a run started from (`--init-from`) as its card records it, or None."""
    return ((ck.extra or {}).get("training") or {}).get("init_from")


def markov_origin(init_from: dict | None) -> tuple[dict, int] | None:
    """Where a warm-started ablation's Markov head was removed: the `init_from` record (see
    `pipelines.train_drafter.stage_train`) of the last drafter with a head along the chain of
    warm starts, and the steps trained without it before the ablation's own run. A record
    without `markov_rank` is taken as that drafter."""
    steps_between = 0
    source = init_from
    while source and source.get("markov_rank") == 0 and source.get("init_from"):
        steps_between += int(source.get("steps") or 0)
        source = source["init_from"]
    return (source, steps_between) if source else None


def _steps_label(steps: int | None) -> str:
    return f", {steps} steps" if steps else ""


def _unequal_note(steps: dict) -> str:
    a, b, source = steps.get("dspark"), steps.get("parallel"), steps.get("parallel_from")
    if source:  # a warm start has had its source's training too: compare totals, not runs
        return (f" (the ablation continued {Path(source['checkpoint']).name}'s {source.get('steps')} steps for {b} more; "
                f"this drafter's own run: {a} steps)")
    if a and b and a != b:
        return f" (unequal training: {a} vs {b} steps, which favours the longer run)"
    return ""


_TAU_KINDS = {
    "per round": "tau = tokens per round (accepted + the bonus token) as greedy decoding with this chain realises "
    "them: each answer is walked from its first position, every round starting where the last one ended, up to its "
    "last full block (`EvalResult.decoded_tau`).",
    "per anchor": "tau = 1 + accepted prefix length averaged over anchors (anchor stride > 1 or subsampled blocks "
    "cannot be walked round by round; this average overstates tokens per round).",
}


def _anchors(stride: int) -> str:
    return "an anchor at every answer position" if stride == 1 else f"anchors every {stride} answer positions"


def _tau_table(r: dict, doms: list[str], key: str = "tau") -> list[str]:
    lines = ["| drafter | " + " | ".join(doms) + " |", "| --- | " + " | ".join("---" for _ in doms) + " |"]
    for res in r.values():
        lines.append(f"| {res['label']} | " + " | ".join(f"{res[key].get(d, float('nan')):.3f}" for d in doms) + " |")
    return lines


def _round_ends_table(ends: dict | None) -> list[str]:
    if not ends:
        return []
    lines = [
        "## Where rounds end (DSpark)",
        "",
        "The rounds greedy decoding takes (the walk behind tau), classified by the target token at the position "
        "where each ended: outside the draft vocabulary (the drafter could not propose it), and seen earlier in "
        "the sequence (prompt, answer so far or the block: what copying could propose at best). "
        "Shares of the rounds that ended; `dspark/training/round_ends.py`.",
        "",
        "| domain | rounds | whole block | ended at 1 | at 2 | at 3+ | outside vocabulary | outside, seen earlier | seen earlier |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d, e in ends.items():
        at = e["ended_at"]
        lines.append(f"| {d} | {e['rounds']} | {e['whole_block']:.1%} | {at[0]:.1%} | {at[1]:.1%} | {sum(at[2:]):.1%} | "
                     f"{e['outside_vocab']:.1%} | {e['outside_vocab_seen']:.1%} | {e['seen']:.1%} |")
    return lines + [""]


_BOUND_LABELS = {
    "rule": "the copy rule's choice (the drafter; tau above)",
    "top1": "the drafter's top-1 (no copying)",
    "top1_or_candidate": "top-1 or one of the rule's candidates (a perfect decision)",
    "top1_or_follower": "top-1 or any earlier follower (up to 5 per n-gram)",
}


def _copy_bounds_table(bounds: dict | None, doms: list[str]) -> list[str]:
    if not bounds:
        return []
    lines = [
        "## What a better copy decision could add (DSpark)",
        "",
        "The same walk, stepped along the target's own tokens, with a step counted right when the target's token is "
        "what each row names. The first row is the drafter (its chain follows the target's path until it is "
        "rejected). A perfect decision takes the target's token whenever it is the top-1 or a candidate the rule "
        "looked up (the latest follower of the path's last n-grams); the last row also counts every earlier "
        "follower of those n-grams. At every anchor a perfect decision accepts at least as many tokens as any "
        "decision between the same options, so, up to where the rounds happen to start, its tau is the most a "
        "better copy decision can give; the rest has to come from the network's own proposals. "
        "`dspark/training/copy_bound.py`.",
        "",
        "| tau per round, a step right when the target's token is | " + " | ".join(doms) + " |",
        "| --- | " + " | ".join("---" for _ in doms) + " |",
    ]
    for name, tau in bounds.items():
        lines.append(f"| {_BOUND_LABELS.get(name, name)} | " + " | ".join(f"{tau.get(d, float('nan')):.3f}" for d in doms) + " |")
    return lines + [""]


def _markdown(s: dict, files: list[str]) -> str:
    r = s["results"]
    doms = [d for d in r["dspark"]["tau"] if d != "all"] + ["all"]
    lines = [
        f"# DSpark drafter report: {s['target']}",
        "",
        f"Checkpoint `{s['checkpoint']}`; evaluation split of the target cache ({s['eval_sequences']} sequences, "
        f"{s['blocks']} blocks, {_anchors(s['anchor_stride'])}, full blocks only), gamma {s['gamma']}, greedy. "
        "Computed offline from cached target states: the drafter's free-running greedy chain against the target's argmax "
        "at each block position. " + _TAU_KINDS[s.get("tau_kind", "per anchor")],
        "",
        "## tau per domain",
        "",
        *_tau_table(r, doms),
    ]
    if s.get("tau_kind") == "per round":
        lines += ["", "Averaged over every anchor instead (each position weighs the same; not tokens per round):", "",
                  *_tau_table(r, doms, "tau_per_anchor")]
    model_only = r.get("dspark_no_copy", r["dspark"])  # the comparison is about the network: both without copying
    gain = model_only["tau"]["all"] / r["parallel"]["tau"]["all"] - 1
    copy_line = []
    if "dspark_no_copy" in r:
        lift = r["dspark"]["tau"]["all"] / r["dspark_no_copy"]["tau"]["all"] - 1
        copy_line = [
            "",
            f"Copy prior ({_bonus_text(s['copy_prior'])}, fitted on the calib split): {100 * lift:+.1f}% tau overall. "
            + ("It decides, at each Markov step, between the drafter's top-1 and the tokens that followed the latest "
               "earlier occurrences of the path's last n-grams, by a utility learned on the target's own path "
               if "scorer" in s["copy_prior"] else
               "It adds a bonus to the token that followed the latest earlier occurrence of the path's last n-gram, "
               "by order and kind of match (u: seen once, c: always continued alike, a: not) ")
            + "(dspark/dspark_drafter/copy_prior.py); the rows above and below without it show the network alone.",
        ]
    lines += copy_line + [
        "",
        f"Markov head vs parallel-only (both without the copy prior): {100 * gain:+.1f}% tau overall{_unequal_note(s.get('trained_steps') or {})}.",
        "",
        "![tau per domain](tau_per_domain.png)",
        "",
        "## Per-position conditional acceptance",
        "",
        "| k | " + " | ".join(str(k + 1) for k in range(s["gamma"])) + " |",
        "| --- | " + " | ".join("---" for _ in range(s["gamma"])) + " |",
    ]
    for res in r.values():
        lines.append(f"| {res['label']} | " + " | ".join(f"{x:.3f}" for x in res["per_position"]) + " |")
    lines.append(
        "| DSpark, sampling at T=1 (1 - TV) | " + " | ".join(f"{x:.3f}" for x in r["dspark"]["sampling_acceptance_T1"]) + " |"
    )
    sw = r["dspark"]["sweep"]
    lines += ["", "![per-position acceptance](per_position_acceptance.png)", "", *_round_ends_table(r["dspark"].get("round_ends")),
              *_copy_bounds_table(r["dspark"].get("copy_bounds"), doms)]
    lines += [
        "## Confidence-threshold sweep (DSpark, calibrated confidences)",
        "",
        "Static policy: verify draft positions while every calibrated c_k so far is >= t"
        + (" (tokens per step = per round: each answer walked under that policy)." if s.get("tau_kind") == "per round" else "."),
        "",
        "| t | tokens per step | acceptance rate | mean verified |",
        "| --- | --- | --- | --- |",
    ]
    for t, a, b, c in zip(sw["threshold"], sw["tokens_per_step"], sw["acceptance_rate"], sw["mean_verified"]):
        if round(t * 100) % 10 == 0 or t in (0.05, 0.95):
            lines.append(f"| {t:.2f} | {a:.3f} | {b:.3f} | {c:.2f} |")
    cal = s["calibration"]
    lines += [
        "",
        "![threshold sweep](threshold_sweep.png)",
        "",
        "## Calibration of prefix survival a_k = c_1...c_k",
        "",
        ("Confidence correction per copy match class (the step's longest matched n-gram order; "
         "z -> scale z + shift, fitted on the calib split before STS): "
         + ", ".join(f"class {c}: ({a:.3g}, {b:.3g})" for c, (a, b) in (s["copy_prior"].get("confidence") or {}).items())
         + ". "
         if s.get("copy_prior") else "")
        + f"STS temperatures (fitted on the calib split): {', '.join(f'{t:.3g}' for t in s['temperatures'])}."
        + (f" Offsets (c_k = sigmoid(z_k / T_k + b_k), fitted with them): {', '.join(f'{b:.3g}' for b in s['offsets'])}." if s.get("offsets") else ""),
        "",
        "| | ECE | ROC-AUC |",
        "| --- | --- | --- |",
        f"| raw confidence head | {cal['before']['ece']:.4f} | {cal['before']['auc']:.3f} |",
        f"| calibrated | {cal['after']['ece']:.4f} | {cal['after']['auc']:.3f} |",
        "",
        "![reliability](reliability.png)",
        "",
    ]
    tr = s.get("training")
    if tr:
        lines += [
            "## Training",
            "",
            f"Steps {tr.get('steps')}, wall {tr.get('wall_s', 0) / 60:.1f} min, CPU {tr.get('cpu_hours', 0):.2f} h, "
            f"peak RSS {tr.get('peak_rss_mb') or 0:.0f} MB, {tr.get('train_sequences')} training sequences "
            f"({tr.get('train_positions')} cached positions).",
            "",
        ]
    return "\n".join(lines)


def write_card(path: Path, s: dict, command: str) -> None:
    """The checkpoint's card: data, cost and the measured figures (eval split)."""
    tr = s.get("training") or {}
    cfg = tr.get("config") or {}
    r = s["results"]
    doms = [d for d in r["dspark"]["tau"] if d != "all"] + ["all"]
    cal = s["calibration"]
    lines = [
        f"# DSpark drafter for {s['target']}",
        "",
        "Semi-autoregressive block drafter (parallel backbone + Markov head + confidence head) trained by",
        "self-distillation: the target answered training prompts through the project's engine and its",
        "hidden states were recorded on the way. Only the drafter's own weights are stored (bf16",
        "safetensors); the embedding and LM head are the target's, shared and frozen. `config.json` holds",
        "the architecture, the calibration and the target fingerprint (loading it against another",
        "target raises TargetMismatchError).",
        "",
        "## Data",
        "",
        "- prompts: `data/prompts` (all ten files), split by a hash of `id` "
        "(`dspark.training.data.split_of`: eval 1/8, calib 1/16, train the rest); training never saw eval or calib prompts",
        f"- training sequences: {tr.get('train_sequences')} answers of the target, "
        f"{tr.get('train_positions')} cached positions",
        f"- evaluation: {s['eval_sequences']} eval-split answers, {s['blocks']} blocks ({_anchors(s['anchor_stride'])})",
        "",
        "## Training",
        "",
        f"- steps {tr.get('steps')}, batch {cfg.get('batch_size')}, lr {cfg.get('lr')}, seed {cfg.get('seed')}",
        f"- wall time {tr.get('wall_s', 0) / 60:.1f} min, CPU time {tr.get('cpu_hours', 0):.2f} h, peak RSS {tr.get('peak_rss_mb') or 0:.0f} MB "
        "(training stage only; generation is extra, see the report)",
        f"- command: `{command}`",
        "",
        "## Measured (offline, eval split, greedy, gamma " + str(s["gamma"]) + ", tau counts the bonus token)",
        "",
        _TAU_KINDS[s.get("tau_kind", "per anchor")],
        "",
        *_tau_table(r, doms),
    ]
    lines += [
        "",
        f"Prefix-survival calibration (STS fitted on calib, measured on eval): ECE {cal['before']['ece']:.4f} -> "
        f"{cal['after']['ece']:.4f}, ROC-AUC {cal['before']['auc']:.3f} -> {cal['after']['auc']:.3f}.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.drafter_report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/train_smollm2.yaml", help="the training config whose cache and splits to read (default: configs/train_smollm2.yaml)")
    ap.add_argument("--checkpoint", help="drafter checkpoint (default: the config's output)")
    ap.add_argument("--ablation", help="parallel-only checkpoint (default: <work_dir>/ablation-parallel, where "
                    "configs/train_smollm2_parallel.yaml writes one, if present)")
    ap.add_argument("--out", default=None, help="report folder (default: <work_dir>/report)")
    ap.add_argument("--stride", type=int, default=1, help="anchor stride; tau per round needs 1 (larger: per-anchor average only)")
    ap.add_argument("--max-blocks", type=int, default=None, help="evaluate at most this many draft blocks (a quick look; tau per round needs them all)")
    ap.add_argument("--card", help="also write the checkpoint card (Markdown) to this path")
    ap.add_argument("--train-command", default="python -m pipelines.train_drafter --config configs/train_smollm2.yaml",
                    help="the training command the card states (with --card)")
    ap.add_argument("--replot", metavar="DIR", help="only redraw DIR's plots and report.md from its report.json (no evaluation)")
    args = ap.parse_args(argv)
    if args.replot:
        files = replot(Path(args.replot))
        print(f"redrew {', '.join(files)} and report.md in {args.replot}")
        return 0
    from pipelines.train_drafter import load_config

    cfg = load_config(args.config)
    work = Path(cfg.get("work_dir", "/tmp/dspark-train"))
    checkpoint = Path(args.checkpoint or cfg.get("output"))
    ablation = Path(args.ablation) if args.ablation else work / "ablation-parallel"
    out = Path(args.out) if args.out else work / "report"
    s = build_report(cfg, out, checkpoint, ablation, args.max_blocks, args.stride)
    print(json.dumps({k: v["tau"] for k, v in s["results"].items()}, indent=1))
    print(json.dumps({k: {m: v[m] for m in ("ece", "auc")} for k, v in s["calibration"].items()}))
    print(f"report: {out / 'report.md'}")
    if args.card:
        write_card(Path(args.card), s, args.train_command)
        print(f"card: {args.card}")
    return 0


if __name__ == "__main__":
    from pipelines import run_main

    raise SystemExit(run_main(main))
