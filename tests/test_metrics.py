"""Speculation metrics count what the request kept (dspark/metrics.py, docs/metrics.md).

The invariants are checked three ways: on hand-made rounds, on random trees, budgets and
end positions against a recount from the output's side, and on the engine, recounting every
request's statistics from the trees it really verified.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.drafters.base import DrafterBase
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.generator import DSparkGenerator
from dspark.metrics import RequestStats, aggregate, round_counts, speculation_rates
from tests.test_lossless_greedy import ragged_prompts


def test_a_round_that_keeps_everything():
    c = round_counts([-1, 0, 1], accepted_nodes=[0, 1], kept=3)  # chain of 3, 2 accepted, then a correction
    assert (c.verified, c.accepted, c.emitted, c.attempted_depths) == (3, 2, 3, (1, 2, 3))


def test_no_attempt_below_a_leaf_of_the_accepted_path():
    """Node 0 (depth 1) is accepted and has no child; node 2 (depth 2) hangs under the
    rejected sibling 1. Depth 2 was never attempted on the accepted path."""
    c = round_counts([-1, -1, 1], accepted_nodes=[0], kept=2)
    assert c.attempted_depths == (1,) and (c.verified, c.accepted) == (3, 1)
    s = RequestStats()
    s.record_round(3, c, [0.9, 0.5, 0.5])
    assert s.conditional_acceptance == [1.0]


def test_tokens_past_the_end_count_for_nothing():
    """A chain of 4 all accepted, but the request ended after 2 of the round's 5 tokens: the
    2 kept are accepted drafts; depths 3-4 were verified for nothing."""
    c = round_counts([-1, 0, 1, 2], accepted_nodes=[0, 1, 2, 3], kept=2)
    assert (c.verified, c.accepted, c.emitted, c.attempted_depths, c.counted_nodes) == (2, 2, 2, (1, 2), (0, 1))


def test_request_statistics_and_their_ratios():
    s = RequestStats()
    s.record_prefill()
    s.record_round(4, round_counts([-1, 0, 1], [0, 1], kept=3), [0.9, 0.8, 0.5])
    s.record_round(4, round_counts([-1, 0], [], kept=1), [0.4, 0.3])
    assert (s.verified, s.accepted, s.rejected, s.rounds, s.emitted) == (5, 2, 3, 2, 5)
    assert s.mean_accepted_length == 5 / 3  # 5 tokens from 3 target forwards (prefill + 2 rounds)
    assert s.acceptance_rate == 2 / 5 and s.correction_rate == 3 / 5
    assert s.position_attempts == [2, 1, 1] and s.position_accepts == [1, 1, 0]
    total = aggregate([s, s])
    assert total.verified == 10 and total.conditional_acceptance == [0.5, 1.0, 0.0]
    assert total.mean_accepted_length == s.mean_accepted_length
    assert 0 < s.confidence_entropy < 1
    rates = speculation_rates(verified=5, accepted=2, rounds=2, emitted=5, prefills=1)
    assert rates["mean_accepted_length"] == s.mean_accepted_length and rates["correction_rate"] == s.correction_rate


@st.composite
def verified_rounds(draw):
    """A random verified tree, an accepted path walked down it, and where the request ended."""
    n = draw(st.integers(0, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    path, node = [], -1
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if not kids or not draw(st.booleans()):
            break
        node = draw(st.sampled_from(kids))
        path.append(node)
    kept = draw(st.integers(1, len(path) + 1))
    return parents, path, kept


def recount(parents: list[int], path: list[int], kept: int) -> tuple[int, int, list[int], list[int]]:
    """From the output's side: the round produced len(path) + 1 tokens and the request kept
    the first `kept`. The token at offset d (1-based) was contested by the children of the
    path node before it; it was a draft when d <= len(path)."""
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    ended_on_draft = kept <= len(path)
    verified = sum(1 for d in depth if not ended_on_draft or d <= kept)
    attempts, accepts = [], []
    for d in range(1, kept + 1):
        before = path[d - 2] if d >= 2 else -1
        if any(p == before for p in parents):
            attempts.append(d)
            if d <= len(path):
                accepts.append(d)
    return verified, min(kept, len(path)), attempts, accepts


@settings(max_examples=400, deadline=None)
@given(verified_rounds())
def test_round_counts_match_a_recount_from_the_output(case):
    parents, path, kept = case
    c = round_counts(parents, path, kept)
    verified, accepted, attempts, accepts = recount(parents, path, kept)
    assert (c.verified, c.accepted, c.emitted) == (verified, accepted, kept)
    assert list(c.attempted_depths) == attempts
    s = RequestStats()
    s.record_round(len(parents), c, [0.5] * len(parents))
    assert sum(s.position_accepts) == s.accepted == len(accepts)
    assert all(a <= n for a, n in zip(s.position_accepts, s.position_attempts))
    assert s.accepted <= s.verified and len(s.confidences) == s.verified


class Recording(DrafterBase):
    """Wraps a drafter and keeps, per request, every tree the target verified and its verdict."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.target_layers = inner.target_layers
        self.drafts_row_subsets = getattr(inner, "drafts_row_subsets", True)
        self.rounds: dict[int, list] = {}

    def start(self, request, prompt_hidden):
        self.rounds[request.request_id] = []
        self.inner.start(request, prompt_hidden)

    def propose(self, requests, max_depth):
        return self.inner.propose(requests, max_depth)

    def observe(self, request, outcome):
        tree = outcome.tree
        self.rounds[request.request_id].append((list(tree.parents), [tree.tokens[k] for k in outcome.accepted_nodes], list(outcome.accepted_nodes), outcome.next_token))
        self.inner.observe(request, outcome)

    def finish(self, request):
        self.inner.finish(request)


