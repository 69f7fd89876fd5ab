"""How far a better copy decision could take tau: the drafter's options along the target's path.

At each Markov step the copy rule (`dspark_drafter/copy_prior.py`) picks between the drafter's
top-1 and the n-gram followers it looks up. Along the target's own path (teacher forced: step
k follows the target's tokens before it, which is the drafted path for as long as a round keeps
accepting) each step's options can be checked against the target's token. A chain accepts
step k when what it proposes there is the target's token, so tau per round with

- `rule`: the rule's own choice. This is the drafter's tau (the free-running chain follows the
  target's path up to its first rejection), a check on the walk below;
- `top1`: the drafter's top-1 only: the network without copying;
- `top1_or_candidate`: the target's token whenever it is the top-1 or one of the rule's
  candidates: a perfect decision over the same options;
- `top1_or_follower`: ... or any token that followed an earlier occurrence of the path's last
  o - 1 tokens (every order of the rule; the first `MAX_DISTINCT` distinct followers an
  n-gram had): a perfect rule over every earlier continuation, not just the latest.

At every anchor a perfect decision accepts at least as many tokens as any decision between
the same options; walked round by round the anchors visited differ, so its tau is the most a
better decision can give up to where the rounds happen to start. Where a domain's
`top1_or_candidate` tau is below a goal, the network's own proposals (or the candidates) must
get better.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.dspark_drafter.copy_prior import CopyRule
from dspark.dspark_drafter.model import DSparkModel
from dspark.training.cache import CacheReader
from dspark.training.trainer import _blocks, _eval_items, _lookups, along_target_path, copy_step, decoded_tau, group_by_row

BOUNDS = ("rule", "top1", "top1_or_candidate", "top1_or_follower")


@dataclass
class CopyBounds:
    rows: np.ndarray  # [n] the cache row of each block (every anchor of every row: stride 1)
    anchors: np.ndarray  # [n]
    domains: list[str]  # [n]
    steps: dict[str, np.ndarray]  # BOUNDS name -> [n, G] bool: that step proposes the target's token

    def tau_by_domain(self) -> dict[str, dict[str, float]]:
        """BOUNDS name -> domain (and "all") -> tau per round as greedy decoding walks the answers."""
        doms = np.array(self.domains)
        masks = {d: doms == d for d in sorted(set(self.domains))} | {"all": np.ones(len(doms), bool)}
        return {
            name: {d: decoded_tau(acc[m].astype(np.float64), self.rows[m], self.anchors[m]) for d, m in masks.items()}
            for name, acc in self.steps.items()
        }


@torch.no_grad()
def copy_bounds(
    model: DSparkModel,
    reader: CacheReader,
    rows: list[int],
    rule: CopyRule,
    draft_vocab: torch.Tensor | None = None,
    batch_size: int = 64,
) -> CopyBounds:
    """Every full block of `rows` (stride 1), stepped along the target's greedy tokens: which of
    `BOUNDS` would have proposed the target's token at each step (module docstring). Shows a
    progress bar on a terminal."""
    from tqdm.auto import tqdm

    g = model.cfg.gamma
    items = _eval_items(reader, rows, g, 1, None)
    was_training = model.training
    model.eval()
    parts: dict[str, list[np.ndarray]] = {name: [] for name in BOUNDS}
    where: list[tuple[int, int]] = []  # (row, anchor) in Batch order
    bar = tqdm(total=len(items), desc="copy bounds", unit="block", disable=None, mininterval=5)
    for pool, chunk, batch, fwd, full, masked, target in _blocks(model, reader, items, batch_size, False, draft_vocab):
        truth = target.argmax(-1)  # [B, G]
        lookups = _lookups(pool, chunk, rule.orders)
        step = {name: np.zeros(tuple(truth.shape), dtype=bool) for name in BOUNDS}
        for s in along_target_path(model, masked, fwd.conf_h, batch.tokens[:, 0], rule, lookups, truth):
            k = s.k
            choice = copy_step(rule, s.logits, full[:, k] + s.bias, s.copies, s.z, k).argmax(-1)  # as `free_running` drafts
            want = truth[:, k]
            step["rule"][:, k] = (choice == want).numpy()
            step["top1"][:, k] = (s.logits.argmax(-1) == want).numpy()
            for b, (t, cands) in enumerate(zip(want.tolist(), s.copies)):
                in_cands = t in cands
                step["top1_or_candidate"][b, k] = step["top1"][b, k] or in_cands
                step["top1_or_follower"][b, k] = (
                    step["top1"][b, k] or in_cands or t in lookups[b][0].followers(s.suffixes[b], rule.orders, fresh=k)
                )
        for name in BOUNDS:
            parts[name].append(step[name])
        where += [(r, a) for r, anchors in group_by_row(chunk) for a in anchors]
        bar.update(len(chunk))
    bar.close()
    model.train(was_training)
    return CopyBounds(
        rows=np.array([r for r, _ in where], dtype=np.int64),
        anchors=np.array([a for _, a in where], dtype=np.int64),
        domains=[reader.rows[r].domain for r, _ in where],
        steps={name: np.concatenate(p) if p else np.zeros((0, g), bool) for name, p in parts.items()},
    )
