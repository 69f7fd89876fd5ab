"""The decode loop: continuous batching, one target forward per round for the whole batch.

Each round:
  draft     the drafter proposes a tree per active row (anchor = the row's last token)
  schedule  the scheduler picks how many nodes per row to verify (highest survival first)
  verify    one forward over [anchor, nodes...] per row (ragged, tree attention)
  accept    walk each row's tree along the target's own tokens (argmax, or the row's noise
            draw; `dspark.verify`); commit the accepted slots
  emit      append accepted tokens + the target's own token; stop on EOS/stop/length
Finished rows leave the batch and queued requests are prefilled into the free places; a
prefill also gives each new row its first token (from the prompt's last logits, as plain
decoding does), so that token costs no round of its own.

A row drafts at most as deep as it has room for: in the context (prompt + output never
exceeds `max_context`, as in plain decoding) and in its own `max_new_tokens`.
Sampled rows draw every token with their own noise (`dspark.sampling.SamplingNoise`), so
their output depends on their seed and the target only.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dspark.draft_gate import DraftGate, gate_for
from dspark.drafters.base import DraftRequest, Drafter, VerifyOutcome
from dspark.metrics import RequestStats, round_counts
from dspark.models import TargetModel
from dspark.runner import ModelRunner
from dspark.sampling import SamplingNoise, SamplingParams, draw_tokens, greedy_tokens, probs_from_logits
from dspark.schedulers import Scheduler
from dspark.tree import DraftTree, top_survival_nodes
from dspark.verify import verify_tree


@dataclass
class Request:
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # sampled rows: None draws a fresh random seed
    time_limit_s: float | None = None  # wall time from admission; past it the row stops early
    # filled in by the engine
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    t_admit: float = 0.0
    t_first: float | None = None
    t_done: float = 0.0
    stop_text_len: int | None = None  # text cut point when a stop string matched
    # draft back-off: rounds in a row whose draft got no verify budget, and rounds left to skip
    idle_streak: int = 0
    skip_drafting: int = 0

    @property
    def latency_s(self) -> float:
        return self.t_done - self.t_admit

    @property
    def ttft_s(self) -> float:
        return (self.t_first or self.t_done) - self.t_admit


class SpeculativeEngine:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        scheduler: Scheduler,
        max_batch_size: int = 8,
        max_draft_backoff: int = 8,
        draft_gate: bool | DraftGate | None = None,
    ) -> None:
        self.target = target
        # A row whose drafts the scheduler keeps pruning to nothing stops drafting for 1, 2,
        # 4 ... (at most this many) rounds: an expensive drafter then costs ~nothing where it
        # does not help. Decided from past rounds only, so it never affects what is sampled.
        self.max_draft_backoff = max_draft_backoff
        self.drafter = drafter
        self.scheduler = scheduler
        self.max_batch_size = max_batch_size
        self.runner = ModelRunner(target.model, hidden_layers=tuple(drafter.target_layers))
        self.eos = set(target.eos_token_ids)
        self.vocab = target.vocab_size
        # Whether to draft at all, from measured round times and yields (dspark/draft_gate.py).
        # None: as the scheduler asks (on for `dspark`, which prices rounds with a cost table;
        # fixed and threshold policies verify what they are told to). A DraftGate instance is
        # used as it is (a generator keeps one across calls).
        if isinstance(draft_gate, DraftGate):
            self.gate: DraftGate | None = draft_gate
        elif draft_gate is None:
            self.gate = gate_for(scheduler)
        elif draft_gate:
            cost = getattr(scheduler, "cost", None)
            if cost is None:
                raise ValueError("the draft gate needs the scheduler's cost table")
            self.gate = DraftGate(cost.plain_latency)
        else:
            self.gate = None

    # --- admission -------------------------------------------------------------------------
    def _admit(self, new: list[Request], active: list[tuple[Request, DraftRequest]]) -> None:
        """Prefill the new rows' whole prompts into the batch and emit each row's first token
        from the prefill's last logits (as plain decoding does: no extra forward for it)."""
        now = time.perf_counter()
        fresh, hidden, logits = self.runner.prefill_with_logits([r.prompt_ids for r in new])
        self.runner.cache.append_rows(fresh)
        logits = logits[:, : self.vocab]
        argmax = greedy_tokens(logits).tolist()
        t_first = time.perf_counter()
        for b, req in enumerate(new):
            req.t_admit = now
            noise = None
            if not req.sampling.greedy:
                seed = req.seed if req.seed is not None else secrets.randbits(63)  # no seed asked for: a fresh random one
                noise = SamplingNoise(seed, self.vocab)
                first = noise.draw(probs_from_logits(logits[b], req.sampling), len(req.prompt_ids))
            else:
                first = argmax[b]
            # the drafter sees hidden states for every token but the last (the next anchor)
            dreq = DraftRequest(req.index, list(req.prompt_ids) + [first], req.sampling, noise=noise)
            prompt_hidden = None
            if hidden is not None:
                prompt_hidden = [h[b, : len(req.prompt_ids)] for h in hidden]
            self.drafter.start(dreq, prompt_hidden)
            self._emit(req, [first], t_first)
            req.stats.record_prefill()
            active.append((req, dreq))

    def _retire(self, active: list[tuple[Request, DraftRequest]]) -> list[tuple[Request, DraftRequest]]:
        keep = [i for i, (req, _) in enumerate(active) if req.finish_reason is None]
        if len(keep) == len(active):
            return active
        for req, dreq in active:
            if req.finish_reason is not None:
                self.drafter.finish(dreq)
        self.runner.cache.select_rows(keep)
        return [active[i] for i in keep]

    # --- one round -------------------------------------------------------------------------
    def _schedule(self, trees: list[DraftTree]) -> list[DraftTree]:
        budgets = self.scheduler.budgets(trees)
        out = []
        for tree, budget in zip(trees, budgets):
            if budget >= len(tree):
                out.append(tree)
            else:
                out.append(tree.subset(top_survival_nodes(tree, budget)))
        return out

    def _room(self, req: Request, dreq: DraftRequest) -> int:
        """How deep this row may draft: every verified node needs a context position (the
        anchor sits at len(token_ids) - 1), and tokens past max_new_tokens would be dropped."""
        return min(self.target.max_context - len(dreq.token_ids), req.max_new_tokens - len(req.output_ids) - 1)

    def _propose(self, active: list[tuple[Request, DraftRequest]], depth: int) -> list[DraftTree]:
        trees = [DraftTree() for _ in active]
        rooms = [self._room(req, dreq) for req, dreq in active]
        depth = min(depth, max(rooms, default=0))
        if depth <= 0:
            return trees
        rows = []
        for i, (req, _) in enumerate(active):
            if req.skip_drafting > 0:
                req.skip_drafting -= 1
            else:
                rows.append(i)
        if rows and not getattr(self.drafter, "drafts_row_subsets", True):
            rows = list(range(len(active)))
        if rows:
            for i, tree in zip(rows, self.drafter.propose([active[i][1] for i in rows], depth)):
                trees[i] = tree if tree.max_depth() <= rooms[i] else within_depth(tree, rooms[i])
        return trees

    def _update_backoff(self, active: list[tuple[Request, DraftRequest]], drafted: list[DraftTree], scheduled: list[DraftTree]) -> None:
        if self.max_draft_backoff <= 0:
            return
        for (req, _), full, kept in zip(active, drafted, scheduled):
            if len(full) == 0:
                continue  # skipped or nothing to propose: no evidence either way
            if len(kept) > 0:
                req.idle_streak = 0
            else:
                req.idle_streak += 1
                if req.idle_streak >= 2:
                    req.skip_drafting = min(2 ** (req.idle_streak - 2), self.max_draft_backoff)

    def _round(self, active: list[tuple[Request, DraftRequest]]) -> None:
        dreqs = [d for _, d in active]
        t0 = time.perf_counter()
        depth = self.scheduler.max_depth
        if self.gate is not None and depth > 0 and not self.gate.should_draft():
            depth = 0
        drafted = self._propose(active, depth)
        t1 = time.perf_counter()
        trees = self._schedule(drafted)
        self._update_backoff(active, drafted, trees)
        blocks = [([d.token_ids[-1]] + t.tokens, [-1] + [p + 1 for p in t.parents]) for d, t in zip(dreqs, trees)]
        out = self.runner.forward_block(blocks)
        logits = out.logits[..., : self.vocab]
        greedy_rows = [i for i, (r, _) in enumerate(active) if r.sampling.greedy]
        argmax = greedy_tokens(logits).tolist() if greedy_rows else None
        verdicts = []
        for i, ((req, dreq), tree) in enumerate(zip(active, trees)):
            if req.sampling.greedy:
                verdicts.append(verify_tree(tree, argmax[i]))
            else:
                # block position j draws the token at index len(token_ids) + depth(j)
                probs = probs_from_logits(logits[i, : len(tree) + 1], req.sampling)
                base = len(dreq.token_ids)
                drawn = draw_tokens(probs, dreq.noise, [base] + [base + d for d in tree.depths()])
                verdicts.append(verify_tree(tree, drawn))
        keep = [[0] + [k + 1 for k in v.accepted_nodes] for v in verdicts]
        self.runner.cache.commit(keep)
        t2 = time.perf_counter()
        kept_total = 0
        for i, ((req, dreq), tree, verdict) in enumerate(zip(active, trees, verdicts)):
            st = req.stats
            st.draft_s += (t1 - t0) / len(active)
            st.verify_s += (t2 - t1) / len(active)
            new_tokens = [tree.tokens[k] for k in verdict.accepted_nodes] + [verdict.next_token]
            kept = self._emit(req, new_tokens, t2)
            kept_total += kept
            st.record_round(len(drafted[i]), round_counts(tree.parents, verdict.accepted_nodes, kept), tree.confidence)
            dreq.token_ids.extend(new_tokens)
            if dreq.noise is not None:
                dreq.noise.forget_before(len(dreq.token_ids))
            hidden = None
            if out.hidden is not None:
                idx = torch.tensor(keep[i], device=out.hidden[0].device)
                hidden = [h[i].index_select(0, idx) for h in out.hidden]
            self.drafter.observe(dreq, VerifyOutcome(req.index, tree, verdict.accepted_nodes, verdict.next_token, hidden))
        if self.gate is not None and self.scheduler.max_depth > 0:
            self.gate.record(len(active), t2 - t0, kept_total, drafted=any(len(t) > 0 for t in drafted), propose_s=t1 - t0)
        self.runner.cache.maybe_compact()

    def _emit(self, req: Request, tokens: list[int], now: float) -> int:
        """Append tokens until the row ends; returns how many it kept."""
        if req.t_first is None:
            req.t_first = now
        room = self.target.max_context - len(req.prompt_ids)  # prompt + output fit the context
        for kept, tok in enumerate(tokens, start=1):
            req.output_ids.append(tok)
            if tok in self.eos:
                req.finish_reason = "eos"
            elif req.stop_strings and self._hit_stop(req):
                req.finish_reason = "stop"
            elif len(req.output_ids) >= min(req.max_new_tokens, room):
                req.finish_reason = "length"
            if req.finish_reason:
                req.t_done = now
                return kept
        return len(tokens)

    @staticmethod
    def _enforce_time_limits(active: list[tuple[Request, DraftRequest]]) -> None:
        # checked between rounds: a row overshoots its limit by at most one round
        now = time.perf_counter()
        for req, _ in active:
            if req.finish_reason is None and req.time_limit_s is not None and now - req.t_admit > req.time_limit_s:
                req.finish_reason = "time_limit"
                req.t_done = now

    def _hit_stop(self, req: Request) -> bool:
        text = self.target.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in req.stop_strings if s and s in text]
        if cuts:
            req.stop_text_len = min(cuts)
            return True
        return False

    # --- the loop --------------------------------------------------------------------------
    def run(self, requests: list[Request], on_finish: Callable[[Request], None] | None = None) -> list[Request]:
        queue = deque(requests)
        active: list[tuple[Request, DraftRequest]] = []
        try:
            while queue or active:
                room = self.max_batch_size - len(active)
                if queue and room > 0:
                    self._admit([queue.popleft() for _ in range(min(room, len(queue)))], active)
                if all(req.finish_reason is None for req, _ in active):
                    self._round(active)
                    self._enforce_time_limits(active)
                # else: a row finished on its first token; retire it before the next round
                finished = [r for r, _ in active if r.finish_reason is not None]
                active = self._retire(active)
                if on_finish is not None:
                    for r in finished:
                        on_finish(r)
        finally:
            # on an exception (e.g. out of memory) the drafter must still drop the rows'
            # state, or a reused drafter would line up the next call with stale rows
            for _, dreq in active:
                self.drafter.finish(dreq)
            self.runner.cache.select_rows([])
        return requests


def within_depth(tree: DraftTree, depth: int) -> DraftTree:
    """The nodes of `tree` at most `depth` deep (ancestor-closed, so a valid tree)."""
    return tree.subset([i for i, d in enumerate(tree.depths()) if d <= depth])
