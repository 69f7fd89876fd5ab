"""Train a DSpark drafter for a target: `python -m pipelines.train_drafter --config configs/train_smollm2.yaml`.

Stages (all by default, each resumable; rerun the same command to continue):
  generate   the target answers prompts through the project's engine (greedy) and the target
             cache (injected layers + final hidden state) is recorded on the way, in shards:
             eval and calib splits first (capped per source), then train, then greedy answers
             to train prompts under the other instructions of `generate.train_rewrites`,
             then the extra sampled answers that `generate.train_samples` asks for;
             `prompts.max_prompt_tokens` (eval, calib) and `prompts.train_max_prompt_tokens`
             cap prompt lengths, as one number or per domain ({default: 256, summarization: 768})
  train      L = 0.1 CE + 0.9 TV + 1.0 Conf on the train cache, checkpoints in work_dir/runs/<run>
             (over the reduced draft vocabulary with `train.reduced_vocab: true`)
  calibrate  fits the copy rule (`copy_prior:` in the config): the n-gram bonuses by greedy
             tau, or with `scorer:` the learned copy decision (a conditional logit on the
             target's own path), then Sequential Temperature Scaling, on the calib split (plus per-position offsets with
             `calibration_offsets: true`); writes the final checkpoint (safetensors +
             config.json with the calibration and the target fingerprint) to `output`,
             plus draft_vocab.safetensors when the config sets `draft_vocab: N` (the drafter
             then proposes only the N tokens the target emits most; calibration uses it too)

Big artefacts (answers, target cache, training state, logs) live in work_dir, e.g. `runs/...`
(git-ignored); only `output` is meant to be committed. docs/training.md explains the config.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

STAGES = ("generate", "train", "calibrate")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path) -> dict[str, Any]:
    """YAML config; `base: other.yaml` (relative to this file) is loaded first and overridden."""
    path = Path(path)
    cfg = yaml.safe_load(path.read_text()) or {}
    if "base" in cfg:
        cfg = _merge(load_config(path.parent / cfg.pop("base")), cfg)
    return cfg


def interleave_sources(plan: list) -> list:
    """Round-robin across source files (each shortest first): every prefix of the plan
    covers every domain, so stopping generation early still gives a mixed training set."""
    by_src: dict[str, list] = {}
    for item in plan:
        by_src.setdefault(item[0].source, []).append(item)
    out, i = [], 0
    queues = [v for _, v in sorted(by_src.items())]
    while any(i < len(q) for q in queues):
        out += [q[i] for q in queues if i < len(q)]
        i += 1
    return out


class Logger:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = path.open("a")

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def state_dir(cfg: dict, work: Path) -> Path:
    """Runs sharing one cache (e.g. DSpark and the parallel-only ablation) keep separate states."""
    return work / "runs" / str(cfg.get("run", "dspark"))


def setup_torch(cfg: dict) -> None:
    import torch

    threads = cfg.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    torch.manual_seed(int(cfg.get("seed", 0)))


def load_target(cfg: dict, dtype: str | None = None):
    """The config's target in `dtype` (default: the config's `dtype`); "tiny" is a random tiny
    Llama for smoke runs of the whole job."""
    dtype = dtype or cfg.get("dtype", "float32")
    if cfg.get("target") == "tiny":
        from dspark.models import resolve_dtype
        from dspark.training.tiny import tiny_target

        return tiny_target(seed=int(cfg.get("seed", 0)), dtype=resolve_dtype(dtype))
    from dspark.models import load_model

    return load_model(cfg.get("target", "smollm2-135m-instruct"), dtype=dtype)


def model_config(cfg: dict, target):
    from dspark.dspark_drafter import DSparkConfig

    return DSparkConfig.for_target(target.model.config, **(cfg.get("model") or {}))


def stage_generate(cfg: dict, target, work: Path, log: Logger, deadline: float | None) -> None:
    from dspark.training.data import Rewrite, load_prompts, plan_generation, rewrite_prompts
    from dspark.training.record import generate_with_cache

    pc, gc = cfg.get("prompts") or {}, cfg.get("generate") or {}
    mcfg = model_config(cfg, target)
    prompts = load_prompts(pc.get("dir", "data/prompts"), pc.get("files"))
    encode = lambda text: target.encode(text)  # noqa: E731
    # greedy answers per split, then greedy answers to the train prompts under other
    # instructions (`train_rewrites`, rows `id+tag`), then the train split's extra sampled
    # passes (`train_samples`, rows `id~tag`; a pass may narrow the prompts with its own limit)
    limits = {split: pc.get(f"{split}_max_prompt_tokens", pc.get("max_prompt_tokens", 384)) for split in ("eval", "calib", "train")}
    passes = [(split, prompts, 0.0, "", limits[split], "greedy") for split in ("eval", "calib", "train")]
    for rw in map(Rewrite.from_dict, gc.get("train_rewrites") or []):
        passes.append(("train", rewrite_prompts(prompts, rw), 0.0, "", limits["train"], f"greedy, rewrite {rw.tag!r} ({rw.replace!r})"))
    for sample in gc.get("train_samples") or []:
        tag, temperature = str(sample["tag"]), float(sample["temperature"])
        passes.append(("train", prompts, temperature, tag, sample.get("max_prompt_tokens", limits["train"]), f"sampled pass {tag!r} (temperature {temperature})"))
    for split, pool, temperature, tag, limit, what in passes:
        cap = gc.get(f"{split}_per_source")
        plan = plan_generation(pool, encode, split, limit, cap)
        plan = interleave_sources(plan)
        log(f"generate {split}, {what}, target in {str(target.dtype).removeprefix('torch.')}: {len(plan)} prompts planned")
        generate_with_cache(
            target,
            plan,
            work / "cache" / split,
            mcfg.target_layers,
            # prompt positions cached before each answer: the drafter's window, or more
            # (`generate.cache_positions`) so that the copy prior sees the whole prompt
            max(mcfg.context_len, int(gc.get("cache_positions") or 0)),
            batch_size=int(gc.get("batch_size", 32)),
            max_new_tokens=int(gc.get("max_new_tokens", 128)),
            shard_size=int(gc.get("shard_size", 64)),
            log=log,
            deadline=deadline,
            temperature=temperature,
            tag=tag,
        )
        if deadline is not None and time.time() > deadline:
            return


def _readers(work: Path):
    from dspark.training.cache import CacheReader

    out = {}
    for split in ("train", "calib", "eval"):
        d = work / "cache" / split
        if (d / "spec.json").is_file() and any(d.glob("shard_*.safetensors")):
            out[split] = CacheReader(d)
    return out


def answers_by_domain(reader) -> dict[str, int]:
    """How many answers a cache split holds, per domain and in all (`all`)."""
    counts = Counter(row.domain for row in reader.rows)
    return {"all": len(reader.rows), **dict(sorted(counts.items()))}


def stage_train(
    cfg: dict, target, work: Path, log: Logger, deadline: float | None, progress: bool, init_from: str | Path | None = None
) -> None:
    from dspark.dspark_drafter import build_model
    from dspark.dspark_drafter.checkpoint import warm_start
    from dspark.dspark_drafter.vocab import read_draft_vocab, save_draft_vocab
    from dspark.training.cache import CacheReader
    from dspark.training.trainer import TrainConfig, freeze_all_but, train

    readers = _readers(work)
    if "train" not in readers:
        raise SystemExit(f"no train cache under {work / 'cache' / 'train'}: run the generate stage first")
    rd = readers["train"]
    mcfg = model_config(cfg, target)
    tcfg = TrainConfig.from_dict({"seed": int(cfg.get("seed", 0)), **(cfg.get("train") or {})})
    model = build_model(mcfg, target.model)
    if init_from:
        if (state_dir(cfg, work) / "counters.json").is_file():
            log(f"train: resuming the run in {state_dir(cfg, work)}; --init-from {init_from} applies to fresh runs only")
        else:
            ck = warm_start(model, init_from, target)
            state_dir(cfg, work).mkdir(parents=True, exist_ok=True)
            if tcfg.reduced_vocab and ck.draft_vocab is not None and read_draft_vocab(state_dir(cfg, work), target.vocab_size) is None:
                # its weights were trained over that vocabulary: keep it (see run_vocabulary),
                # widened with the next most frequent tokens when `draft_vocab` asks for more
                ids = warm_start_vocabulary(cfg, ck.draft_vocab, work)
                save_draft_vocab(state_dir(cfg, work), ids)
                grown = f", grown to {len(ids)} with the next most frequent train-answer tokens" if len(ids) > len(ck.draft_vocab) else ""
                log(f"train: over the draft vocabulary of {init_from} ({len(ck.draft_vocab)} tokens{grown})")
            training = ck.extra.get("training") or {}
            before = {k: training.get(k) for k in ("steps", "wall_s", "cpu_hours", "train_sequences")}
            # the source's own head and origin: a chain of warm starts (e.g. a Markov drafter ->
            # markov_rank 0 -> more steps) stays traceable to where the Markov head was removed
            before |= {"markov_rank": ck.config.markov_rank, "init_from": training.get("init_from")}
            # the calibrate stage copies this into the card: the cost of a warm start includes its source's
            (state_dir(cfg, work) / "init_from.json").write_text(json.dumps({"checkpoint": str(init_from), **before}, indent=1))
            log(f"train: starting from the weights of {init_from} ({before['steps']} steps, {before['cpu_hours'] or 0:.2f} CPU h there)")
    n_train = len(rd.rows)
    if tcfg.trainable is not None:
        freeze_all_but(model, tcfg.trainable)  # train() freezes too; here so that the count below is what trains
        log(f"train: training only the parameters under {tcfg.trainable}, the rest frozen")
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"train: {n_train} sequences, {rd.num_positions()} cached positions; model {n_params / 1e6:.2f} M trainable params")
    if tcfg.domain_weights:
        log(f"train: answers walked per epoch by domain {tcfg.domain_weights} (others 1)")
    # held-out tau and a same-size slice of train rows (to watch over-fitting)
    evals = {}
    if "eval" in readers:
        evals["eval"] = (readers["eval"], list(range(len(readers["eval"].rows))))
    evals["train"] = (rd, list(range(0, n_train, max(1, n_train // 64))))
    def refresh():  # shards written since (generation still running) join the next epoch
        r = CacheReader(work / "cache" / "train")
        return r, list(range(len(r.rows)))

    vocab = run_vocabulary(cfg, target, work, log) if tcfg.reduced_vocab else None
    counters = train(
        model, rd, list(range(n_train)), tcfg, state_dir(cfg, work), evals, log=log, progress=progress, deadline=deadline, refresh=refresh,
        draft_vocab=vocab,
    )
    log(f"train: step {counters['step']}, wall {counters['wall_s']:.0f}s, cpu {counters['cpu_s'] / 3600:.2f} h, peak RSS {counters.get('peak_rss_mb', 0):.0f} MB")


def run_vocabulary(cfg: dict, target, work: Path, log: Logger):
    """The reduced draft vocabulary a `train.reduced_vocab` run trains over: chosen from the
    train answers when the run starts (or taken from the `--init-from` checkpoint) and kept in
    its state folder, so a resumed run (or a growing cache) does not move it, and the
    calibrate stage ships the same set."""
    from dspark.dspark_drafter.vocab import read_draft_vocab, save_draft_vocab

    folder = state_dir(cfg, work)
    ids = read_draft_vocab(folder, target.vocab_size)
    if ids is None:
        ids, info = draft_vocabulary(cfg, target, work)
        if ids is None:
            raise SystemExit("train.reduced_vocab needs `draft_vocab: N` in the config")
        folder.mkdir(parents=True, exist_ok=True)
        save_draft_vocab(folder, ids)
        log(f"train: over the reduced draft vocabulary {info}")
    else:
        log(f"train: over the run's reduced draft vocabulary ({len(ids)} tokens)")
    return ids


def warm_start_vocabulary(cfg: dict, trained, work: Path):
    """The draft vocabulary of a run warm-started from a drafter trained over `trained`: that
    one, or, when `draft_vocab: N` asks for more tokens, grown to N with the tokens the target
    emitted most often in its train answers (W2's new rows start at zero, so the drafter starts
    as the same function over the old tokens). A vocabulary never shrinks this way."""
    from dspark.dspark_drafter.vocab import grow_vocab
    from dspark.training.record import answer_tokens

    size = int(cfg.get("draft_vocab") or 0)
    if size <= len(trained):
        return trained
    answers = work / "cache" / "train" / "answers.jsonl"
    if not answers.is_file():
        raise SystemExit(f"growing the draft vocabulary needs the train answers ({answers}): run the generate stage first")
    return grow_vocab(trained, answer_tokens(answers), size)


def _init_from(cfg: dict, work: Path) -> dict | None:
    """Where a warm-started run began (see stage_train), or None for a run from scratch."""
    path = state_dir(cfg, work) / "init_from.json"
    return json.loads(path.read_text()) if path.is_file() else None


def stage_calibrate(cfg: dict, target, work: Path, output: Path, log: Logger, init_from: str | Path | None = None) -> dict:
    """Fit the copy prior (when the config has `copy_prior`) and the confidence calibration on
    the calib split, measure eval tau, write the checkpoint. The weights come from the train
    stage's state or, when there is none, from the `--init-from` checkpoint (re-calibrating
    a shipped drafter whose training state is gone)."""
    import torch

    from dspark.dspark_drafter import Fingerprint, build_model, save_checkpoint
    from dspark.dspark_drafter.calibration import sequential_temperature_scaling
    from dspark.dspark_drafter.checkpoint import confine_markov_head, warm_start
    from dspark.dspark_drafter.copy_prior import adjust_logits, fit_confidence
    from dspark.dspark_drafter.vocab import VOCAB_FILE
    from dspark.training.trainer import evaluate, load_state

    readers = _readers(work)
    model = build_model(model_config(cfg, target), target.model)
    counters = load_state(state_dir(cfg, work), model, torch.optim.AdamW(model.parameters()))
    source = None
    if counters is None:
        if not init_from:
            raise SystemExit(f"no training state in {state_dir(cfg, work)}: run the train stage first (or pass --init-from CHECKPOINT)")
        source = warm_start(model, init_from, target)
        log(f"calibrate: the weights of {init_from} (no training state in {state_dir(cfg, work)})")
    split = "calib" if "calib" in readers else "eval"
    ev = cfg.get("eval") or {}
    stride, max_blocks = int(ev.get("stride", 2)), ev.get("max_blocks")
    if source is not None and source.draft_vocab is not None and cfg.get("draft_vocab"):
        vocab = source.draft_vocab  # the vocabulary those weights were trained over
        vocab_info = (source.extra or {}).get("draft_vocab")
    else:
        vocab, vocab_info = draft_vocabulary(cfg, target, work, run_folder=state_dir(cfg, work))
    if vocab is not None:
        log(f"draft vocabulary: {vocab_info}")
        cleared = confine_markov_head(model, vocab)  # what is calibrated is what is saved: W2 over the vocabulary
        if cleared:
            log(f"Markov head: zeroed the {cleared} W2 rows outside the draft vocabulary (the checkpoint stores its rows only)")
    calib_rows = list(range(len(readers[split].rows)))
    copy, copy_info = fit_copy_prior(cfg, model, readers[split], calib_rows, vocab, log)
    res = evaluate(model, readers[split], calib_rows, stride, max_blocks, draft_vocab=vocab, copy=copy)
    if copy is not None:  # steps that copy are accepted more often than the head alone can tell
        copy = copy.with_confidence(fit_confidence(res.conf_logits, res.accepted, res.copy_class))
        res.conf_logits = adjust_logits(copy, res.conf_logits, res.copy_class)
        log(f"copy prior confidence per match class (scale, shift): {copy.to_dict()['confidence']}")
    sts = sequential_temperature_scaling(res.conf_logits, res.accepted, offsets=bool(cfg.get("calibration_offsets")))
    offsets = f", b = {[round(b, 2) for b in sts.offsets]}" if sts.offsets else ""
    log(f"calibrate on {split} ({len(res.domains)} blocks): T = {[round(t, 3) for t in sts.temperatures]}{offsets}, "
        f"ECE {sts.ece_before:.4f} -> {sts.ece_after:.4f}, AUC {sts.auc_before:.3f} -> {sts.auc_after:.3f}")
    if counters is not None:
        training = {
            "steps": counters["step"],
            "wall_s": counters["wall_s"],
            "cpu_hours": counters["cpu_s"] / 3600.0,
            "peak_rss_mb": counters.get("peak_rss_mb"),
            # what the train stage drew from (a state without these counts: the cache as it is now)
            "train_sequences": counters.get("train_sequences") or (len(readers["train"].rows) if "train" in readers else None),
            "train_positions": counters.get("train_positions") or (readers["train"].num_positions() if "train" in readers else None),
            "history": counters.get("history", [])[-5:],
            "config": counters.get("config"),
            "init_from": _init_from(cfg, work),
        }
    else:
        training = {**((source.extra or {}).get("training") or {}), "weights_from": str(init_from)}
    extra = {
        "calibration_split": split,
        "calibration_blocks": len(res.domains),
        "sts": sts.__dict__,
        "training": training,
        "draft_vocab": vocab_info,
        **({"copy_prior_fit": copy_info} if copy_info else {}),
    }
    if "eval" in readers:
        eval_rows = list(range(len(readers["eval"].rows)))
        walk = stride == 1 and max_blocks is None  # tau per round needs every anchor
        er = evaluate(model, readers["eval"], eval_rows, stride, max_blocks, draft_vocab=vocab, copy=copy)
        extra["eval_tau_kind"] = "per round" if walk else "per anchor"
        extra["eval_answers"] = answers_by_domain(readers["eval"])  # what the figures below rest on
        extra["eval_tau_greedy"] = er.tau_by_domain(decoded=walk)
        log(f"eval tau {extra['eval_tau_kind']} (greedy, gamma {model.cfg.gamma}): {json.dumps({k: round(v, 3) for k, v in extra['eval_tau_greedy'].items()})}")
        if copy is not None:
            off = evaluate(model, readers["eval"], eval_rows, stride, max_blocks, draft_vocab=vocab)
            extra["eval_tau_greedy_without_copy"] = off.tau_by_domain(decoded=walk)
            log(f"eval tau without the copy prior: {json.dumps({k: round(v, 3) for k, v in extra['eval_tau_greedy_without_copy'].items()})}")
    save_checkpoint(output, model, Fingerprint.of(target), temperatures=sts.temperatures, extra=extra, offsets=sts.offsets,
                    copy_prior=copy, draft_vocab=vocab)
    stale = output / VOCAB_FILE
    if vocab is None and stale.is_file():
        stale.unlink()
    log(f"checkpoint written to {output} ({sum(f.stat().st_size for f in output.iterdir()) / 1e6:.1f} MB)")
    return extra


def fit_copy_prior(cfg: dict, model, reader, rows: list[int], vocab, log: Logger):
    """(copy rule, fit record) from the config's `copy_prior:`, on `rows` (the calib split);
    (None, None) without one.
    - `{scorer: {orders, l2}, ...}`: the learned copy decision (`CopyScorer`): every copy decision
      along the target's own path (`collect_copy_decisions`), fitted as a conditional logit
      (`fit_copy_scorer`); the record has the fit and greedy tau per round with and without it.
    - `{orders, grid, kinds, kind_grid}` (no `scorer`, or `scorer: null`): one bonus per order
      by coordinate ascent of greedy tau per round (every anchor evaluated, each answer walked
      round by round: what decoding gains); then, with `kinds`, one sweep refining the bonus
      of each (order, kind)."""
    from dspark.dspark_drafter.copy_prior import fit_bonuses, fit_copy_scorer
    from dspark.training.trainer import collect_copy_decisions, evaluate_copy_priors

    spec = cfg.get("copy_prior")
    if not spec:
        return None, None

    def score(priors):
        return [r.decoded_tau() for r in evaluate_copy_priors(model, reader, rows, priors, 1, draft_vocab=vocab)]

    if spec.get("scorer") is not None:
        orders = tuple(spec["scorer"].get("orders", [2, 3, 4, 5, 6, 8]))
        t0 = time.time()
        decisions = collect_copy_decisions(model, reader, rows, orders, vocab)
        scorer, info = fit_copy_scorer(decisions, orders, float(spec["scorer"].get("l2", 1e-4)))
        without, with_ = score([None, scorer])
        log(f"copy scorer on {len(rows)} calib answers: {info['decisions']} decisions in {time.time() - t0:.0f} s, top-1 right in "
            f"{info['top1_right']:.3f}, fitted rule right in {info['decision_accuracy']:.3f}; tau {without:.3f} without -> {with_:.3f}")
        info = {"objective": "conditional logit of the target's token among the top-1 and the copy candidates", **info,
                "calib_tau_without": without, "calib_tau": with_}
        return (scorer if scorer.active else None), info
    best, tried = fit_bonuses(score, spec.get("orders", [2, 3, 4]), spec.get("grid", [2, 4, 8, 16, 32]))
    log(f"copy prior on {len(rows)} calib answers ({len(tried)} tried): {best.to_dict()}, "
        f"tau {tried[0][1]:.3f} without -> {max(t for _, t in tried):.3f}")
    if spec.get("kinds"):
        before = len(tried)
        best, tried = fit_bonuses(score, [], spec.get("kind_grid", spec.get("grid", [2, 4, 8, 16, 32])), sweeps=1,
                                  kinds=tuple(spec["kinds"]), start=best, scored=dict(tried))
        log(f"copy prior per match kind ({len(tried) - before} tried): {best.to_dict()}, tau {max(t for _, t in tried):.3f}")
    info = {"objective": "greedy tau per round", "tried": [[p.to_dict(), round(t, 4)] for p, t in tried]}
    return (best if best.active else None), info


def draft_vocabulary(cfg: dict, target, work: Path, run_folder: Path | None = None):
    """(token ids, card info) of the reduced draft vocabulary (`draft_vocab: N` in the config:
    the N tokens the target emitted most often in its train-split answers, plus EOS), or
    (None, None) to draft from the whole vocabulary. A run that trained over a reduced
    vocabulary (`run_folder` holds it) keeps that one."""
    size = cfg.get("draft_vocab")
    if not size:
        return None, None
    from dspark.dspark_drafter.vocab import frequent_tokens, read_draft_vocab
    from dspark.training.record import answer_tokens

    trained = read_draft_vocab(run_folder, target.vocab_size) if run_folder is not None else None
    if trained is not None:
        ids = trained
        info = {"size": len(ids), "requested": int(size), "source": "the reduced vocabulary the drafter was trained over "
                "(most frequent tokens of the train-split answers when training started, plus EOS)"}
    else:
        answers = work / "cache" / "train" / "answers.jsonl"
        if not answers.is_file():
            raise SystemExit(f"draft_vocab needs the train answers ({answers}): run the generate stage first")
        ids = frequent_tokens(answer_tokens(answers), int(size), always=target.eos_token_ids)
        info = {"size": len(ids), "requested": int(size), "source": "most frequent tokens of the train-split answers, plus EOS"}
    held_out = work / "cache" / "eval" / "answers.jsonl"
    if held_out.is_file():
        keep = set(ids.tolist())
        toks = [t for seq in answer_tokens(held_out) for t in seq]
        info["eval_answer_coverage"] = sum(t in keep for t in toks) / max(1, len(toks))
    return ids, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.train_drafter", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="training config (YAML), e.g. configs/train_smollm2.yaml")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {STAGES}")
    ap.add_argument("--work-dir", help="override work_dir (cache, state, logs)")
    ap.add_argument("--output", help="override the checkpoint output directory")
    ap.add_argument("--steps", type=int, help="override train.steps")
    ap.add_argument("--seed", type=int, help="override seed (sampling, shuffling and initialisation)")
    ap.add_argument("--minutes", type=float, help="stop generate/train cleanly after this many minutes (resumable)")
    ap.add_argument(
        "--init-from",
        metavar="CHECKPOINT",
        help="a fresh train run starts from this drafter checkpoint's weights (same target and architecture, "
        "except that model.num_layers and model.markov_rank may grow: the grown drafter starts as the same function; "
        "e.g. the shipped one, to continue it on more data or deeper) instead of random ones; the calibrate stage "
        "without a training state re-calibrates this checkpoint (e.g. to fit a copy prior)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    args = ap.parse_args(argv)

    cfg = load_config(args.config)
    if args.steps is not None:
        cfg.setdefault("train", {})["steps"] = args.steps
    if args.seed is not None:
        cfg["seed"] = args.seed
    work = Path(args.work_dir or cfg.get("work_dir") or "/tmp/dspark-train").expanduser()
    output = Path(args.output or cfg.get("output") or work / "checkpoint")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stage(s) {bad}; choose from {STAGES}")
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    log = Logger(work / "train_drafter.log")
    log(f"config {args.config}, stages {stages}, work_dir {work}, output {output}, pid {os.getpid()}")
    setup_torch(cfg)

    targets: dict = {}

    def target_in(dtype: str):  # each dtype loaded once
        if dtype not in targets:
            targets[dtype] = load_target(cfg, dtype)
        return targets[dtype]

    dtype = cfg.get("dtype", "float32")
    if "generate" in stages:  # `generate.dtype` may differ: answers and cache only, training stays in `dtype`
        stage_generate(cfg, target_in((cfg.get("generate") or {}).get("dtype") or dtype), work, log, deadline)
    if "train" in stages:
        stage_train(cfg, target_in(dtype), work, log, deadline, progress=not args.no_progress, init_from=args.init_from)
    if "calibrate" in stages:
        stage_calibrate(cfg, target_in(dtype), work, output, log, init_from=args.init_from)
    return 0


if __name__ == "__main__":
    from pipelines import run_main

    raise SystemExit(run_main(main))
