"""A union of drafters (`dspark+ngram`): merged trees, per-drafter feedback, and lossless output."""

from __future__ import annotations

import pytest
import torch

from dspark.drafters import make_drafter
from dspark.drafters.base import DraftRequest, DrafterBase, VerifyOutcome
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.drafters.union import UnionDrafter, merge_trees, outcome_for
from dspark.dspark_drafter import DSparkConfig, DSparkDrafter, build_model
from dspark.dspark_drafter.copy_prior import CopyPrior
from dspark.generator import DSparkGenerator
from dspark.sampling import SamplingParams
from dspark.tree import DraftTree
from tests.test_lossless_greedy import hf_greedy, ragged_prompts, scheduler


def chain(tokens, conf):
    return DraftTree.chain(tokens, conf)


def test_merge_folds_shared_paths_and_keeps_the_larger_confidence():
    a = chain([5, 6, 7], [0.9, 0.5, 0.4])
    b = DraftTree()
    b.add(5, -1, 0.6)  # same first token
    b.add(8, 0, 0.7)  # then a different continuation
    b.add(9, -1, 0.2)  # a second root candidate
    m = merge_trees([a, b])
    m.validate()
    assert m.tokens == [5, 6, 7, 8, 9]
    assert m.parents == [-1, 0, 1, 0, -1]
    assert m.confidence == [0.9, 0.5, 0.4, 0.7, 0.2]


def test_each_drafter_hears_about_its_own_nodes_only():
    own = DraftTree()
    own.add(5, -1, 0.9)  # 0
    own.add(6, 0, 0.9)  # 1
    own.add(7, 1, 0.9)  # 2: pruned by the scheduler below
    own.add(4, -1, 0.5)  # 3
    # what was verified: the merged tree cut to [5, 6] and [4], plus another drafter's [5, 8]
    verified = DraftTree()
    verified.add(5, -1, 0.9)
    verified.add(6, 0, 0.9)
    verified.add(4, -1, 0.5)
    verified.add(8, 0, 0.7)
    out = outcome_for(own, VerifyOutcome(3, verified, accepted_nodes=[0, 3], next_token=2), hidden=None)
    assert out.tree.tokens == [5, 6, 4] and out.tree.parents == [-1, 0, -1]
    assert out.accepted_nodes == [0]  # 5 was accepted; 8 was not this drafter's proposal
    assert out.next_token == 2 and out.request_id == 3


class Recording(DrafterBase):
    """A drafter that proposes a fixed chain and records what it is told."""

    def __init__(self, name, tokens, layers=()):
        self.name, self.tokens, self.target_layers = name, tokens, tuple(layers)
        self.started, self.outcomes = [], []

    def start(self, request, prompt_hidden):
        request.state["mine"] = self.name
        self.started.append(None if prompt_hidden is None else len(prompt_hidden))

    def propose(self, requests, max_depth):
        assert all(r.state["mine"] == self.name for r in requests), "each drafter keeps its own state"
        return [chain(self.tokens[:max_depth], [0.5] * min(max_depth, len(self.tokens))) for _ in requests]

    def observe(self, request, outcome):
        self.outcomes.append((outcome.tree.tokens, outcome.accepted_nodes, None if outcome.hidden is None else len(outcome.hidden)))


def test_union_routes_states_hidden_layers_and_outcomes():
    a, b = Recording("a", [5, 6], layers=(3, 1)), Recording("b", [7])
    union = UnionDrafter([a, b])
    assert union.name == "a+b" and union.target_layers == (1, 3)
    req = DraftRequest(0, [1, 2, 3], SamplingParams())
    hidden = [torch.zeros(2, 4), torch.ones(2, 4)]  # layers 1 and 3, in the union's order
    union.start(req, hidden)
    assert a.started == [2] and b.started == [None]
    (tree,) = union.propose([req], max_depth=4)
    assert tree.tokens == [5, 6, 7] and tree.parents == [-1, 0, -1]
    req.token_ids.extend([5, 9])
    union.observe(req, VerifyOutcome(0, tree, [0], 9, hidden=hidden))
    assert a.outcomes == [([5, 6], [0], 2)] and b.outcomes == [([7], [], None)]
    assert [s.token_ids for s in req.state["union"]] == [[1, 2, 3, 5, 9]] * 2  # one shared list
    union.finish(req)
    assert req.state == {}


def test_a_union_is_built_from_its_spec(tiny_llama):
    d = make_drafter("ngram+ngram:2:1", tiny_llama)
    assert isinstance(d, UnionDrafter) and d.name == "ngram+ngram"
    assert [x.max_ngram for x in d.drafters] == [4, 2]
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("ngram+nope", tiny_llama)


def random_dspark(target, copy: CopyPrior | None = None, draft_vocab: torch.Tensor | None = None) -> DSparkDrafter:
    torch.manual_seed(3)
    cfg = DSparkConfig.for_target(target.model.config, num_layers=1, context_len=8, gamma=4, markov_rank=4)
    return DSparkDrafter(build_model(cfg, target.model), eos_token_ids=[], copy=copy, draft_vocab=draft_vocab)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("sched", ["fixed:4", "dspark"])
def test_dspark_with_a_copy_prior_greedy_equals_plain_greedy(batch_size, sched, tiny_llama):
    """Copied tokens (most outside the reduced vocabulary) only change what is proposed."""
    prompts = ragged_prompts(6)
    expected = [hf_greedy(tiny_llama, p, 16) for p in prompts]
    prior = CopyPrior(((2, 4.0), (3, 8.0)), kind_bonuses=((2, "u", 0.0), (2, "c", 12.0)))  # bonuses per kind of match too
    drafter = random_dspark(tiny_llama, prior, draft_vocab=torch.arange(0, 40))
    results = DSparkGenerator(tiny_llama, drafter, scheduler(sched), max_batch_size=batch_size).generate(prompts, max_new_tokens=16)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted for r in results) > 0


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("sched", ["fixed:4", "threshold:0.3", "dspark"])
def test_dspark_plus_ngram_greedy_equals_plain_greedy(batch_size, sched, tiny_llama):
    prompts = ragged_prompts(6)
    expected = [hf_greedy(tiny_llama, p, 16) for p in prompts]
    ngram = NgramDrafter()
    union = UnionDrafter([random_dspark(tiny_llama), ngram])
    results = DSparkGenerator(tiny_llama, union, scheduler(sched), max_batch_size=batch_size).generate(prompts, max_new_tokens=16)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.verified for r in results) > 0
    assert sum(att for _, att in ngram.depth_stats.values()) > 0, "the n-gram drafter must learn from its own outcomes"


def test_a_perfect_member_is_still_accepted_in_full(tiny_llama):
    """The target drafting for itself, merged with n-gram guesses: the union must not lose
    the perfect chain, so every round accepts the whole verified depth."""
    prompts = ragged_prompts(4)
    expected = [hf_greedy(tiny_llama, p, 12) for p in prompts]
    union = UnionDrafter([DraftModelDrafter(tiny_llama, tiny_llama), NgramDrafter()])
    verify_all = scheduler("threshold:0.0", max_depth=3)  # every node of the merged tree
    results = DSparkGenerator(tiny_llama, union, verify_all, max_batch_size=2).generate(prompts, max_new_tokens=12)
    assert [r.token_ids for r in results] == expected
    for r in results:
        assert r.stats.accepted >= 3 * (r.stats.rounds - 1)  # only the last round may be cut short
