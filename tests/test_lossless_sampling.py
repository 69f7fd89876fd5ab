"""Sampled output follows the target distribution exactly (chi-square, fixed seeds).

Each test draws enough samples that a 2% shift of probability mass between two tokens gives
a chi-square noncentrality far above the critical value; `test_the_check_has_power` shows
the same check rejects a sampler that is biased by that much.
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
from dspark.sampling import SamplingNoise, SamplingParams, probs_from_logits
from dspark.schedulers import FixedLength
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


def draw_counts(probs: torch.Tensor, n: int, index: int = 7, token_ids: torch.Tensor | None = None) -> np.ndarray:
    """How often n rows (seeds 0..n-1) draw each entry of `probs` at one token index."""
    counts = np.zeros(probs.shape[-1])
    for seed in range(n):
        counts[SamplingNoise(seed, V).draw(probs, index, token_ids)] += 1
    return counts


def test_a_row_noise_draws_exact_samples():
    """argmax(p / E) over seeds is a sample of p, impossible tokens never drawn."""
    g = torch.Generator().manual_seed(0)
    p = dist(g)
    p[4] = 0.0
    p /= p.sum()
    assert_follows(draw_counts(p, 20000), p.numpy(), "one index")


def test_the_check_has_power():
    """Drawing from a distribution with 2% of the mass moved is caught by the same check."""
    g = torch.Generator().manual_seed(0)
    p = dist(g)
    biased = p.clone()
    biased[0], biased[1] = biased[0] + 0.02, biased[1] - 0.02
    with pytest.raises(AssertionError):
        assert_follows(draw_counts(biased, 20000), p.numpy(), "biased")


def test_draws_at_successive_indices_are_independent():
    """Token t+1 given token t follows p: the noise of one index says nothing of the next."""
    g = torch.Generator().manual_seed(1)
    p0, p1 = dist(g), dist(g)
    pairs = np.zeros((V, V))
    for seed in range(20000):
        noise = SamplingNoise(seed, V)
        pairs[noise.draw(p0, 10), noise.draw(p1, 11)] += 1
    assert_follows(pairs.ravel(), np.outer(p0.numpy(), p1.numpy()).ravel(), "pairs")


def test_a_subset_distribution_uses_the_noise_of_its_token_ids():
    """A reduced draft vocabulary draws with the noise of the token each column stands for, so
    when q equals p on those tokens the draft is the target's draw whenever p's draw is one."""
    g = torch.Generator().manual_seed(2)
    p = dist(g)
    subset = torch.tensor([0, 2, 3, 5])
    q = p[subset] / p[subset].sum()
    agree = total = 0
    for seed in range(3000):
        noise = SamplingNoise(seed, V)
        target = noise.draw(p, 3)
        if target in subset.tolist():
            total += 1
            agree += int(subset[noise.draw(q, 3, subset)]) == target
    assert total > 0 and agree == total
    assert_follows(draw_counts(q, 20000, token_ids=subset), q.numpy(), "subset")


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
    return DSparkDrafter(model.to(target.device), eos_token_ids=[], draft_vocab=torch.tensor([0, 2, 3, 5]), copy=copy)


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


def make_test_drafter(target, drafter_kind: str):
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
    return drafter


def check_engine_sampling(target, drafter_kind: str) -> None:
    """3000 sampled rows through the engine in batches of 32: the first token, token pairs and
    tokens 2-3 (one verify round) follow the target's exact distributions (chi-square)."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so the n-gram drafter proposes a tree
    gen = DSparkGenerator(target, make_test_drafter(target, drafter_kind), FixedLength(3), max_batch_size=32)
    n = 3000
    results = gen.generate([prompt] * n, max_new_tokens=3, temperature=1.0, seed=1234)
    plain = DSparkGenerator(target, None, "ar", max_batch_size=32).generate([prompt] * n, max_new_tokens=3, temperature=1.0, seed=1234)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain], "speculation must not change a seeded row"
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


@pytest.mark.parametrize("drafter_kind", ["ngram-tree", "draft-model", "dspark-copy-scorer", "dspark+ngram"])
def test_a_seeded_prompt_samples_the_same_alone_batched_reordered_and_after_other_calls(small_vocab_target, drafter_kind):
    """A row's tokens depend on its seed and the target only: not on the batch it shares, the
    order, earlier calls, or how much the load-adaptive scheduler verified; and they are the
    tokens plain sampled decoding gives with the same seed."""
    target = small_vocab_target
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 9, (8,), generator=g)]
    seeds = [101 + 7 * i for i in range(8)]
    args = dict(max_new_tokens=12, temperature=0.9, top_p=0.95)
    gen = DSparkGenerator(target, make_test_drafter(target, drafter_kind), "dspark", max_batch_size=8)

    def tokens(idx: list[int]) -> dict[int, list[int]]:
        out = gen.generate([prompts[i] for i in idx], seeds=[seeds[i] for i in idx], **args)
        return {i: r.token_ids for i, r in zip(idx, out)}

    alone = {i: tokens([i])[i] for i in range(8)}
    assert tokens([0, 1, 2]) == {i: alone[i] for i in (0, 1, 2)}
    assert tokens(list(range(8))) == alone
    assert tokens(list(reversed(range(8)))) == alone
    gen.generate([[3, 3, 3]] * 5, seeds=[1, 2, 3, 4, 5], **args)  # an unrelated call
    assert tokens([5, 2, 7]) == {i: alone[i] for i in (5, 2, 7)}
    plain = DSparkGenerator(target, None, "ar", max_batch_size=3).generate(prompts, seeds=seeds, **args)
    assert [r.token_ids for r in plain] == [alone[i] for i in range(8)]
    assert len({tuple(t) for t in alone.values()}) == 8
