"""The copy prior's n-gram lookups and the fitting of its bonuses (pure Python, no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np

from dspark.dspark_drafter.copy_prior import CopyPrior, NgramIndex, adjust_logits, fit_bonuses, fit_confidence, match_class

PRIOR = CopyPrior(((2, 1.0), (3, 10.0), (4, 100.0)))


def brute_force(seq: list[int], prior: CopyPrior) -> dict[int, float]:
    """The spec: per order o, the token after the most recent EARLIER occurrence of seq's last
    o - 1 tokens, anywhere in seq."""
    out: dict[int, float] = {}
    for o, bonus in prior.bonuses:
        if bonus <= 0 or len(seq) < o - 1:
            continue
        key = seq[len(seq) - o + 1 :]
        for i in range(len(seq) - 1, o - 2, -1):  # i: the follower's position
            if seq[i - o + 1 : i] == key:
                out[seq[i]] = out.get(seq[i], 0.0) + bonus
                break
    return out


def test_the_most_recent_follower_wins_per_order():
    index = NgramIndex([2, 3], [1, 2, 3, 1, 2, 4, 7, 2])
    assert index.size == 8
    # bigram (2,): followed by 3, then by 4, then by nothing yet -> 4; trigram (7, 2): never followed
    assert index.candidates([7, 2], CopyPrior(((2, 1.0), (3, 5.0)))) == {4: 1.0}
    # trigram (1, 2): followed by 3, then 4 -> 4 gets both bonuses
    assert index.candidates([1, 2], CopyPrior(((2, 1.0), (3, 5.0)))) == {4: 6.0}


def test_extend_piecewise_equals_extend_at_once():
    seq = [5, 1, 5, 2, 5, 1, 5, 3, 1, 5]
    whole, pieces = NgramIndex([2, 3, 4], seq), NgramIndex([2, 3, 4])
    for a, b in ((0, 3), (3, 4), (4, 10)):
        pieces.extend(seq[a:b])
    assert whole.follow == pieces.follow and pieces.size == len(seq)


@settings(max_examples=300, deadline=None)
@given(
    seq=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    fresh=st.integers(0, 8),
)
def test_lookups_over_committed_and_drafted_tokens_match_the_spec(seq, fresh):
    """The index holds the committed tokens; the last `fresh` are drafted ones it has not seen.
    Looking up with the committed tail + the drafted path must equal a scan of everything."""
    fresh = min(fresh, len(seq) - 1)
    committed, path = seq[: len(seq) - fresh], seq[len(seq) - fresh :]
    index = NgramIndex(PRIOR.orders, committed)
    suffix = committed[-PRIOR.span :] + path
    assert index.candidates(suffix, PRIOR, fresh=len(path)) == brute_force(seq, PRIOR)


def test_zero_bonuses_and_short_suffixes_propose_nothing():
    index = NgramIndex([2, 3], [1, 2, 1, 2])
    assert index.candidates([1, 2], CopyPrior(((2, 0.0), (3, 0.0)))) == {}
    assert CopyPrior(((2, 0.0), (3, 0.0))).active is False
    assert index.candidates([], PRIOR) == {}


def test_prior_validates_and_round_trips():
    prior = CopyPrior(((4, 8.0), (2, 0.0), (3, 8.0)), ((4, 0.5, 2.0), (0, 1.0, -0.5)))
    assert prior.bonuses == ((2, 0.0), (3, 8.0), (4, 8.0)) and prior.orders == (3, 4) and prior.span == 3
    assert CopyPrior.from_dict(prior.to_dict()) == prior
    corrected = adjust_logits(prior, np.array([3.0, 3.0, 3.0]), np.array([4, 0, 3]))
    assert corrected.tolist() == [3.5, 2.5, 3.0]  # class 3 has no correction: identity
    assert CopyPrior.from_dict(None) is None and CopyPrior.from_dict({}) is None
    with pytest.raises(ValueError, match=">= 2"):
        CopyPrior(((1, 1.0),))
    with pytest.raises(ValueError, match=">= 0"):
        CopyPrior(((2, -1.0),))


def test_fit_finds_the_best_grid_point_and_keeps_small_bonuses_on_ties():
    target = {2: 0.0, 3: 8.0, 4: 4.0}
    calls = []

    def score(priors):  # peaked at `target`; order 2 is flat around 0 (a tie: stays 0)
        calls.append(priors)
        return [-sum(abs(b - target[o]) for o, b in p.bonuses if o != 2) for p in priors]

    best, tried = fit_bonuses(score, [2, 3, 4], [2, 4, 8, 16])
    assert best == CopyPrior(((2, 0.0), (3, 8.0), (4, 4.0)))
    assert tried[0][0] == CopyPrior(((2, 0.0), (3, 0.0), (4, 0.0)))
    scored = [p for call in calls for p in call]
    assert len(scored) == len(set(scored)) == len(tried)  # each prior scored once
    assert max(len(call) for call in calls) == 4  # a coordinate's new grid values in one call


def test_fit_without_gain_stays_off():
    best, tried = fit_bonuses(lambda priors: [1.0 for _ in priors], [2, 3], [4, 8])
    assert not best.active and len(tried) == 1 + 2 * 2


def test_match_class_is_the_longest_matched_order():
    index = NgramIndex([2, 3, 4], [1, 2, 3, 9, 2, 3])
    found = index.matches([9, 2, 3], PRIOR)
    assert found == {2: 9, 3: 9} and match_class(found) == 3  # (2, 3) -> 9; (9, 2, 3) never followed
    assert match_class({}) == 0


def test_confidence_fit_recovers_a_known_logistic_per_class():
    """Steps of class 4 are accepted with sigmoid(0.5 z + 2), class 0 with sigmoid(z - 1):
    the fit recovers both; adjust_logits then maps raw logits to the calibrated ones."""
    rng = np.random.default_rng(0)
    n, g = 20000, 3
    z = rng.normal(0, 2, (n, g))
    classes = rng.choice([0, 4], size=(n, g))
    true = np.where(classes == 4, 0.5 * z + 2.0, z - 1.0)
    accepted = (rng.random((n, g)) < 1 / (1 + np.exp(-true))).astype(float)
    fit = fit_confidence(z, accepted, classes)
    assert fit[4] == pytest.approx((0.5, 2.0), abs=0.1) and fit[0] == pytest.approx((1.0, -1.0), abs=0.1)
    prior = PRIOR.with_confidence(fit)
    np.testing.assert_allclose(adjust_logits(prior, z, classes), true, atol=0.4)
    assert fit_confidence(z[:10], accepted[:10], classes[:10]) == {}  # too few steps: identity
