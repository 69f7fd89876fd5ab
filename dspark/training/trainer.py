"""Training and offline evaluation of the DSpark drafter on a target cache.

Streaming: an epoch visits the train rows' shards in a seeded order, `shard_window` shards at a
time; anchors of the loaded window are shuffled into batches. Only the window is in memory.
Deterministic: the plan of epoch e is a pure function of (seed, e) and the cache index, and a
resumed run skips to its batch within the plan, so a resumed run reproduces an unbroken one.
Resumable: `state/` holds weights + AdamW moments (safetensors) and a JSON of counters.
"""

from __future__ import annotations

import json
import math
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dspark.dspark_drafter.copy_prior import CopyRule, CopyScorer, NgramIndex, StepView, scorer_features
from dspark.dspark_drafter.losses import LossWeights, dspark_loss
from dspark.dspark_drafter.model import DSparkModel
from dspark.training.cache import Batch, CacheReader, anchors_for, make_batch


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 32
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    anchor_stride: int = 3  # anchors every `stride` answer positions (random phase per epoch)
    anchors_per_sequence: int = 1  # blocks of one sequence that share a batch (and its context projection)
    # how often an epoch walks a domain's sequences: {chat: 2, math: 0.5} walks every chat answer
    # twice (each time from its own anchor phase) and each math answer with probability 0.5;
    # unnamed domains 1. For a workload whose mix differs from the training prompts'.
    domain_weights: dict[str, float] = field(default_factory=dict)
    shard_window: int = 4
    seed: int = 0
    save_every: int = 200
    eval_every: int = 200
    eval_stride: int = 4
    eval_max_blocks: int = 1500
    # the held-out monitor walks this many answers (spread over the split) round by round: tau
    # per round, as the evaluation reports it. None: the per-anchor average over eval_max_blocks
    # blocks every eval_stride positions (cheaper; it overstates tau and follows it only loosely)
    eval_answers: int | None = None
    log_every: int = 25
    autocast_bf16: bool = True
    reduced_vocab: bool = False  # train over the config's `draft_vocab` tokens (fixed at the run's start)
    # parameter-name prefixes to train, the rest frozen (None: all), e.g. ["markov_", "conf_head"]
    # for a Markov head grown onto a trained drafter without moving the backbone it was fitted to
    trainable: list[str] | None = None
    weights: LossWeights = field(default_factory=LossWeights)

    @staticmethod
    def from_dict(d: dict) -> "TrainConfig":
        d = dict(d)
        if "weights" in d and isinstance(d["weights"], dict):
            d["weights"] = LossWeights(**d["weights"])
        return TrainConfig(**d)


def freeze_all_but(model: torch.nn.Module, prefixes: list[str]) -> None:
    """Freeze every parameter whose name starts with none of `prefixes`. An empty list, or a
    prefix that names no parameter, is refused (a typo would silently train nothing of what
    was meant)."""
    if not prefixes:
        raise ValueError("train.trainable is empty: nothing would train (null trains every parameter)")
    names = [name for name, _ in model.named_parameters()]
    unknown = [p for p in prefixes if not any(name.startswith(p) for name in names)]
    if unknown:
        roots = sorted({name.split(".")[0] for name in names})
        raise ValueError(f"train.trainable: {unknown} name no parameter of the drafter (its parameters start with {roots})")
    for name, param in model.named_parameters():
        if not name.startswith(tuple(prefixes)):
            param.requires_grad_(False)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ------------------------------------------------------------------ data plan


def check_domain_weights(weights: dict[str, float], domains: set[str]) -> None:
    """A misspelt domain would silently train on the usual mix: refuse it, and negative weights."""
    unknown = sorted(set(weights) - domains)
    if unknown:
        raise ValueError(f"train.domain_weights names {unknown}, not a domain of this cache ({sorted(domains)})")
    negative = {d: w for d, w in weights.items() if w < 0}
    if negative:
        raise ValueError(f"train.domain_weights must be >= 0, got {negative}")


def _passes(weight: float, rng: np.random.Generator) -> int:
    """Walks of one sequence in an epoch: floor(weight), plus one with probability frac(weight).
    Weight 1 draws nothing, so runs without domain weights keep their exact plans."""
    whole, frac = int(weight), weight - int(weight)
    return whole + int(frac > 0 and rng.random() < frac)


