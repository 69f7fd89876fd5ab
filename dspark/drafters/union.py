"""Several drafters at once: their trees merged into one, verified in one target forward.

Why: drafters fail in different places. The DSpark block drafter sees only the last
`context_len` target positions, so it cannot copy a name or a sentence from far back in a long
prompt (summarisation, code edits); n-gram lookup does exactly that and nothing else. Merged,
the scheduler keeps whichever candidates its confidences favour, per request and per round.

Merging (`merge_trees`): paths with the same tokens become one node whose confidence is the
larger of the two. Verification follows the target's own token at each position, greedy or
sampled (`dspark.verify`), so a second copy of a path could never add anything.

Each sub-drafter keeps its own `DraftRequest` (its own state dict, the same token list and
sampling noise) and learns only from its own nodes: `observe` maps the verified tree back
onto each drafter's proposal by token path.
"""

from __future__ import annotations

import torch

from dspark.drafters.base import DraftRequest, Drafter, DrafterBase, VerifyOutcome
from dspark.tree import DraftTree


def merge_trees(trees: list[DraftTree]) -> DraftTree:
    """One tree holding every token path of `trees`, earlier trees' siblings first; a path
    proposed twice is one node with the larger confidence."""
    out = DraftTree()
    node_of: dict[tuple[int, ...], int] = {}  # token path -> merged node
    for tree in trees:
        new_index: list[int] = []
        for tok, parent, conf, path in zip(tree.tokens, tree.parents, tree.confidence, _paths(tree)):
            if path in node_of:
                i = node_of[path]
                out.confidence[i] = max(out.confidence[i], conf)
            else:
                i = out.add(tok, new_index[parent] if parent >= 0 else -1, conf)
                node_of[path] = i
            new_index.append(i)
    return out


def _paths(tree: DraftTree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for tok, parent in zip(tree.tokens, tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    return paths


def outcome_for(proposed: DraftTree, outcome: VerifyOutcome, hidden: list[torch.Tensor] | None) -> VerifyOutcome:
    """The round's outcome as one sub-drafter would have seen it: its own nodes that were
    verified (the scheduler's cut, found by token path) and the accepted ones among them."""
    vpaths = _paths(outcome.tree)
    verified = set(vpaths)
    accepted_path = vpaths[outcome.accepted_nodes[-1]] if outcome.accepted_nodes else ()
    keep = [i for i, p in enumerate(_paths(proposed)) if p in verified]  # ancestor-closed, as the verified tree is
    sub = proposed.subset(keep)
    node_of = {p: i for i, p in reversed(list(enumerate(_paths(sub))))}  # first node per path
    accepted: list[int] = []
    for depth in range(1, len(accepted_path) + 1):
        if accepted_path[:depth] not in node_of:
            break
        accepted.append(node_of[accepted_path[:depth]])
    return VerifyOutcome(outcome.request_id, sub, accepted, outcome.next_token, hidden)


class UnionDrafter(DrafterBase):
    """Runs every sub-drafter each round and verifies the union of their proposals."""

    def __init__(self, drafters: list[Drafter]) -> None:
        if len(drafters) < 2:
            raise ValueError("a union needs at least two drafters")
        self.drafters = list(drafters)
        self.name = "+".join(d.name for d in self.drafters)
        # the engine returns hidden states for the union of the layers, in this order
        self.target_layers = tuple(sorted({layer for d in self.drafters for layer in d.target_layers}))
        self._slots = [[self.target_layers.index(layer) for layer in d.target_layers] for d in self.drafters]
        self.drafts_row_subsets = all(getattr(d, "drafts_row_subsets", True) for d in self.drafters)

    def _hidden_for(self, j: int, hidden: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        if hidden is None or not self._slots[j]:
            return None
        return [hidden[s] for s in self._slots[j]]

    def start(self, request: DraftRequest, prompt_hidden: list[torch.Tensor] | None) -> None:
        # same token list object: the engine extends it in place after every round
        subs = [DraftRequest(request.request_id, request.token_ids, request.sampling, noise=request.noise) for _ in self.drafters]
        request.state["union"] = subs
        for j, (drafter, sub) in enumerate(zip(self.drafters, subs)):
            drafter.start(sub, self._hidden_for(j, prompt_hidden))

    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        subs = [r.state["union"] for r in requests]
        per_drafter = [d.propose([s[j] for s in subs], max_depth) for j, d in enumerate(self.drafters)]
        merged = []
        for b, r in enumerate(requests):
            own = [trees[b] for trees in per_drafter]
            r.state["proposed"] = own
            merged.append(merge_trees(own))
        return merged

    def observe(self, request: DraftRequest, outcome: VerifyOutcome) -> None:
        proposed = request.state.pop("proposed", None) or [DraftTree() for _ in self.drafters]
        for j, (drafter, sub) in enumerate(zip(self.drafters, request.state["union"])):
            drafter.observe(sub, outcome_for(proposed[j], outcome, self._hidden_for(j, outcome.hidden)))

    def finish(self, request: DraftRequest) -> None:
        for drafter, sub in zip(self.drafters, request.state.get("union", [])):
            drafter.finish(sub)
        request.state.clear()
