"""Model-free drafting by n-gram lookup in the request's own prompt and output.

The last n tokens (n = max_ngram down to min_ngram, default 4 down to 1) are looked up among
earlier positions; what followed them there is proposed. Single-token matches draft often and
are right less often; their acceptance is tracked separately (per match length), so the
scheduler verifies them only when they pay. Several matches with different continuations become
a token tree (up to `num_candidates` paths), siblings ordered by how often they followed.

Confidence of a node = (share of matches that continue through it, among those through its
parent) x (online acceptance rate of n-gram drafts at that depth and match length). The
second factor is learned from this drafter's own verification outcomes (a depth not yet
verified borrows the rate of the depth above; depth 1 counts as certain until it has been
tried a few times), so the `dspark` and `threshold` schedulers get calibrated numbers without
any training. Proposals are deterministic given the context, so their q is None (a point mass).
"""

from __future__ import annotations

from collections import defaultdict

from dspark.drafters.base import DraftRequest, DrafterBase, VerifyOutcome
from dspark.tree import DraftTree


class NgramDrafter(DrafterBase):
    name = "ngram"

    def __init__(
        self,
        max_ngram: int = 4,
        min_ngram: int = 1,
        num_candidates: int = 3,
        max_matches: int = 16,
        prior: tuple[float, float] = (1.0, 1.0),
        prior_weight: float = 2.0,
        burn_in: int = 4,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_candidates = max(1, num_candidates)
        self.max_matches = max_matches
        self.prior = prior
        self.prior_weight = prior_weight
        self.burn_in = burn_in
        # (match length n, depth k) -> [accepted, attempted]; shared across requests
        self.depth_stats: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])

    # --- per-request index ---------------------------------------------------------------
    def start(self, request: DraftRequest, prompt_hidden=None) -> None:
        request.state["index"] = {n: defaultdict(list) for n in range(self.min_ngram, self.max_ngram + 1)}
        request.state["indexed"] = 0
        self._extend_index(request)

    def _extend_index(self, request: DraftRequest) -> None:
        """Record, for every position i with a continuation, the n-grams ending just before i."""
        tokens = request.token_ids
        index = request.state["index"]
        # position i is indexable once tokens[i] exists and is not the anchor's own lookup key
        for i in range(max(request.state["indexed"], 1), len(tokens)):
            for n in index:
                if i >= n:
                    index[n][tuple(tokens[i - n : i])].append(i)
        request.state["indexed"] = max(request.state["indexed"], len(tokens))

    def _acceptance(self, n: int, depth: int) -> float:
        """Estimated conditional acceptance of a depth-`depth` draft token after an n-token match.

        Until depth 1 has `burn_in` outcomes for this match length it is reported as certain,
        so every scheduler tries it (a threshold scheduler would otherwise never verify, and
        never learn). Past that, each depth's posterior mean is shrunk towards the depth above
        it (`prior_weight` pseudo counts): a depth with no data yet inherits its parent's rate,
        not an optimistic guess, which would have the `dspark` scheduler verify long blocks for
        whole batches on no evidence."""
        if depth == 1 and self.depth_stats[(n, 1)][1] < self.burn_in:
            return 1.0
        a, b = self.prior
        mean = a / (a + b)
        for k in range(1, depth + 1):
            acc, att = self.depth_stats[(n, k)]
            mean = (acc + self.prior_weight * mean) / (att + self.prior_weight)
        return mean

    # --- drafting --------------------------------------------------------------------------
    def _continuations(self, request: DraftRequest, max_depth: int) -> tuple[int, list[list[int]]]:
        """(match length, continuations most recent first) for the longest n-gram that matches."""
        tokens = request.token_ids
        index = request.state["index"]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < n:
                continue
            positions = index[n].get(tuple(tokens[-n:]), [])
            # the newest entry may be the tail itself (no continuation yet): skip i == len(tokens)
            conts = [tokens[i : i + max_depth] for i in reversed(positions[-self.max_matches :]) if i < len(tokens)]
            conts = [c for c in conts if c]
            if conts:
                return n, conts
        return 0, []

    def propose(self, requests: list[DraftRequest], max_depth: int) -> list[DraftTree]:
        trees = []
        for req in requests:
            self._extend_index(req)
            n, conts = self._continuations(req, max_depth) if max_depth > 0 else (0, [])
            req.state["match_len"] = n
            trees.append(self._build_tree(conts, n))
        return trees

    def _build_tree(self, continuations: list[list[int]], n: int) -> DraftTree:
        # count matches through each prefix, and keep the first `num_candidates` distinct paths
        counts: dict[tuple[int, ...], int] = defaultdict(int)
        distinct: list[list[int]] = []
        for cont in continuations:
            for d in range(1, len(cont) + 1):
                counts[tuple(cont[:d])] += 1
            if len(distinct) < self.num_candidates and not any(c[: len(cont)] == cont for c in distinct):
                distinct = [c for c in distinct if cont[: len(c)] != c]  # a longer path replaces its own prefix
                distinct.append(cont)
        total = len(continuations)
        tree = DraftTree()
        node_of: dict[tuple[int, ...], int] = {}
        # insert nodes breadth-first so siblings are adjacent, most frequent first
        prefixes = sorted({tuple(c[:d]) for c in distinct for d in range(1, len(c) + 1)}, key=lambda p: (len(p), -counts[p]))
        for prefix in prefixes:
            parent = node_of.get(prefix[:-1], -1)
            parent_count = counts[prefix[:-1]] if len(prefix) > 1 else total
            share = counts[prefix] / parent_count
            node_of[prefix] = tree.add(prefix[-1], parent, share * self._acceptance(n, len(prefix)))
        return tree

    def observe(self, request: DraftRequest, outcome: VerifyOutcome) -> None:
        tree, n = outcome.tree, request.state.get("match_len", 0)
        if len(tree) and n:
            children = tree.children()
            node = -1
            depth = 1
            path = outcome.accepted_nodes
            while children[node + 1]:
                stat = self.depth_stats[(n, depth)]
                stat[1] += 1
                if depth <= len(path):
                    stat[0] += 1
                    node = path[depth - 1]
                    depth += 1
                else:
                    break
        self._extend_index(request)
