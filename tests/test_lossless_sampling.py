"""Sampled output follows the target distribution exactly (chi-square, fixed seeds).

Each test draws enough samples that a 2% shift of probability mass between two tokens gives
a chi-square noncentrality far above the critical value; `test_the_check_has_power` shows
the same check rejects a verifier that is biased by that much.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.drafters.union import UnionDrafter
from dspark.dspark_drafter import DSparkConfig, DSparkDrafter, build_model
from dspark.dspark_drafter.copy_prior import CopyPrior, CopyRule, CopyScorer, scorer_features
from dspark.generator import DSparkGenerator
from dspark.models import wrap_model
from dspark.sampling import SamplingParams, probs_from_logits
from dspark.schedulers import FixedLength
from dspark.tree import DraftTree
from dspark.verify import verify_sampling
from tests.conftest import tiny_model, word_tokenizer

ALPHA = 1e-3  # false-alarm rate per test; seeds are fixed, so the outcome is reproducible
V = 6


def assert_follows(counts: np.ndarray, probs: np.ndarray, label: str) -> None:
    counts = np.asarray(counts, dtype=float)
    probs = np.asarray(probs, dtype=float)
    expected = probs / probs.sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, f"{label}: impossible tokens were emitted"
    exp = expected[keep] * counts[keep].sum() / expected[keep].sum()  # exact totals for scipy
    p = chisquare(counts[keep], exp).pvalue
    assert p > ALPHA, f"{label}: p={p:.2e}, counts={counts.tolist()}, expected={expected.round(1).tolist()}"


def dist(g: torch.Generator, sharp: float = 1.0) -> torch.Tensor:
    return (torch.randn(V, generator=g) * sharp).softmax(-1)


@pytest.fixture
def tables():
    g = torch.Generator().manual_seed(0)
    p0, q0 = dist(g), dist(g, 2.0)
    p1 = torch.stack([dist(g) for _ in range(V)])  # target at depth 2 given the depth-1 token
    q1 = torch.stack([dist(g, 2.0) for _ in range(V)])
    return p0, q0, p1, q1


def run_chain(p0, q0, p1, q1, n: int, seed: int, verify=verify_sampling):
    """Draft a sampled 2-token chain, verify; count first tokens and second-given-first."""
    g = torch.Generator().manual_seed(seed)
    first = np.zeros(V)
    second = np.zeros((V, V))
    for _ in range(n):
        x1 = int(torch.multinomial(q0, 1, generator=g))
        x2 = int(torch.multinomial(q1[x1], 1, generator=g))
        tree = DraftTree.chain([x1, x2], [1.0, 1.0], [q0, q1[x1]])
        target = torch.stack([p0, p1[x1], p0])  # the row after x2 is unused by these counts
        v = verify(tree, target, g)
        emitted = [tree.tokens[k] for k in v.accepted_nodes] + [v.next_token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[0], emitted[1]] += 1
    return first, second


def test_chain_rejection_sampling_is_exact(tables):
    p0, q0, p1, q1 = tables
    first, second = run_chain(p0, q0, p1, q1, n=20000, seed=1)
    assert_follows(first, p0.numpy(), "first token")
    for x in range(V):
        if second[x].sum() > 500:
            assert_follows(second[x], p1[x].numpy(), f"second token after {x}")


def test_the_check_has_power(tables):
    """A verifier that moves 2% of the mass is caught by the same test and sample size."""
    p0, q0, p1, q1 = tables

    def biased(tree, target, g):
        target = target.clone()
        shift = torch.zeros(V)
        shift[0], shift[1] = 0.02, -0.02
        target[0] = (target[0] + shift).clamp(min=0)
        target[0] /= target[0].sum()
        return verify_sampling(tree, target, g)

    first, _ = run_chain(p0, q0, p1, q1, n=20000, seed=1, verify=biased)
    with pytest.raises(AssertionError):
        assert_follows(first, p0.numpy(), "biased")


@pytest.mark.parametrize("kind", ["sampled-siblings", "deterministic-siblings"])
def test_tree_with_three_candidates_is_exact(tables, kind):
    """Three children of the anchor tried in order against successive residuals."""
    p0, q0, _, _ = tables
    g = torch.Generator().manual_seed(2)
    counts = np.zeros(V)
    ranked = torch.argsort(q0, descending=True).tolist()
    for _ in range(20000):
        tree = DraftTree()
        if kind == "sampled-siblings":  # i.i.d. draws from q, each tested with its own q
            for _ in range(3):
                tree.add(int(torch.multinomial(q0, 1, generator=g)), -1, 1.0, q0)
        else:  # top-3 of q as point masses
            for t in ranked[:3]:
                tree.add(t, -1, 1.0, None)
        v = verify_sampling(tree, torch.stack([p0] * 4), g)
        emitted = [tree.tokens[k] for k in v.accepted_nodes] + [v.next_token]
        counts[emitted[0]] += 1
    assert_follows(counts, p0.numpy(), kind)


def test_top_k_top_p_processing():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p[:2].sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    kept = int((p > 0).sum())
    assert full[: kept - 1].sum() < 0.9 <= full[:kept].sum()
    greedy = probs_from_logits(logits, SamplingParams())
    assert greedy.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


# --- the whole engine: batched rows, real (tiny) models ------------------------------------
VOCAB = 8


def exact_two_token_distribution(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """P(t1, t2 | prompt) computed from the model directly (on its own device), [VOCAB, VOCAB]."""
    device = next(model.parameters()).device
    with torch.no_grad():
        p1 = probs_from_logits(model(torch.tensor([prompt], device=device)).logits[0, -1], params).cpu()
        joint = np.zeros((VOCAB, VOCAB))
        for t in range(VOCAB):
            p2 = probs_from_logits(model(torch.tensor([prompt + [t]], device=device)).logits[0, -1], params).cpu()
            joint[t] = (p1[t] * p2).numpy()
    return joint


def small_vocab_target_on(device: str | torch.device = "cpu"):
    tok = word_tokenizer(VOCAB)
    model = tiny_model("llama", VOCAB, seed=3, hidden=32, layers=2, eos=None)
    with torch.no_grad():  # sharpen, so a few tokens carry most of the mass
        model.lm_head.weight.mul_(3.0)
    return wrap_model(model.to(device), tok, "tiny-8")


@pytest.fixture(scope="module")
def small_vocab_target():
    return small_vocab_target_on("cpu")


def reduced_vocab_dspark_drafter(target, copy: CopyRule | None = None) -> DSparkDrafter:
    """A random-weight DSpark drafter that may only propose 4 of the 8 tokens: its q is zero on
    the other 4, which the target still produces (through the residual distribution). With a
    copy prior it also proposes what followed earlier occurrences, outside those 4 too."""
    torch.manual_seed(5)
    cfg = DSparkConfig.for_target(target.model.config, num_layers=1, context_len=4, gamma=3, markov_rank=4)
    model = build_model(cfg, target.model)
    with torch.no_grad():
        model.markov_w2.normal_()
    return DSparkDrafter(model.to(target.device), eos_token_ids=[], seed=9, draft_vocab=torch.tensor([0, 2, 3, 5]), copy=copy)


DRAFTER_KINDS = ["draft-model", "ngram-tree", "dspark-reduced-vocab", "dspark-copy-prior", "dspark-copy-scorer", "dspark+ngram"]


def copy_scorer() -> CopyScorer:
    """A learned copy rule with hand-set weights that makes copying likely but not certain:
    copied tokens get logits near the drafter's top-1, so q mixes both."""
    names = scorer_features((2, 3))
    weights = {"bias": 1.0, "gap": -2.0, "3c": 1.0, "agree": 0.5, "confidence": 0.3}
    return CopyScorer((2, 3), tuple(weights.get(n, 0.0) for n in names))


