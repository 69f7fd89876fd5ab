"""Draft trees: the one data structure every drafter returns and every scheduler prunes.

A chain is the special case where each node's parent is the node before it.

Invariants (checked by `DraftTree.validate`):
- nodes are in topological order: parents[i] < i; -1 means "child of the anchor";
- siblings appear in priority order (verification tries them left to right);
- confidence[i] is c_i = P(node i is accepted | its parent was accepted), an estimate the
  scheduler prunes by. Outputs never depend on it: verification follows the target's own
  tokens (`dspark.verify`), so pruning only changes how many tokens a round confirms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # [N]
    parents: list[int] = field(default_factory=list)  # [N], -1 = anchor
    confidence: list[float] = field(default_factory=list)  # [N], c_i in [0, 1]

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def chain(tokens: list[int], confidence: list[float]) -> "DraftTree":
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), list(confidence))

    def add(self, token: int, parent: int, confidence: float) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.confidence.append(float(confidence))
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        """Depth of each node: children of the anchor have depth 1."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def max_depth(self) -> int:
        return max(self.depths(), default=0)

    def survival(self) -> list[float]:
        """a_i = product of c along the path from the anchor to node i (prefix survival)."""
        a: list[float] = []
        for c, p in zip(self.confidence, self.parents):
            a.append(c if p < 0 else a[p] * c)
        return a

    def children(self) -> list[list[int]]:
        """children[i+1] lists the children of node i; children[0] those of the anchor."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return kids

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def subset(self, keep: list[int]) -> "DraftTree":
        """The sub-tree of the nodes in `keep` (must be ancestor-closed), order preserved."""
        keep = sorted(keep)
        new_index = {old: new for new, old in enumerate(keep)}
        out = DraftTree()
        for old in keep:
            p = self.parents[old]
            if p >= 0 and p not in new_index:
                raise ValueError("subset is not ancestor-closed")
            out.add(self.tokens[old], new_index[p] if p >= 0 else -1, self.confidence[old])
        return out

    def validate(self, vocab_size: int | None = None) -> None:
        n = len(self.tokens)
        if not (len(self.parents) == len(self.confidence) == n):
            raise ValueError("draft tree fields have different lengths")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: nodes must be in topological order")
        for c in self.confidence:
            if not 0.0 <= c <= 1.0:
                raise ValueError(f"confidence {c} outside [0, 1]")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.tokens):
            raise ValueError("draft token outside the vocabulary")


def top_survival_nodes(tree: DraftTree, budget: int) -> list[int]:
    """The `budget` nodes with the highest prefix survival, ties to the earlier node.

    Because a_i never exceeds its parent's a (c <= 1) and parents come first, the result is
    ancestor-closed: a valid sub-tree to verify.
    """
    if budget <= 0:
        return []
    a = tree.survival()
    order = sorted(range(len(a)), key=lambda i: (-a[i], i))
    return sorted(order[:budget])


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] bool: entry (i, j) is True when block position j is position i or one of its
    ancestors. Block position 0 is the anchor; node k sits at block position k+1."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[0, 0] = True
    for k, p in enumerate(parents):
        row = k + 1
        mask[row] = mask[p + 1]
        mask[row, row] = True
    return mask
