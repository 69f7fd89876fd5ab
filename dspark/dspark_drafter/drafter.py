"""The DSpark drafter as an engine plug-in (`dspark.drafters.base.Drafter` protocol).

Per request, `request.state["ctx_kv"]` holds, for every drafter layer, the context keys and
values [<=N, KV*D] of the last N committed tokens (token_ids[:-1]; the anchor token_ids[-1]
is not in the target cache yet), keys rotated at their positions in the sequence:
each committed position is projected once (W_c, the layer's K/V projections, RoPE), not once
per round; `request.state["ctx_end"]` counts the positions seen, i.e. the anchor's position.
`start` queues the prompt's states and `observe` the states of the tokens committed in each
round (`ctx_pending`, at most N); `propose` projects every queued position of the batch in
one call (`project_context`) before drafting.

`propose` runs ONE batched backbone forward for all requests, then walks the Markov head left
to right:
- greedy requests: the argmax chain. Where the Markov head's top choices are close
  (p_2 >= branch_ratio * p_1) it adds the next `branch_width - 1` candidates as siblings,
  each optionally continued greedily for `branch_extend` more tokens;
- sampling requests: a chain drawn from the Markov-biased distribution after the request's
  SamplingParams, with the noise the target draws the same token indices with.
Confidence c_k = sigmoid((w · [h_k ; W1[x_{k-1}]] + b) / T_k) uses the parent's token only. A
sibling candidate j (j >= 2) gets (1 - c_k) · p_j / (1 - p_1): the miss mass shared in
proportion to the drafter's own probabilities (a function of the ancestors only).

With a reduced draft vocabulary (`dspark.dspark_drafter.vocab`) every distribution above is
over those tokens only (verification still checks each draft against the full target).

With a copy rule (`dspark.dspark_drafter.copy_prior`) each Markov step also rescores the
tokens that followed the latest earlier occurrences of the path's last n-grams, in the
committed sequence (`request.state["ngrams"]`) or along the drafted path itself: a
`CopyPrior` adds a bonus by the n-gram's order and the kind of match (seen once, always
continued alike, or not), a `CopyScorer` sets the logit to l_top1 + u(c), its learned utility.
A copied token outside the draft vocabulary gets an extra column scored from its LM-head row,
so distributions are over the draft vocabulary plus those columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.cpu_matmul import PackedLinear, build_kernels, pack_linear_layers
from dspark.drafters.base import DraftRequest, DrafterBase, VerifyOutcome
from dspark.dspark_drafter.copy_prior import CopyRule, NgramIndex, StepView
from dspark.dspark_drafter.model import DSparkModel
from dspark.dspark_drafter.vocab import DraftVocab
from dspark.sampling import probs_from_logits
from dspark.tree import DraftTree


@dataclass
class DrafterOptions:
    branch_width: int = 3  # candidates per step at a branch point (1 = chains only)
    branch_ratio: float = 0.3  # branch where p_2 >= ratio * p_1
    branch_extend: int = 1  # greedy tokens continued below each extra candidate
    max_nodes: int = 24  # cap on nodes per tree
    stop_at_eos: bool = True


class DSparkDrafter(DrafterBase):
    name = "dspark"

    def __init__(
        self,
        model: DSparkModel,
        temperatures: list[float] | None = None,
        options: DrafterOptions | None = None,
        eos_token_ids: list[int] | None = None,
        draft_vocab: torch.Tensor | None = None,
        offsets: list[float] | None = None,
        copy: CopyRule | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.packed = self._pack_linears()
        self.vocab = DraftVocab(self.model, draft_vocab)  # None: draft from the whole vocabulary
        self.cfg = model.cfg
        self.target_layers = tuple(self.cfg.target_layers)
        t = temperatures or [1.0] * self.cfg.gamma
        self.temperatures = torch.tensor(list(t) + [1.0] * (self.cfg.gamma - len(t)), dtype=torch.float32)
        b = offsets or [0.0] * self.cfg.gamma
        self.offsets = torch.tensor(list(b) + [0.0] * (self.cfg.gamma - len(b)), dtype=torch.float32)
        self._step_scales = [(float(t), float(o)) for t, o in zip(self.temperatures, self.offsets)]  # per depth, as Python floats
        self.options = options or DrafterOptions()
        self.eos = set(eos_token_ids or [])
        self.device = model.embed_weight.device
        self.copy = copy if copy is not None and copy.active else None
        self._corrections = {c: (a, b) for c, a, b in self.copy.confidence} if self.copy is not None else {}  # match class -> (scale, shift)
        self._column: list[int] | None = None  # token id -> its column in the draft vocabulary (-1 outside)
        if self.copy is not None and self.vocab.token_ids is not None:
            column = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long)
            column[self.vocab.token_ids.cpu()] = torch.arange(self.vocab.size)
            self._column = column.tolist()

    def _pack_linears(self) -> bool:
        """Run the drafter's own linears on packed weights under the target's kernel choice
        (`dspark.cpu_matmul`), q/k/v and gate/up as one matmul each: a round's calls have a few
        rows (batch x gamma), where packed kernels beat plain BLAS and a call's fixed cost
        counts. A no-op where the target's head is not packed (GPU, half precision). The model
        is inference-only from here on (the packed copies are frozen)."""
        choice = self.model.head_kernels
        if choice is None:
            return False
        if isinstance(self.model.ctx_proj, PackedLinear):  # another plug-in over this model packed it
            return True
        pack_linear_layers(self.model.layers, choice)
        self.model.ctx_proj = PackedLinear(self.model.ctx_proj, choice)
        build_kernels([self.model.ctx_proj])
        for layer in self.model.layers:
            layer.fuse_projections()
        return True

    # ------------------------------------------------------------- request lifecycle

    def _append_context(self, request: DraftRequest, hidden: list[torch.Tensor] | None) -> None:
        """Queue the committed positions' target states; `project_context` projects them."""
        if not hidden or hidden[0].shape[0] == 0:
            return
        feats = torch.cat([h.to(self.device) for h in hidden], dim=-1)  # [n, m*d_t]
        pending = request.state.get("ctx_pending")
        if pending is not None:
            feats = torch.cat([pending, feats])
        if feats.shape[0] > self.cfg.context_len:  # older positions would be dropped anyway
            feats = feats[-self.cfg.context_len :].clone()  # a copy: a view would keep a long prompt's states alive
        request.state["ctx_pending"] = feats
        request.state["ctx_end"] = request.state.get("ctx_end", 0) + hidden[0].shape[0]

    @torch.no_grad()
    def project_context(self, requests: list[DraftRequest]) -> None:
        """Project the requests' queued positions into every layer's context keys/values, all
        requests in one batch (`propose` does this first). Deferred to here so that a round
        costs one projection for the batch instead of one per row, and rounds in which the
        engine does not draft (the draft gate, a row's back-off) cost none: a row's queue holds
        at most its last N positions."""
        todo = [r for r in requests if r.state.get("ctx_pending") is not None]
        if not todo:
            return
        pending = [r.state.pop("ctx_pending") for r in todo]
        sizes = [p.shape[0] for p in pending]
        # position of each queued row in its own sequence: the last ones before the anchor
        positions = torch.cat([torch.arange(r.state["ctx_end"] - n, r.state["ctx_end"]) for r, n in zip(todo, sizes)])
        h_ctx = self.model.project_context(torch.cat(pending))  # [sum n, d]
        new = self.model.context_kv(h_ctx, positions=positions.to(self.device))  # per layer ([sum n, KV*D], same)
        n = self.cfg.context_len
        split = [(k.split(sizes), v.split(sizes)) for k, v in new]  # per layer, per request
        for i, r in enumerate(todo):
            fresh = [(k[i], v[i]) for k, v in split]
            old = r.state.get("ctx_kv")
            if old is not None:
                fresh = [(torch.cat([k0, k1])[-n:], torch.cat([v0, v1])[-n:]) for (k0, v0), (k1, v1) in zip(old, fresh)]
            r.state["ctx_kv"] = fresh

    def _index_tokens(self, request: DraftRequest) -> None:
        if self.copy is None:
            return
        if "ngrams" not in request.state:  # at start: every token but the anchor (the first output) is the prompt
            request.state["ngrams"] = NgramIndex(self.copy.orders, prompt_len=len(request.token_ids) - 1)
        index = request.state["ngrams"]
        index.extend(request.token_ids[index.size :])

    def start(self, request: DraftRequest, prompt_hidden: list[torch.Tensor] | None) -> None:
        for key in ("ctx_kv", "ctx_pending", "ctx_end", "ngrams"):
            request.state.pop(key, None)
        self._append_context(request, prompt_hidden)
        self._index_tokens(request)

    def observe(self, request: DraftRequest, outcome: VerifyOutcome) -> None:
        self._append_context(request, outcome.hidden)
        self._index_tokens(request)

    def finish(self, request: DraftRequest) -> None:
        request.state.clear()

    # ------------------------------------------------------------- drafting

    def _batch_context(self, requests: list[DraftRequest]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """Every layer's context keys/values, right-aligned [B, W, KV*D], their validity [B, W]
        and each anchor's position [B]; W is the longest context in the batch (at most N), not
        N: short contexts attend over their own length."""
        kvs = [r.state.get("ctx_kv") for r in requests]
        width = max([kv[0][0].shape[0] for kv in kvs if kv is not None] + [1])
        num_layers, cols = len(self.model.layers), self.model.layers[0].k_proj.out_features
        dtype = self.model.mask_embed.dtype
        out = [tuple(torch.zeros(len(requests), width, cols, dtype=dtype, device=self.device) for _ in range(2)) for _ in range(num_layers)]
        valid = torch.zeros(len(requests), width, dtype=torch.bool, device=self.device)
        block_pos = torch.tensor([r.state.get("ctx_end", 0) for r in requests], dtype=torch.long, device=self.device)
        for b, kv in enumerate(kvs):
            if kv is None or kv[0][0].shape[0] == 0:
                continue
            m = kv[0][0].shape[0]
            valid[b, width - m :] = True
            for (k_all, v_all), (k, v) in zip(out, kv):
                k_all[b, width - m :] = k
                v_all[b, width - m :] = v
        return out, valid, block_pos

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        depth = min(int(max_depth), self.cfg.gamma)
        if depth <= 0 or not requests:
            return [DraftTree() for _ in requests]
        self.project_context(requests)
        ctx_kv, valid, block_pos = self._batch_context(requests)
        anchors = torch.tensor([r.token_ids[-1] for r in requests], dtype=torch.long, device=self.device)
        h, conf_h = self.model.backbone(ctx_kv, valid, anchors, depth, block_pos=block_pos)  # [B, depth, d], [B, depth]
        base_logits = self.vocab.logits(h)  # [B, depth, Vd]
        trees = [DraftTree() for _ in requests]
        greedy = [b for b, r in enumerate(requests) if r.sampling.greedy]
        if len(greedy) == len(requests):  # the usual case: no copies of the batch's logits
            self._greedy_trees(requests, trees, base_logits, conf_h, h, depth)
        elif greedy:
            self._greedy_trees([requests[b] for b in greedy], [trees[b] for b in greedy], base_logits[greedy], conf_h[greedy], h[greedy], depth)
        for b, r in enumerate(requests):
            if not r.sampling.greedy:
                trees[b] = self._sampled_chain(r, base_logits[b], conf_h[b], h[b], depth)
        return trees

    def _step(
        self,
        base_logits: torch.Tensor,
        conf_h: torch.Tensor,
        rows: torch.Tensor,
        k: int,
        prev: torch.Tensor,
        hidden: torch.Tensor | None = None,
        matches: list[tuple[int, dict]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Markov step at depth k (0-based) for n parents: rows [n] index the batch, prev [n]
        are the parents' tokens -> logits [n, Vd + E], calibrated confidences [n], and the
        tokens of the E extra columns [n, E] (None without any). One call per depth for the
        whole batch: W2 is read once (the step is memory-bound). `matches` (per parent: the
        copy rule's match class and candidates) and `hidden` [B, G, d] apply the copy rule."""
        feat = self.model.markov_features(prev)
        logits = base_logits[:, k].index_select(0, rows) + self.vocab.markov_bias(feat)
        z = self.model.conf_logit(conf_h[:, k].index_select(0, rows), feat)
        extra = None
        if matches is not None:
            raw = z
            if self._corrections:  # the confidence correction of each parent's match class (as `adjust_logits`, in float64)
                scale, shift = zip(*(self._corrections.get(cls, (1.0, 0.0)) for cls, _ in matches))
                f64 = dict(dtype=torch.float64, device=z.device)
                z = (z.double() * torch.tensor(scale, **f64) + torch.tensor(shift, **f64)).to(z.dtype)
            if any(cands for _, cands in matches):
                logits, extra = self._add_copies(logits, [cands for _, cands in matches], hidden[rows, k], feat, raw, k)
        temperature, offset = self._step_scales[k]
        conf = torch.sigmoid(z / temperature + offset)
        return logits, conf, extra

    def _add_copies(
        self, logits: torch.Tensor, copies: list[dict], h: torch.Tensor, feat: torch.Tensor | None, z: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each parent's copy candidates get the logit the copy rule gives them (`rescore`): in
        place for draft-vocabulary tokens, as extra columns for the others. logits [n, Vd],
        h [n, d] the parents' hidden states, z [n] their raw confidence logits."""
        logits = logits.clone()
        entries = [(i, tok) for i, cands in enumerate(copies) for tok in cands]  # (parent, token)
        cols = [tok if self._column is None else self._column[tok] for _, tok in entries]
        own = self._own_logits(logits, entries, cols, h, feat)
        top, top_col = logits.max(-1)
        top_tok = self._column_tokens(top_col[:, None], None)[:, 0].tolist()
        lse, top, z = torch.logsumexp(logits, -1).tolist(), top.tolist(), z.float().tolist()
        per_parent: list[dict[int, tuple[float, bool]]] = [{} for _ in copies]
        for (i, tok), c, v in zip(entries, cols, own):
            per_parent[i][tok] = (v, c >= 0)
        new_inside: list[tuple[int, int, float]] = []
        new_outside: list[tuple[int, int, float]] = []
        for i, cands in enumerate(copies):
            if not cands:
                continue
            scores = self.copy.rescore(cands, per_parent[i], StepView(k, top_tok[i], top[i], lse[i], z[i]))
            for tok, v in scores.items():
                c = tok if self._column is None else self._column[tok]
                (new_inside if c >= 0 else new_outside).append((i, c if c >= 0 else tok, v))
        if new_inside:
            r, c, v = zip(*new_inside)
            logits[list(r), list(c)] = torch.tensor(v, dtype=logits.dtype, device=logits.device)
        if not new_outside:
            return logits, None
        width = max(sum(1 for o in new_outside if o[0] == i) for i in {o[0] for o in new_outside})
        ext = torch.full((logits.shape[0], width), float("-inf"), dtype=logits.dtype, device=logits.device)
        ext_tok = torch.zeros(logits.shape[0], width, dtype=torch.long, device=logits.device)
        slot: dict[int, int] = {}
        for i, tok, v in new_outside:
            ext[i, slot.get(i, 0)], ext_tok[i, slot.get(i, 0)] = v, tok
            slot[i] = slot.get(i, 0) + 1
        return torch.cat([logits, ext], dim=-1), ext_tok

    def _own_logits(
        self, logits: torch.Tensor, entries: list[tuple[int, int]], cols: list[int], h: torch.Tensor, feat: torch.Tensor | None
    ) -> list[float]:
        """The logit each (parent, token) entry has before copying, which the copy rule starts
        from: its column's, or for a token outside the draft vocabulary (column -1) its full
        LM-head row plus the Markov bias."""
        own = [0.0] * len(entries)
        inside = [j for j, c in enumerate(cols) if c >= 0]
        outside = [j for j, c in enumerate(cols) if c < 0]
        if inside:
            for j, v in zip(inside, logits[[entries[j][0] for j in inside], [cols[j] for j in inside]].tolist()):
                own[j] = v
        if outside:
            r = [entries[j][0] for j in outside]
            tok = torch.tensor([entries[j][1] for j in outside], device=logits.device)
            score = (h[r].to(self.model.lm_head_weight.dtype) * self.model.lm_head_weight[tok]).sum(-1).float()  # U(tok) [m]
            if feat is not None:
                score = score + (feat[r].float() * self.model.markov_w2[tok].float()).sum(-1)  # + B(prev, tok)
            for j, v in zip(outside, score.tolist()):
                own[j] = v
        return own

    def _column_tokens(self, columns: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """Columns [n, w] of a step's logits -> token ids [n, w] (extra columns: their tokens)."""
        vd = self.vocab.size
        inside = self.vocab.tokens(columns.clamp(max=vd - 1))
        if extra is None:
            return inside
        return torch.where(columns < vd, inside, extra.gather(1, (columns - vd).clamp(min=0)))

    def _matches(self, request: DraftRequest, path: list[int]) -> tuple[int, dict]:
        """The copy rule's (match class, candidates) after the committed tokens plus a drafted `path`."""
        suffix = request.token_ids[-self.copy.span :] + path if self.copy.span else path
        return self.copy.lookup(request.state["ngrams"], suffix, fresh=len(path))

    def _sampled_chain(self, request: DraftRequest, base_logits: torch.Tensor, conf_h: torch.Tensor, hidden: torch.Tensor, depth: int) -> DraftTree:
        tree = DraftTree()
        prev, parent, path = request.token_ids[-1], -1, []
        row = torch.zeros(1, dtype=torch.long, device=self.device)
        for k in range(depth):
            matches = [self._matches(request, path)] if self.copy is not None else None
            logits, c, extra = self._step(base_logits[None], conf_h[None], row, k, torch.tensor([prev], device=self.device), hidden[None], matches)
            q = probs_from_logits(logits[0], request.sampling)  # [Vd + E]
            columns = torch.arange(q.shape[-1], device=self.device)[None]
            col_tokens = self._column_tokens(columns, extra)[0]  # [Vd + E] token id of each column
            tok = int(col_tokens[request.sampling_noise().draw(q, len(request.token_ids) + k, col_tokens)])
            parent = tree.add(tok, parent, float(c[0]))
            prev = tok
            path.append(tok)
            if self.options.stop_at_eos and tok in self.eos:
                break
        return tree

    def _greedy_trees(
        self, requests: list[DraftRequest], trees: list[DraftTree], base_logits: torch.Tensor, conf_h: torch.Tensor, hidden: torch.Tensor, depth: int
    ) -> None:
        """Depth-synchronous greedy trees for a batch. A frontier entry is (row, parent node,
        drafted path to it (its last token is the parent's), extension steps left; -1 = the
        main chain)."""
        opt = self.options
        width = max(1, opt.branch_width)
        frontier = [(b, -1, (), -1) for b in range(len(requests))]
        for k in range(depth):
            frontier = [f for f in frontier if len(trees[f[0]]) < opt.max_nodes and not (opt.stop_at_eos and f[1] >= 0 and f[2][-1] in self.eos)]
            if not frontier:
                return
            rows = torch.tensor([f[0] for f in frontier], dtype=torch.long, device=self.device)
            prev = torch.tensor([f[2][-1] if f[2] else requests[f[0]].token_ids[-1] for f in frontier], dtype=torch.long, device=self.device)
            matches = [self._matches(requests[b], list(path)) for b, _, path, _ in frontier] if self.copy is not None else None
            logits, conf, extra = self._step(base_logits, conf_h, rows, k, prev, hidden, matches)
            logp = torch.log_softmax(logits, dim=-1)
            top_lp, top_i = torch.topk(logp, width, dim=-1)
            top_p, top_i, conf = top_lp.exp().tolist(), self._column_tokens(top_i, extra).tolist(), conf.tolist()
            nxt = []
            for (b, parent, path, left), tp, ti, c in zip(frontier, top_p, top_i, conf):
                tree = trees[b]
                if len(tree) >= opt.max_nodes:
                    continue
                node = tree.add(ti[0], parent, c)
                if left < 0:  # main chain: continue, and branch where the top choices are close
                    nxt.append((b, node, path + (ti[0],), -1))
                    if width > 1 and tp[1] >= opt.branch_ratio * tp[0]:
                        miss = (1.0 - c) / max(1e-6, 1.0 - tp[0])
                        for j in range(1, width):
                            if len(tree) >= opt.max_nodes:
                                break
                            sib = tree.add(ti[j], parent, min(c, miss * tp[j]))
                            if opt.branch_extend > 0:
                                nxt.append((b, sib, path + (ti[j],), opt.branch_extend))
                elif left > 1:
                    nxt.append((b, node, path + (ti[0],), left - 1))
            frontier = nxt