@pytest.mark.parametrize("drafter_kind", DRAFTER_KINDS)
def test_engine_sampling_matches_target_in_batches(small_vocab_target, drafter_kind):
    check_engine_sampling(small_vocab_target, drafter_kind)


def check_engine_sampling(target, drafter_kind: str) -> None:
    """3000 sampled rows through the engine in batches of 32: the first token, token pairs and
    tokens 2-3 (one verify round) follow the target's exact distributions (chi-square)."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so the n-gram drafter proposes a tree
    if drafter_kind == "draft-model":
        draft = tiny_model("llama", VOCAB, seed=11, hidden=32, layers=1, eos=None).to(target.device)
        drafter = DraftModelDrafter(wrap_model(draft, target.tokenizer, "d"), target)
    elif drafter_kind == "dspark-reduced-vocab":
        drafter = reduced_vocab_dspark_drafter(target)
    elif drafter_kind == "dspark-copy-prior":  # (1, 2) -> 3 inside the vocabulary, (2, 3) -> 1 outside
        # 2 -> 3 and 3 -> 1 are consistent bigram matches: their kind has a bonus of its own
        drafter = reduced_vocab_dspark_drafter(target, CopyPrior(((2, 1.0), (3, 2.0)), kind_bonuses=((2, "c", 3.0),)))
    elif drafter_kind == "dspark-copy-scorer":  # the same matches, rescored by a learned rule
        drafter = reduced_vocab_dspark_drafter(target, copy_scorer())
    elif drafter_kind == "dspark+ngram":  # a sampled chain and n-gram point masses as siblings
        drafter = UnionDrafter([reduced_vocab_dspark_drafter(target), NgramDrafter(max_ngram=2, min_ngram=1, num_candidates=3)])
    else:
        drafter = NgramDrafter(max_ngram=2, min_ngram=1, num_candidates=3)
    gen = DSparkGenerator(target, drafter, FixedLength(3), max_batch_size=32)
    n = 3000
    results = gen.generate([prompt] * n, max_new_tokens=3, temperature=1.0, seed=1234)
    joint = np.zeros((VOCAB, VOCAB))
    later = np.zeros((VOCAB, VOCAB))  # tokens 2 and 3: both from the first verify round
    for r in results:
        joint[r.token_ids[0], r.token_ids[1]] += 1
        later[r.token_ids[1], r.token_ids[2]] += 1
    expected = exact_two_token_distribution(target.model, prompt, params)
    assert_follows(joint.sum(1), expected.sum(1), "first token")
    assert_follows(joint.ravel(), expected.ravel(), "token pairs")
    # the first token comes from the prefill; tokens 2-3 are an accepted draft and the next
    # token (or a correction) of one round: P(t2, t3) = sum over t1 of P(t1) P(t2, t3 | t1)
    expected_later = sum(expected.sum(1)[t] * exact_two_token_distribution(target.model, prompt + [t], params) for t in range(VOCAB))
    assert_follows(later.ravel(), expected_later.ravel(), "tokens 2 and 3")
    stats = [r.stats for r in results]
    assert sum(s.accepted for s in stats) > 0.1 * n, "drafts must be accepted often enough to matter"