def recount_request(result, rounds) -> RequestStats:
    """A request's statistics rebuilt from its verified rounds and its final output."""
    out = result.token_ids
    assert len(out) >= 1
    s = RequestStats()
    s.record_prefill()
    produced = 1
    for parents, tokens, accepted_nodes, next_token in rounds:
        round_tokens = tokens + [next_token]
        kept = min(len(round_tokens), len(out) - produced)
        assert out[produced : produced + kept] == round_tokens[:kept], "the output is what the rounds verified"
        verified, accepted, attempts, accepts = recount(parents, accepted_nodes, kept)
        s.rounds += 1
        s.verified += verified
        s.accepted += accepted
        s.emitted += kept
        for d in attempts:
            while len(s.position_attempts) < d:
                s.position_attempts.append(0)
                s.position_accepts.append(0)
            s.position_attempts[d - 1] += 1
            s.position_accepts[d - 1] += d in accepts
        produced += kept
    assert produced == len(out)
    return s


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 16])
@pytest.mark.parametrize("drafter_kind", ["ngram", "self"])
def test_engine_statistics_match_a_recount_of_the_verified_trees(tiny_llama, drafter_kind, max_new_tokens):
    """Ends inside a round (max_new_tokens, EOS, stop strings) must not count thrown-away
    tokens; the target drafting for itself accepts everything, so tau is exactly
    output tokens / target forwards."""
    inner = NgramDrafter() if drafter_kind == "ngram" else DraftModelDrafter(tiny_llama, tiny_llama)
    drafter = Recording(inner)
    gen = DSparkGenerator(tiny_llama, drafter, "fixed:4", max_batch_size=3)
    prompts = ragged_prompts(6, seed=3)
    stops = [tiny_llama.tokenizer.decode([t]) for t in prompts[0][:2]]
    for stop in (None, stops):
        results = gen.generate(prompts, max_new_tokens=max_new_tokens, stop=stop)
        for i, r in enumerate(results):
            st_ = r.stats
            assert st_.emitted == r.num_output_tokens == len(r.token_ids)
            assert st_.mean_accepted_length == r.num_output_tokens / (1 + st_.rounds)
            if max_new_tokens == 1:
                assert st_.rounds == 0 and st_.mean_accepted_length == 1.0
            again = recount_request(r, drafter.rounds[i])
            got = (st_.verified, st_.accepted, st_.rounds, st_.position_attempts, st_.position_accepts)
            assert got == (again.verified, again.accepted, again.rounds, again.position_attempts, again.position_accepts)
            if drafter_kind == "self":
                assert st_.accepted == st_.verified and all(a == n for a, n in zip(st_.position_accepts, st_.position_attempts))
    assert math.isclose(aggregate([r.stats for r in results]).mean_accepted_length, sum(r.num_output_tokens for r in results) / sum(1 + r.stats.rounds for r in results))
