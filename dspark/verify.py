"""Lossless verification of one request's draft tree against the target's distributions.

Pure functions, no model: given the target's next-token distribution at the anchor and at
every draft node, walk the tree from the anchor.

- Greedy: follow the child whose token is the target's argmax; the first miss yields the
  target's own token (a correction), a leaf yields a bonus token.
- Sampling (multi-candidate rejection sampling): at each accepted node, try its children in
  order; child x drawn from q is accepted with probability min(1, p(x) / q(x)); on rejection
  the target distribution becomes the residual norm(max(0, p - q)) and the next sibling is
  tried against it. With no child left, sample the residual. A deterministic child (q = None)
  is a point mass, so its residual simply removes x from p. Each step is an exact
  speculative-sampling step of the current residual, so every emitted token follows the
  target distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.tree import DraftTree


@dataclass
class Verdict:
    accepted_nodes: list[int]  # node indices along the accepted path
    next_token: int  # the correction (after a rejection) or bonus token (after a leaf)


def verify_greedy(tree: DraftTree, target_argmax: list[int]) -> Verdict:
    """`target_argmax[j]`: target's argmax at block position j (0 = anchor, k+1 = node k)."""
    children = tree.children()
    accepted: list[int] = []
    block_pos = 0
    while True:
        want = target_argmax[block_pos]
        match = next((k for k in children[block_pos] if tree.tokens[k] == want), None)
        if match is None:
            return Verdict(accepted, want)
        accepted.append(match)
        block_pos = match + 1


def _residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    # p == q exactly leaves nothing; the rejection then had probability 0, keep p.
    return r / total if total > 0 else p


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """`target_probs`: [N+1, V] float32 target distributions at block positions (0 = anchor).

    Runs on the CPU whatever the model's device: each request's generator is a CPU one, so a
    seed gives the same tokens on every device (and the walk is scalar work anyway)."""
    target_probs = target_probs.cpu()
    children = tree.children()
    accepted: list[int] = []
    block_pos = 0
    p = target_probs[0]
    while True:
        next_p = None
        for k in children[block_pos]:
            x = tree.tokens[k]
            q = None if tree.q[k] is None else tree.q[k].cpu()
            q_x = 1.0 if q is None else float(q[x])
            p_x = float(p[x])
            u = float(torch.rand((), generator=generator))
            if q_x > 0 and u < min(1.0, p_x / q_x):
                accepted.append(k)
                block_pos = k + 1
                next_p = target_probs[block_pos]
                break
            p = _residual(p, q, x)
        if next_p is None:
            token = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(accepted, token)
        p = next_p
