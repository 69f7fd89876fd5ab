"""Lossless verification of one request's draft tree: a pure function, no model.

The target decides every token: at each block position it picks its token (the argmax for a
greedy row, the draw of the row's noise for a sampled one, `dspark.sampling`), and the walk
from the anchor follows the child that carries that token. The first position with no such
child yields the target's own token (a correction); a leaf yields a bonus token. Every
emitted token is therefore the token plain decoding would have produced: drafts only decide
how many of them one forward pass confirms.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark.tree import DraftTree


@dataclass
class Verdict:
    accepted_nodes: list[int]  # node indices along the accepted path
    next_token: int  # the correction (after a rejection) or bonus token (after a leaf)


def verify_tree(tree: DraftTree, target_tokens: list[int]) -> Verdict:
    """`target_tokens[j]`: the target's token at block position j (0 = anchor, k+1 = node k)."""
    children = tree.children()
    accepted: list[int] = []
    block_pos = 0
    while True:
        want = target_tokens[block_pos]
        match = next((k for k in children[block_pos] if tree.tokens[k] == want), None)
        if match is None:
            return Verdict(accepted, want)
        accepted.append(match)
        block_pos = match + 1
