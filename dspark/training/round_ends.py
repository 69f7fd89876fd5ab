"""Where greedy rounds end: what the drafter would have needed to propose to go on.

Decoding with a gamma-token chain crosses each answer in rounds (`walk_rounds`); a round ends
at the first drafted position whose token differs from the target's. Two facts about that
target token say which lever could have saved the round:

- outside the draft vocabulary: the drafter could not propose it at all (a bigger vocabulary,
  or a copy from the context, could);
- seen earlier in the sequence (prompt, answer so far, or earlier in the block): a copy
  mechanism could have proposed it. The copy prior proposes only the follower of the latest
  n-gram match, so "seen" is an upper bound on what copying can add, not a forecast.

Both are computed offline from an `EvalResult` of the eval split (every anchor present).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.training.trainer import EvalResult, walk_rounds


@dataclass
class RoundEnds:
    rounds: int  # rounds that greedy decoding with the chain takes over the answers
    whole_block: float  # share of rounds that accepted every drafted token
    ended_at: list[float]  # [G] share of the other rounds that ended at draft position k = 1..G
    outside_vocab: float  # share of the ended rounds whose target token the drafter could not propose
    outside_vocab_seen: float  # ... and which occurs earlier in the sequence
    seen: float  # share of the ended rounds whose target token occurs earlier in the sequence


def round_ends(res: EvalResult, draft_vocab: np.ndarray | None, mask: np.ndarray | None = None) -> RoundEnds:
    """Rounds as decoding visits them (`EvalResult.decoded_tau`'s walk), classified at the
    position each ended. `draft_vocab`: the token ids the drafter proposes from (None: all)."""
    if res.rows is None or res.anchors is None or res.targets is None or res.seen is None:
        raise ValueError("round_ends needs an EvalResult with rows, anchors, targets and seen (trainer.evaluate)")
    keep = np.ones(len(res.accepted), bool) if mask is None else np.asarray(mask, bool)
    accepted, targets, seen = res.accepted[keep], res.targets[keep], res.seen[keep]
    g = accepted.shape[1]
    gained = 1 + np.cumprod(accepted, axis=1).sum(1).astype(np.int64)
    visited = walk_rounds(res.rows[keep], res.anchors[keep], gained)
    ended = visited[gained[visited] <= g]  # a round with k < G accepted ended at position k + 1
    k = gained[ended] - 1
    tok, was_seen = targets[ended, k], seen[ended, k]
    outside = np.zeros(len(ended), bool) if draft_vocab is None else ~np.isin(tok, draft_vocab)
    n = max(len(ended), 1)
    return RoundEnds(
        rounds=len(visited),
        whole_block=1.0 - len(ended) / max(len(visited), 1),
        ended_at=(np.bincount(k, minlength=g)[:g] / n).tolist(),
        outside_vocab=float(outside.sum() / n),
        outside_vocab_seen=float((outside & was_seen).sum() / n),
        seen=float(was_seen.sum() / n),
    )


def round_ends_by_domain(res: EvalResult, draft_vocab: np.ndarray | None) -> dict[str, RoundEnds]:
    doms = np.array(res.domains)
    out = {d: round_ends(res, draft_vocab, doms == d) for d in sorted(set(res.domains))}
    out["all"] = round_ends(res, draft_vocab)
    return out