def epoch_plan(reader: CacheReader, rows: list[int], gamma: int, cfg: TrainConfig, epoch: int) -> list[list[tuple[int, int]]]:
    """Batches of (row index into reader.rows, anchor) for one epoch."""
    rng = np.random.default_rng([cfg.seed, epoch])
    by_shard: dict[int, list[int]] = {}
    for r in rows:
        by_shard.setdefault(reader.rows[r].shard, []).append(r)
    shards = sorted(by_shard)
    shards = [shards[i] for i in rng.permutation(len(shards))]
    batches: list[list[tuple[int, int]]] = []
    per_seq = max(1, cfg.anchors_per_sequence)
    for w in range(0, len(shards), cfg.shard_window):
        groups: list[list[tuple[int, int]]] = []  # up to per_seq anchors of one row, shuffled
        for s in shards[w : w + cfg.shard_window]:
            for r in by_shard[s]:
                for _ in range(_passes(cfg.domain_weights.get(reader.rows[r].domain, 1.0), rng)):
                    phase = int(rng.integers(cfg.anchor_stride))
                    anchors = anchors_for(reader.rows[r], gamma, cfg.anchor_stride, phase)
                    anchors = [anchors[i] for i in rng.permutation(len(anchors))]
                    groups += [[(r, a) for a in anchors[j : j + per_seq]] for j in range(0, len(anchors), per_seq)]
        items = [item for i in rng.permutation(len(groups)) for item in groups[i]]
        batches += [items[i : i + cfg.batch_size] for i in range(0, len(items), cfg.batch_size)]
    return batches


class ShardPool:
    """Keeps the most recently used shards in memory (at most `size`)."""

    def __init__(self, reader: CacheReader, size: int) -> None:
        self.reader, self.size, self.cache = reader, size, {}

    def row(self, r: int) -> dict[str, torch.Tensor]:
        info = self.reader.rows[r]
        if info.shard not in self.cache:
            if len(self.cache) >= self.size:
                self.cache.pop(next(iter(self.cache)))
            self.cache[info.shard] = self.reader.load_shard(info.shard)
        shard = self.cache.pop(info.shard)
        self.cache[info.shard] = shard  # most recent last
        return CacheReader.row(shard, info.row)


