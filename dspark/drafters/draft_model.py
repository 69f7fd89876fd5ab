"""Classic speculative sampling with a smaller causal LM that shares the target's tokenizer.

The draft model keeps its own batched KV cache holding only real (committed) tokens: each
round it first feeds what the target committed since last time plus the anchor, then drafts
a chain one token per step on scratch slots that it drops again afterwards.
Confidence c_k = the draft model's top probability at step k, a function of the tokens
before k only (never of the drafted token itself), so pruning on it stays lossless.
"""

from __future__ import annotations

import torch

from dspark.drafters.base import DraftRequest, DrafterBase
from dspark.models import TargetModel
from dspark.runner import ModelRunner
from dspark.sampling import probs_from_logits
from dspark.tree import DraftTree


class DraftModelDrafter(DrafterBase):
    name = "draft-model"
    drafts_row_subsets = False  # its KV cache rows follow the engine's active rows

    def __init__(self, draft: TargetModel, target: TargetModel | None = None) -> None:
        if target is not None and draft.tokenizer_hash() != target.tokenizer_hash():
            raise ValueError(
                f"draft model {draft.name!r} does not share the target's tokenizer "
                f"({draft.tokenizer_hash()} != {target.tokenizer_hash()})"
            )
        self.draft = draft
        self.runner = ModelRunner(draft.model)
        self.rows: list[int] = []  # request ids, in draft-cache row order
        self.seen: dict[int, int] = {}  # request id -> tokens in the draft cache

    def start(self, request: DraftRequest, prompt_hidden=None) -> None:
        fresh, _ = self.runner.prefill([request.token_ids[:-1]])
        self.runner.cache.append_rows(fresh)
        self.rows.append(request.request_id)
        self.seen[request.request_id] = len(request.token_ids) - 1

    def finish(self, request: DraftRequest) -> None:
        rid = request.request_id
        if rid in self.seen:
            keep = [i for i, r in enumerate(self.rows) if r != rid]
            self.runner.cache.select_rows(keep)
            self.rows = [self.rows[i] for i in keep]
            del self.seen[rid]
        request.state.clear()

    def _align(self, requests: list[DraftRequest]) -> None:
        order = [self.rows.index(r.request_id) for r in requests]
        if order != list(range(len(self.rows))):
            self.runner.cache.select_rows(order)
            self.rows = [self.rows[i] for i in order]

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        if max_depth <= 0 or not requests:
            return [DraftTree() for _ in requests]
        self._align(requests)
        cache = self.runner.cache
        # catch up on committed tokens + the anchor; logits at each row's last real token
        pending = [r.token_ids[self.seen[r.request_id] :] for r in requests]
        out = self.runner.forward_block([(p, list(range(-1, len(p) - 1))) for p in pending])
        cache.commit([list(range(len(p))) for p in pending])
        for r in requests:
            self.seen[r.request_id] = len(r.token_ids)
        last = torch.tensor([len(p) - 1 for p in pending], device=out.logits.device)
        logits = out.logits[torch.arange(len(requests), device=last.device), last]  # [B, V]
        chains: list[list[int]] = [[] for _ in requests]
        confs: list[list[float]] = [[] for _ in requests]
        for step in range(max_depth):
            for b, req in enumerate(requests):
                row_logits = logits[b, : self.draft.vocab_size]
                if req.sampling.greedy:
                    probs = row_logits.float().softmax(-1)
                    token = int(probs.argmax())
                else:  # drawn with the noise the target draws this token index with
                    probs = probs_from_logits(row_logits, req.sampling)
                    token = req.sampling_noise().draw(probs, len(req.token_ids) + step)
                chains[b].append(token)
                confs[b].append(float(probs.max()))
            if step == max_depth - 1:
                break
            out = self.runner.forward_block([([c[-1]], [-1]) for c in chains])
            cache.commit([[0] for _ in chains])
            logits = out.logits[:, 0]
        cache.drop_last_slots(max_depth - 1)
        return [DraftTree.chain(c, f) for c, f in zip(chains, confs)]
