"""The DSpark drafter as an engine plug-in (`dspark.drafters.base.Drafter` protocol).

Per request, `request.state["ctx"]` holds H_ctx [<=N, d]: the projected target states of the
last N committed tokens (token_ids[:-1]; the anchor token_ids[-1] is not in the target cache
yet). `start` fills it from the prompt's states; `observe` appends the states of the tokens
committed in the round.

`propose` runs ONE batched backbone forward for all requests, then walks the Markov head left
to right:
- greedy requests: the argmax chain (q = None). Where the Markov head's top choices are close
  (p_2 >= branch_ratio * p_1) it adds the next `branch_width - 1` candidates as deterministic
  siblings (q = None), each optionally continued greedily for `branch_extend` more tokens;
- sampling requests: a chain sampled from the Markov-biased distribution after the request's
  SamplingParams, that distribution stored in q.
Confidence c_k = sigmoid((w · [h_k ; W1[x_{k-1}]] + b) / T_k) uses the parent's token only. A
sibling candidate j (j >= 2) gets (1 - c_k) · p_j / (1 - p_1): the miss mass shared in
proportion to the drafter's own probabilities (a function of the ancestors only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.drafters.base import DraftRequest, DrafterBase, VerifyOutcome
from dspark.dspark_drafter.model import DSparkModel
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
        seed: int = 0,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.cfg = model.cfg
        self.target_layers = tuple(self.cfg.target_layers)
        t = temperatures or [1.0] * self.cfg.gamma
        self.temperatures = torch.tensor(list(t) + [1.0] * (self.cfg.gamma - len(t)), dtype=torch.float32)
        self.options = options or DrafterOptions()
        self.eos = set(eos_token_ids or [])
        self.device = model.embed_weight.device
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    # ------------------------------------------------------------- request lifecycle

    def _append_context(self, request: DraftRequest, hidden: list[torch.Tensor] | None) -> None:
        if not hidden or hidden[0].shape[0] == 0:
            return
        feats = torch.cat([h.to(self.device) for h in hidden], dim=-1)  # [n, m*d_t]
        n = self.cfg.context_len
        with torch.no_grad():
            new = self.model.project_context(feats[-n:])  # [<=N, d]
        old = request.state.get("ctx")
        ctx = new if old is None else torch.cat([old, new], dim=0)
        request.state["ctx"] = ctx[-n:]

    def start(self, request: DraftRequest, prompt_hidden: list[torch.Tensor] | None) -> None:
        request.state.pop("ctx", None)  # the engine keeps its own keys here (e.g. "generator")
        self._append_context(request, prompt_hidden)

    def observe(self, request: DraftRequest, outcome: VerifyOutcome) -> None:
        self._append_context(request, outcome.hidden)

    def finish(self, request: DraftRequest) -> None:
        request.state.clear()

    # ------------------------------------------------------------- drafting

    def _batch_context(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-aligned context [B, N, d] and its validity [B, N]."""
        n, d = self.cfg.context_len, self.cfg.hidden_size
        dtype = self.model.mask_embed.dtype
        ctx = torch.zeros(len(requests), n, d, dtype=dtype, device=self.device)
        valid = torch.zeros(len(requests), n, dtype=torch.bool, device=self.device)
        for b, r in enumerate(requests):
            c = r.state.get("ctx")
            if c is not None and c.shape[0]:
                ctx[b, n - c.shape[0] :] = c
                valid[b, n - c.shape[0] :] = True
        return ctx, valid

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        depth = min(int(max_depth), self.cfg.gamma)
        if depth <= 0 or not requests:
            return [DraftTree() for _ in requests]
        ctx, valid = self._batch_context(requests)
        anchors = torch.tensor([r.token_ids[-1] for r in requests], dtype=torch.long, device=self.device)
        out = self.model.forward_block(ctx, valid, anchors, depth)
        return [self._tree(r, out.base_logits[b, :depth], out.conf_h[b, :depth], depth) for b, r in enumerate(requests)]

    def _step(self, base_logits: torch.Tensor, conf_h: torch.Tensor, k: int, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Markov step for parents `prev` [n] at depth k (0-based) -> logits [n, V], confidences [n]."""
        feat = self.model.markov_features(prev)
        logits = base_logits[k][None, :] + self.model.markov_bias(feat)
        z = self.model.conf_logit(conf_h[k].expand(prev.shape[0]), feat)
        return logits, torch.sigmoid(z / float(self.temperatures[k]))

    def _tree(self, request: DraftRequest, base_logits: torch.Tensor, conf_h: torch.Tensor, depth: int) -> DraftTree:
        if request.sampling.greedy:
            return self._greedy_tree(request, base_logits, conf_h, depth)
        return self._sampled_chain(request, base_logits, conf_h, depth)

    def _sampled_chain(self, request: DraftRequest, base_logits: torch.Tensor, conf_h: torch.Tensor, depth: int) -> DraftTree:
        tree = DraftTree()
        prev, parent = request.token_ids[-1], -1
        for k in range(depth):
            logits, c = self._step(base_logits, conf_h, k, torch.tensor([prev], device=self.device))
            q = probs_from_logits(logits[0], request.sampling).cpu()
            gen = request.state.get("generator") or self.generator  # per-request stream when the engine has one
            tok = int(torch.multinomial(q, 1, generator=gen))
            parent = tree.add(tok, parent, float(c[0]), q)
            prev = tok
            if self.options.stop_at_eos and tok in self.eos:
                break
        return tree

    def _greedy_tree(self, request: DraftRequest, base_logits: torch.Tensor, conf_h: torch.Tensor, depth: int) -> DraftTree:
        opt = self.options
        tree = DraftTree()
        prev, parent = request.token_ids[-1], -1
        width = max(1, opt.branch_width)
        for k in range(depth):
            if len(tree) >= opt.max_nodes:
                break
            logits, c = self._step(base_logits, conf_h, k, torch.tensor([prev], device=self.device))
            probs = torch.softmax(logits[0], dim=-1)
            top_p, top_i = torch.topk(probs, width)
            c_k = float(c[0])
            main = tree.add(int(top_i[0]), parent, c_k)
            if width > 1 and float(top_p[1]) >= opt.branch_ratio * float(top_p[0]):
                miss = (1.0 - c_k) / max(1e-6, 1.0 - float(top_p[0]))
                for j in range(1, width):
                    if len(tree) >= opt.max_nodes:
                        break
                    sib = tree.add(int(top_i[j]), parent, min(c_k, miss * float(top_p[j])))
                    self._extend(tree, sib, int(top_i[j]), base_logits, conf_h, k + 1, min(depth, k + 1 + opt.branch_extend))
            if opt.stop_at_eos and int(top_i[0]) in self.eos:
                break
            prev, parent = int(top_i[0]), main
        return tree

    def _extend(self, tree: DraftTree, node: int, token: int, base_logits, conf_h, k0: int, k1: int) -> None:
        """Greedy continuation below `node` for depths k0..k1-1 (0-based)."""
        parent, prev = node, token
        for k in range(k0, k1):
            if len(tree) >= self.options.max_nodes or (self.options.stop_at_eos and prev in self.eos):
                return
            logits, c = self._step(base_logits, conf_h, k, torch.tensor([prev], device=self.device))
            tok = int(logits[0].argmax())
            parent = tree.add(tok, parent, float(c[0]))
            prev = tok