def group_by_row(items: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    """(row, anchor) items -> [(row, its anchors)] in order of first appearance: the order of
    the blocks in the Batch that `load_batch` builds."""
    by_row: dict[int, list[int]] = {}
    for r, a in items:
        by_row.setdefault(r, []).append(a)
    return list(by_row.items())


def load_batch(pool: ShardPool, items: list[tuple[int, int]], gamma: int, context_len: int) -> Batch:
    """(row, anchor) items -> a Batch in which the anchors of one row share its context."""
    return make_batch([(pool.row(r), anchors) for r, anchors in group_by_row(items)], gamma, context_len)


# ------------------------------------------------------------------ steps


def target_logits(model: DSparkModel, final: torch.Tensor) -> torch.Tensor:
    """[B, G, d] cached final states -> [B, G, V] float32 target logits (shared LM head)."""
    w = model.lm_head_weight
    return (final.to(w.dtype) @ w.T).float()


def forward_batch(model: DSparkModel, batch: Batch, autocast: bool, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ctx = model.project_context(batch.ctx_feats)
        logits, conf = model.teacher_forced(ctx, batch.ctx_valid, batch.tokens, vocab, batch.ctx_index, batch.block_pos)
    return logits.float(), conf.float()


def walk_rounds(rows: np.ndarray, anchors: np.ndarray, gained: np.ndarray) -> np.ndarray:
    """Indices of the blocks decoding visits: per row from its first anchor, a round at block
    i gains gained[i] tokens (>= 1) and the next round starts that many positions later, up to
    the row's last anchor. Every anchor of a row must be present (stride 1)."""
    visited: list[int] = []
    for r in np.unique(rows):
        sel = np.flatnonzero(rows == r)
        at = dict(zip(anchors[sel].tolist(), sel.tolist()))
        first, last = min(at), max(at)
        if len(at) != last - first + 1:
            raise ValueError("a per-round walk needs every anchor of a row (evaluate with stride 1, no max_blocks)")
        p = first
        while p <= last:
            visited.append(at[p])
            p += int(gained[at[p]])
    return np.array(visited, dtype=np.int64)


def decoded_tau(accepted: np.ndarray, rows: np.ndarray, anchors: np.ndarray) -> float:
    """Tokens per round of the walk over blocks [n, G] of acceptances (1: the drafted token at
    k is the target's) with their rows and anchors [n] (`walk_rounds`); nan for no blocks."""
    gained = 1 + np.cumprod(accepted, axis=1).sum(1).astype(np.int64)
    visited = walk_rounds(rows, anchors, gained)
    return float(gained[visited].mean()) if len(visited) else float("nan")


@dataclass
class EvalResult:
    accepted: np.ndarray  # [n, G] greedy: drafted token == target argmax at k (prefix products are exact)
    conf_logits: np.ndarray  # [n, G] raw confidence logits along the drafted (free-running) chain
    l1: np.ndarray  # [n, G] ||p_d - p_t||_1 teacher forced (sampling at T = 1: acceptance = 1 - l1/2)
    domains: list[str]
    copy_class: np.ndarray | None = None  # [n, G] the copy prior's match class per step (0: none)
    rows: np.ndarray | None = None  # [n] the cache row of each block
    anchors: np.ndarray | None = None  # [n] its anchor position in that row
    targets: np.ndarray | None = None  # [n, G] the target's greedy token at each block position
    seen: np.ndarray | None = None  # [n, G] that token occurs earlier in the sequence (prompt, answer, block)

    def tau(self, mask: np.ndarray | None = None) -> float:
        """Greedy tau = 1 + accepted prefix length, averaged over anchors (counts the bonus token).
        Every anchor weighs the same, so a stretch the drafter gets right counts once per position
        in it, while decoding crosses it in a few rounds: this overstates tokens per round
        wherever easy and hard stretches alternate. `decoded_tau` is the per-round figure."""
        acc = self.accepted if mask is None else self.accepted[mask]
        return float(1.0 + np.cumprod(acc, axis=1).sum(1).mean()) if len(acc) else float("nan")

    def decoded_tau(self, mask: np.ndarray | None = None) -> float:
        """Tokens per round as greedy decoding with a gamma-token chain realises them: each
        answer is walked from its first anchor, a round at anchor p gains 1 + accepted tokens
        and the next starts where it ended. Needs every anchor (stride 1, no subsampling); the
        walk stops at the last full block, as the anchors do. Pooled: emitted / rounds."""
        if self.rows is None or self.anchors is None:
            raise ValueError("decoded_tau needs the blocks' rows and anchors")
        keep = np.ones(len(self.accepted), bool) if mask is None else np.asarray(mask, bool)
        return decoded_tau(self.accepted[keep], self.rows[keep], self.anchors[keep])

    def tau_by_domain(self, decoded: bool = False) -> dict[str, float]:
        fn = self.decoded_tau if decoded else self.tau
        doms = np.array(self.domains)
        out = {d: fn(doms == d) for d in sorted(set(self.domains))}
        out["all"] = fn()
        return out

    def per_position_acceptance(self) -> np.ndarray:
        """[G] P(position k accepted | 1..k-1 accepted)."""
        pre = np.cumprod(self.accepted, axis=1)
        reach = np.concatenate([np.ones((len(pre), 1)), pre[:, :-1]], axis=1)
        return pre.sum(0) / np.maximum(reach.sum(0), 1)

    def subset(self, mask: np.ndarray) -> "EvalResult":
        pick = lambda a: None if a is None else a[mask]  # noqa: E731
        doms = [d for d, m in zip(self.domains, mask) if m]
        return EvalResult(self.accepted[mask], self.conf_logits[mask], self.l1[mask], doms, pick(self.copy_class), pick(self.rows),
                          pick(self.anchors), pick(self.targets), pick(self.seen))


def markov_step(model: DSparkModel, base: torch.Tensor, conf_h: torch.Tensor, prev: torch.Tensor, markov: bool = True):
    """One step of the chain before copying: base logits [B, V] of block position k plus the
    Markov bias of the previous token prev [B] -> (logits [B, V], bias [B, V] or 0, raw
    confidence logits [B]). markov=False: no bias (the head switched off at inference)."""
    feat = model.markov_features(prev) if markov else None
    bias = model.markov_bias(feat)
    return base + bias, bias, model.conf_logit(conf_h, feat)


def free_running(
    model: DSparkModel,
    base_logits: torch.Tensor,
    conf_h: torch.Tensor,
    anchor: torch.Tensor,
    markov: bool = True,
    copy: CopyRule | None = None,
    lookups: list[tuple[NgramIndex, list[int]]] | None = None,
    full_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy chain exactly as the drafter proposes it: x_k = argmax(U_k + B(x_{k-1})).
    Returns tokens [B, G], raw confidence logits [B, G] and each step's copy match class
    [B, G] (0: none). markov=False drops the bias (the Markov head switched off at
    inference). With `copy`, each block's n-gram matches (`lookups`: per block its index of
    the sequence up to the anchor and that sequence's tail) rescore the copied tokens
    (`copy_step`), scored from `full_logits` (their LM-head rows, also outside a reduced
    vocabulary), as the run-time drafter does. The confidence logits are the head's own: the
    run-time drafter also applies the rule's correction for each step's match class
    (`adjust_logits`)."""
    prev, toks, confs, classes = anchor, [], [], []
    use_copy = copy is not None and copy.active and lookups is not None
    suffixes = [list(tail[-copy.span :]) for _, tail in lookups] if use_copy else []  # committed tail + drafted
    for k in range(base_logits.shape[1]):
        logits, bias, z = markov_step(model, base_logits[:, k], conf_h[:, k], prev, markov)
        cls = torch.zeros(len(anchor), dtype=torch.long)
        if use_copy:
            found = [copy.lookup(index, suffix, fresh=k) for (index, _), suffix in zip(lookups, suffixes)]
            cls = torch.tensor([c for c, _ in found], dtype=torch.long)
            full = (full_logits if full_logits is not None else base_logits)[:, k] + bias
            logits = copy_step(copy, logits, full, [cands for _, cands in found], z, k)
        confs.append(z)
        classes.append(cls)
        prev = logits.argmax(-1)
        toks.append(prev)
        if use_copy:
            for suffix, x in zip(suffixes, prev.tolist()):
                suffix.append(x)
    return torch.stack(toks, 1), torch.stack(confs, 1), torch.stack(classes, 1)


def _step_inputs(logits: torch.Tensor, full: torch.Tensor, copies: list[dict], z: torch.Tensor, k: int):
    """Per block: each candidate's (logit, in the draft vocabulary) and the step's `StepView`."""
    entries = [(b, t) for b, cands in enumerate(copies) for t in cands]
    own: list[dict[int, tuple[float, bool]]] = [{} for _ in copies]
    if entries:
        r, c = (list(x) for x in zip(*entries))
        for (b, t), v, inside in zip(entries, full[r, c].tolist(), (logits[r, c] > float("-inf")).tolist()):
            own[b][t] = (v, inside)
    top, top_tok = logits.max(-1)
    views = [StepView(k, t, v, s, q) for t, v, s, q in zip(top_tok.tolist(), top.tolist(), torch.logsumexp(logits, -1).tolist(), z.float().tolist())]
    return own, views


def copy_step(copy: CopyRule, logits: torch.Tensor, full: torch.Tensor, copies: list[dict], z: torch.Tensor, k: int) -> torch.Tensor:
    """One Markov step's copying for B blocks: logits [B, V] (-inf outside the draft
    vocabulary), full [B, V] (every token's LM-head logit plus the Markov bias), per block the
    rule's candidates, raw confidence logits z [B] -> the logits with each candidate rescored."""
    if not any(copies):
        return logits
    own, views = _step_inputs(logits, full, copies, z, k)
    new = [(b, t, v) for b, cands in enumerate(copies) if cands for t, v in copy.rescore(cands, own[b], views[b]).items()]
    if not new:
        return logits
    r, c, v = zip(*new)
    logits = logits.clone()
    logits[list(r), list(c)] = torch.tensor(v, dtype=logits.dtype)
    return logits


class TeacherForcedStep(NamedTuple):
    k: int  # depth in the block
    logits: torch.Tensor  # [B, V] the Markov step's logits before copying
    bias: torch.Tensor  # [B, V] or 0: its Markov bias
    z: torch.Tensor  # [B] raw confidence logits
    copies: list[dict]  # per block: the rule's candidates
    suffixes: list[list[int]]  # per block: the path so far (committed tail + the target's tokens before k);
    # extended in place after each step: read them before asking for the next


def along_target_path(
    model: DSparkModel,
    base_logits: torch.Tensor,
    conf_h: torch.Tensor,
    anchor: torch.Tensor,
    rule: CopyRule,
    lookups: list[tuple[NgramIndex, list[int]]],
    targets: torch.Tensor,
) -> Iterator[TeacherForcedStep]:
    """The drafter's Markov steps along the target's own path (teacher forced: step k follows
    the target's tokens before it, which is the drafted path for as long as a round keeps
    accepting), with the rule's candidates at each. Shapes as `free_running`; targets [B, G]."""
    prev = anchor
    suffixes = [list(tail[-rule.span :]) for _, tail in lookups]
    for k in range(base_logits.shape[1]):
        logits, bias, z = markov_step(model, base_logits[:, k], conf_h[:, k], prev)
        copies = [rule.lookup(index, suffix, fresh=k)[1] for (index, _), suffix in zip(lookups, suffixes)]
        yield TeacherForcedStep(k, logits, bias, z, copies, suffixes)
        prev = targets[:, k]
        for suffix, x in zip(suffixes, prev.tolist()):
            suffix.append(x)


def copy_decisions(
    model: DSparkModel,
    base_logits: torch.Tensor,
    conf_h: torch.Tensor,
    anchor: torch.Tensor,
    scorer: CopyScorer,
    lookups: list[tuple[NgramIndex, list[int]]],
    full_logits: torch.Tensor,
    targets: torch.Tensor,
) -> list[tuple[list[list[float]], int]]:
    """The copy decisions along the target's own path (`along_target_path`) for
    `fit_copy_scorer`: at each step with candidates other than the drafter's top-1, their
    features and which option the target's token is (0: the top-1, i: candidate i); steps where
    it is neither are left out. Shapes as `free_running`; targets [B, G] the target's greedy tokens."""
    out: list[tuple[list[list[float]], int]] = []
    for step in along_target_path(model, base_logits, conf_h, anchor, scorer, lookups, targets):
        k, copies = step.k, step.copies
        own, views = _step_inputs(step.logits, full_logits[:, k] + step.bias, copies, step.z, k)
        for b, cands in enumerate(copies):
            options = [t for t in cands if t != views[b].top1]
            truth = int(targets[b, k])
            if not options or (truth != views[b].top1 and truth not in options):
                continue
            label = 0 if truth == views[b].top1 else 1 + options.index(truth)
            out.append(([scorer.features(cands[t], *own[b][t], views[b]) for t in options], label))
    return out


def _eval_items(reader: CacheReader, rows: list[int], gamma: int, stride: int, max_blocks: int | None) -> list[tuple[int, int]]:
    items = [(r, a) for r in rows for a in anchors_for(reader.rows[r], gamma, stride, 0, full_blocks=True)]
    if max_blocks is not None and len(items) > max_blocks:
        keep = np.random.default_rng(12345).choice(len(items), max_blocks, replace=False)
        items = [items[i] for i in sorted(keep)]
    return items


def seen_before(tokens: list[int], anchors: list[int], targets: np.ndarray) -> np.ndarray:
    """Per block of one row (anchors [n], targets [n, G]): whether target token k occurs
    earlier in the sequence, i.e. in tokens[: anchor + 1] or among the block's targets before
    k -> bool [n, G]. What a copy mechanism could have proposed."""
    first: dict[int, int] = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    out = np.zeros(targets.shape, dtype=bool)
    for j, a in enumerate(anchors):
        row = targets[j].tolist()
        for k, t in enumerate(row):
            out[j, k] = first.get(t, a + 1) <= a or t in row[:k]
    return out


def _lookups(pool: ShardPool, chunk: list[tuple[int, int]], orders: tuple[int, ...]) -> list[tuple[NgramIndex, list[int]]]:
    """Per block (in Batch order): an n-gram index of its row's tokens up to the anchor, and them."""
    out = []
    for r, anchors in group_by_row(chunk):
        toks = pool.row(r)["tokens"].tolist()
        prompt_len = pool.reader.rows[r].answer_start
        for a in anchors:
            out.append((NgramIndex(orders, toks[: a + 1], prompt_len=prompt_len), toks[: a + 1]))
    return out


def _blocks(model: DSparkModel, reader: CacheReader, items: list[tuple[int, int]], batch_size: int, autocast: bool, draft_vocab: torch.Tensor | None):
    """Batches of (row, anchor) blocks through the drafter's block forward: yields the shard
    pool, the chunk, its Batch, the forward's output, the base logits [B, G, V] over every
    token and masked to the draft vocabulary (-inf outside), and the target's logits."""
    g, n = model.cfg.gamma, model.cfg.context_len
    pool = ShardPool(reader, 2)
    forbid = None  # [V]: 0 inside the draft vocabulary, -inf outside
    if draft_vocab is not None:
        forbid = torch.full((model.cfg.vocab_size,), float("-inf"))
        forbid[draft_vocab] = 0.0
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        batch = load_batch(pool, chunk, g, n)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ctx = model.project_context(batch.ctx_feats)
            out = model.forward_block(ctx, batch.ctx_valid, batch.tokens[:, 0], None, batch.ctx_index, batch.block_pos)
        full = out.base_logits.float()  # [B, G, V]
        masked = full if forbid is None else full + forbid
        yield pool, chunk, batch, out, full, masked, target_logits(model, batch.final)


@torch.no_grad()
def collect_copy_decisions(
    model: DSparkModel,
    reader: CacheReader,
    rows: list[int],
    orders: tuple[int, ...],
    draft_vocab: torch.Tensor | None = None,
    batch_size: int = 64,
) -> list[tuple[list[list[float]], int]]:
    """`copy_decisions` over every full block of `rows` (stride 1): what `fit_copy_scorer` fits.
    Shows a progress bar on a terminal."""
    from tqdm.auto import tqdm

    scorer = CopyScorer(orders, (0.0,) * len(scorer_features(tuple(sorted(orders)))))
    items = _eval_items(reader, rows, model.cfg.gamma, 1, None)
    was_training = model.training
    model.eval()
    out: list[tuple[list[list[float]], int]] = []
    bar = tqdm(total=len(items), desc="copy decisions", unit="block", disable=None, mininterval=5)
    for pool, chunk, batch, fwd, full, masked, target in _blocks(model, reader, items, batch_size, False, draft_vocab):
        lookups = _lookups(pool, chunk, scorer.orders)
        out += copy_decisions(model, masked, fwd.conf_h, batch.tokens[:, 0], scorer, lookups, full, target.argmax(-1))
        bar.update(len(chunk))
    bar.close()
    model.train(was_training)
    return out


@torch.no_grad()
def evaluate(
    model: DSparkModel,
    reader: CacheReader,
    rows: list[int],
    stride: int = 4,
    max_blocks: int | None = None,
    batch_size: int = 64,
    autocast: bool = False,
    markov: bool = True,
    draft_vocab: torch.Tensor | None = None,
    copy: CopyRule | None = None,
) -> EvalResult:
    """Offline greedy evaluation on full blocks with deterministic anchors (every `stride`):
    the drafter's free-running chain against the target's argmax from the cache. With
    `draft_vocab` (token ids) the drafter may only propose those tokens, as at run time; with
    `copy` its copy prior looks the row's cached tokens up (the whole prompt when the cache
    was built with a window that wide)."""
    return evaluate_copy_priors(model, reader, rows, [copy], stride, max_blocks, batch_size, autocast, markov, draft_vocab)[0]


@torch.no_grad()
def evaluate_copy_priors(
    model: DSparkModel,
    reader: CacheReader,
    rows: list[int],
    priors: list[CopyRule | None],
    stride: int = 4,
    max_blocks: int | None = None,
    batch_size: int = 64,
    autocast: bool = False,
    markov: bool = True,
    draft_vocab: torch.Tensor | None = None,
) -> list[EvalResult]:
    """`evaluate` for several copy priors at once: the drafter's forward runs once per block,
    only the greedy walk per prior (what makes fitting the bonuses on a grid affordable)."""
    g = model.cfg.gamma
    items = _eval_items(reader, rows, g, stride, max_blocks)
    was_training = model.training
    model.eval()
    acc = [[] for _ in priors]
    conf = [[] for _ in priors]
    cls = [[] for _ in priors]
    l1s, doms, where, targets, seen = [], [], [], [], []
    orders = tuple(sorted({o for p in priors if p is not None for o in p.orders}))
    for pool, chunk, batch, out, full, masked, target in _blocks(model, reader, items, batch_size, autocast, draft_vocab):
        greedy = target.argmax(-1).numpy()  # [B, G]
        targets.append(greedy)
        at = 0
        for r, anchors in group_by_row(chunk):
            seen.append(seen_before(pool.row(r)["tokens"].tolist(), anchors, greedy[at : at + len(anchors)]))
            at += len(anchors)
        lookups = _lookups(pool, chunk, orders) if orders else None
        for j, prior in enumerate(priors):
            drafted, c, m = free_running(model, masked, out.conf_h, batch.tokens[:, 0], markov, prior, lookups, full)
            acc[j].append((drafted == target.argmax(-1)).numpy())
            conf[j].append(c.float().numpy())
            cls[j].append(m.numpy())
        feat = model.markov_features(batch.tokens[:, :-1]) if markov else None
        tf = (masked + model.markov_bias(feat)).float()  # teacher forced
        l1s.append((tf.softmax(-1) - target.softmax(-1)).abs().sum(-1).numpy())
        doms += [reader.rows[r].domain for r, anchors in group_by_row(chunk) for _ in anchors]
        where += [(r, a) for r, anchors in group_by_row(chunk) for a in anchors]
    model.train(was_training)
    if not l1s:
        z = np.zeros((0, g))
        e = np.zeros(0, np.int64)
        return [EvalResult(z, z, z, [], z.astype(np.int64), e, e, z.astype(np.int64), z.astype(bool)) for _ in priors]
    l1 = np.concatenate(l1s)
    rows_, anchors_ = (np.array(x, dtype=np.int64) for x in zip(*where))
    targets_, seen_ = np.concatenate(targets), np.concatenate(seen)
    return [
        EvalResult(np.concatenate(a).astype(np.float64), np.concatenate(c), l1, doms, np.concatenate(m), rows_, anchors_, targets_, seen_)
        for a, c, m in zip(acc, conf, cls)
    ]


# ------------------------------------------------------------------ state


def save_state(folder: Path, model: DSparkModel, opt: torch.optim.Optimizer, counters: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"opt.{names[id(p)]}.{key}"] = st[key].contiguous()
            if "step" in st:
                counters.setdefault("opt_step", {})[names[id(p)]] = float(st["step"])
    tmp = folder / "state.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(folder / "state.safetensors")
    (folder / "counters.json.tmp").write_text(json.dumps(counters, indent=1))
    (folder / "counters.json.tmp").replace(folder / "counters.json")


def load_state(folder: Path, model: DSparkModel, opt: torch.optim.Optimizer) -> dict | None:
    if not (folder / "counters.json").is_file():
        return None
    counters = json.loads((folder / "counters.json").read_text())
    tensors = load_file(str(folder / "state.safetensors"))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    params = dict(model.named_parameters())
    for name, p in params.items():
        if f"opt.{name}.exp_avg" in tensors:
            opt.state[p] = {
                "step": torch.tensor(counters.get("opt_step", {}).get(name, 0.0)),
                "exp_avg": tensors[f"opt.{name}.exp_avg"],
                "exp_avg_sq": tensors[f"opt.{name}.exp_avg_sq"],
            }
    return counters


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ------------------------------------------------------------------ loop


def spread(rows: list[int], n: int) -> list[int]:
    """n of rows, evenly spaced from the first to the last (all of them when n >= len(rows))."""
    if n >= len(rows):
        return list(rows)
    return [rows[i] for i in np.linspace(0, len(rows) - 1, n).round().astype(int)]


def monitor_tau(model: DSparkModel, reader: CacheReader, rows: list[int], cfg: TrainConfig, draft_vocab: torch.Tensor | None) -> float:
    """Held-out greedy tau for the training log (no copy rule: that is fitted at calibration)."""
    if cfg.eval_answers:
        res = evaluate(model, reader, spread(rows, cfg.eval_answers), 1, None, autocast=cfg.autocast_bf16, draft_vocab=draft_vocab)
        return res.decoded_tau()
    return evaluate(model, reader, rows, cfg.eval_stride, cfg.eval_max_blocks, autocast=cfg.autocast_bf16, draft_vocab=draft_vocab).tau()


def train(
    model: DSparkModel,
    reader: CacheReader,
    train_rows: list[int],
    cfg: TrainConfig,
    state_dir: Path,
    eval_sets: dict[str, tuple[CacheReader, list[int]]] | None = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
    deadline: float | None = None,
    refresh: Callable[[], tuple[CacheReader, list[int]]] | None = None,
    draft_vocab: torch.Tensor | None = None,
) -> dict:
    """Train to cfg.steps (resuming from state_dir); returns the counters (history, costs).
    `refresh`, if given, is called at every epoch boundary for a new (reader, rows): a cache
    that is still growing (generation running alongside) joins the next epoch.
    `draft_vocab` (sorted token ids) trains the draft distribution over the reduced vocabulary
    it will propose from (see dspark_loss); the held-out tau then drafts from it too. On CPU
    this makes a step much cheaper: the LM head's gradient pass and the draft softmax shrink
    from V to Vd columns."""
    check_domain_weights(cfg.domain_weights, {r.domain for r in reader.rows})
    torch.manual_seed(cfg.seed)
    g, n = model.cfg.gamma, model.cfg.context_len
    if cfg.trainable is not None:
        freeze_all_but(model, cfg.trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=True,  # one kernel over all parameters: 4x faster than the per-tensor loop on CPU (50 -> 12 ms a step here)
    )
    counters = load_state(state_dir, model, opt) or {
        "step": 0, "epoch": 0, "batch_in_epoch": 0, "wall_s": 0.0, "cpu_s": 0.0, "history": [], "config": asdict(cfg)
    }
    counters["config"] = asdict(cfg)  # the schedule in force (a resume may change steps)
    if counters["step"]:
        log(f"resumed at step {counters['step']} (epoch {counters['epoch']}, batch {counters['batch_in_epoch']})")
    model.train()

    def drawing_from(reader: CacheReader, rows: list[int]) -> None:
        # what the run has trained on, for the card: the cache may grow while it runs or after
        counters["train_sequences"] = max(counters.get("train_sequences", 0), len(rows))
        counters["train_positions"] = max(counters.get("train_positions", 0), sum(reader.rows[r].length for r in rows))

    pool = ShardPool(reader, cfg.shard_window)
    plan = epoch_plan(reader, train_rows, g, cfg, counters["epoch"])
    drawing_from(reader, train_rows)
    t_wall, t_cpu = time.time(), time.process_time()
    wall0, cpu0 = counters["wall_s"], counters["cpu_s"]
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=counters["step"], desc="train", disable=not progress, mininterval=5)
    run_loss = None

    def checkpoint() -> None:
        counters["wall_s"] = wall0 + time.time() - t_wall
        counters["cpu_s"] = cpu0 + time.process_time() - t_cpu
        counters["peak_rss_mb"] = max(counters.get("peak_rss_mb", 0.0), peak_rss_mb())
        save_state(state_dir, model, opt, counters)

    while counters["step"] < cfg.steps:
        if deadline is not None and time.time() > deadline:
            log("deadline reached; state saved")
            break
        if counters["batch_in_epoch"] >= len(plan):
            counters["epoch"] += 1
            counters["batch_in_epoch"] = 0
            if refresh is not None:
                reader, train_rows = refresh()
                pool = ShardPool(reader, cfg.shard_window)
                log(f"epoch {counters['epoch']}: {len(train_rows)} sequences, {reader.num_positions()} positions")
            plan = epoch_plan(reader, train_rows, g, cfg, counters["epoch"])
            drawing_from(reader, train_rows)
        items = plan[counters["batch_in_epoch"]]
        batch = load_batch(pool, items, g, n)
        for group in opt.param_groups:
            group["lr"] = lr_at(counters["step"], cfg)
        logits, conf = forward_batch(model, batch, cfg.autocast_bf16, draft_vocab)
        with torch.no_grad():
            tl = target_logits(model, batch.final)
        out = dspark_loss(logits, tl, batch.tokens[:, 1:], conf, batch.valid, cfg.weights, draft_vocab)
        opt.zero_grad(set_to_none=True)
        out.total.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        counters["step"] += 1
        counters["batch_in_epoch"] += 1
        vals = [float(out.total.detach()), float(out.ce), float(out.tv), float(out.conf)]
        run_loss = vals if run_loss is None else [0.95 * a + 0.05 * b for a, b in zip(run_loss, vals)]
        bar.update(1)
        bar.set_postfix(loss=f"{run_loss[0]:.3f}", ce=f"{run_loss[1]:.2f}", tv=f"{run_loss[2]:.3f}")
        step = counters["step"]
        if not progress and step % cfg.log_every == 0:  # background runs: a plain log line instead of a bar
            log(f"step {step}/{cfg.steps} loss {run_loss[0]:.4f} (ce {run_loss[1]:.3f} tv {run_loss[2]:.4f} conf {run_loss[3]:.4f}) "
                f"lr {lr_at(step - 1, cfg):.2e} epoch {counters['epoch']} {time.time() - t_wall:.0f}s")
        if eval_sets and (step % cfg.eval_every == 0 or step == cfg.steps):
            rec = {"step": step, "loss": run_loss, "epoch": counters["epoch"]}
            rec["tau_kind"] = "per round" if cfg.eval_answers else "per anchor"
            for name, (rd, rows) in eval_sets.items():
                rec[f"tau_{name}"] = monitor_tau(model, rd, rows, cfg, draft_vocab)
            counters["history"].append(rec)
            log(json.dumps(rec))
        if step % cfg.save_every == 0 or step == cfg.steps:
            checkpoint()
    bar.close()
    checkpoint()
    return counters
