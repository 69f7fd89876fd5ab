"""The copy prior's n-gram lookups and the fitting of its bonuses (pure Python, no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numpy as np

from dspark.dspark_drafter.copy_prior import (
    MAX_DISTINCT,
    Candidate,
    CopyPrior,
    CopyScorer,
    Match,
    NgramIndex,
    StepView,
    adjust_logits,
    copy_rule_from_dict,
    fit_bonuses,
    fit_confidence,
    fit_copy_scorer,
    match_class,
    scorer_features,
)

PRIOR = CopyPrior(((2, 1.0), (3, 10.0), (4, 100.0)))
# a bigram seen once gives nothing, one always continued the same way a lot
KINDED = CopyPrior(((2, 1.0), (3, 10.0), (4, 100.0)), kind_bonuses=((2, "u", 0.0), (2, "c", 7.0), (3, "a", 0.5)))


def brute_force(seq: list[int], prior: CopyPrior) -> dict[int, float]:
    """The spec: per order o, the token after the most recent EARLIER occurrence of seq's last
    o - 1 tokens, anywhere in seq, with the bonus of the match's kind: u (one earlier
    occurrence), c (several, one follower), a (several followers)."""
    out: dict[int, float] = {}
    for o, _ in prior.bonuses:
        if len(seq) < o - 1:
            continue
        key = seq[len(seq) - o + 1 :]
        followers = [seq[i] for i in range(len(seq) - 1, o - 2, -1) if seq[i - o + 1 : i] == key]  # latest first
        if not followers:
            continue
        kind = "u" if len(followers) == 1 else ("c" if len(set(followers)) == 1 else "a")
        if prior.bonus(o, kind) > 0:
            out[followers[0]] = out.get(followers[0], 0.0) + prior.bonus(o, kind)
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
    prior=st.sampled_from([PRIOR, KINDED]),
)
def test_lookups_over_committed_and_drafted_tokens_match_the_spec(seq, fresh, prior):
    """The index holds the committed tokens; the last `fresh` are drafted ones it has not seen.
    Looking up with the committed tail + the drafted path must equal a scan of everything."""
    fresh = min(fresh, len(seq) - 1)
    committed, path = seq[: len(seq) - fresh], seq[len(seq) - fresh :]
    index = NgramIndex(prior.orders, committed)
    suffix = committed[-prior.span :] + path
    assert index.candidates(suffix, prior, fresh=len(path)) == brute_force(seq, prior)


def test_match_kinds_tell_unique_consistent_and_ambiguous_matches_apart():
    index = NgramIndex([2, 3], [5, 1, 5, 1, 6, 2, 6, 3, 7, 4])
    every = CopyPrior(((2, 1.0), (3, 1.0)))
    assert index.matches([5], every)[2] == Match(1, "c")  # 5 -> 1 twice
    assert index.matches([6], every)[2] == Match(3, "a")  # 6 -> 2, then 6 -> 3: the latest
    assert index.matches([7], every)[2] == Match(4, "u")
    assert index.matches([5, 7], every, fresh=1)[2] == Match(4, "u")
    # a drafted 7 -> 9 makes 7 ambiguous, and it is the latest follower
    assert index.matches([7, 9, 7], every, fresh=2)[2] == Match(9, "a")
    assert index.matches([7], KINDED) == {}  # unique bigrams get no bonus there
    assert index.candidates([5], KINDED) == {1: 7.0}


def test_followers_are_every_earlier_continuation_not_just_the_latest():
    index = NgramIndex([2, 3], [5, 6, 5, 7, 9, 5])
    assert index.matches([9, 5], CopyPrior(((2, 1.0),)))[2] == Match(7, "a")  # the rules copy the latest
    assert index.followers([9, 5], [2]) == {6, 7}  # 5 -> 6, then 5 -> 7
    assert index.followers([9, 5], [3]) == set()  # "9 5" was never continued
    assert index.followers([9, 5], [2, 3]) == {6, 7}
    # a drafted 5 -> 8 joins them; the drafted 8 was never continued
    assert index.followers([5, 8, 5], [2], fresh=2) == {6, 7, 8}
    assert index.followers([5, 8], [2], fresh=1) == set()


def test_zero_bonuses_and_short_suffixes_propose_nothing():
    index = NgramIndex([2, 3], [1, 2, 1, 2])
    assert index.candidates([1, 2], CopyPrior(((2, 0.0), (3, 0.0)))) == {}
    assert CopyPrior(((2, 0.0), (3, 0.0))).active is False
    assert index.candidates([], PRIOR) == {}


def test_prior_validates_and_round_trips():
    prior = CopyPrior(((4, 8.0), (2, 0.0), (3, 8.0)), ((4, 0.5, 2.0), (0, 1.0, -0.5)))
    assert prior.bonuses == ((2, 0.0), (3, 8.0), (4, 8.0)) and prior.orders == (3, 4) and prior.span == 3
    assert CopyPrior.from_dict(prior.to_dict()) == prior
    kinded = prior.with_bonus(2, 4.0, "c")
    assert kinded.orders == (2, 3, 4) and kinded.bonus(2, "c") == 4.0 and kinded.bonus(2, "u") == 0.0
    assert kinded.to_dict()["kind_bonuses"] == {"2c": 4.0}
    assert CopyPrior.from_dict(kinded.to_dict()) == kinded
    assert kinded.with_bonus(2, 1.0).bonus(2, "c") == 1.0  # a per-order bonus replaces its kinds'
    assert prior.with_bonus(3, 8.0, "u") == prior  # an override equal to its order's bonus is no override
    with pytest.raises(ValueError, match="kind"):
        CopyPrior(((2, 1.0),), kind_bonuses=((2, "x", 1.0),))
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


def test_fit_per_kind_moves_one_kind_at_a_time():
    def score(priors):  # only consistent bigrams and unique trigrams help
        return [-abs(p.bonus(2, "c") - 8) - abs(p.bonus(3, "u") - 4) - p.bonus(2, "u") for p in priors]

    start = CopyPrior(((2, 0.0), (3, 4.0)))
    best, tried = fit_bonuses(score, [2, 3], [4, 8], kinds=("u", "c", "a"), start=start)
    assert best.bonus(2, "c") == 8.0 and best.bonus(3, "u") == 4.0 and best.bonus(2, "u") == 0.0
    assert tried[0][0] == start


def test_fit_does_not_rate_a_prior_again():
    """Each call walks every calib block: priors already rated are passed in, not re-rated,
    and no call is made with nothing new."""
    calls = []

    def score(priors):
        calls.append(priors)
        return [p.bonus(2, "c") - p.bonus(2, "u") for p in priors]

    start = CopyPrior(((2, 4.0),))
    best, tried = fit_bonuses(score, [], [4, 8], sweeps=1, kinds=("u", "c"), start=start, scored={start: 0.0})
    assert best.bonus(2, "c") == 8.0 and best.bonus(2, "u") == 0.0
    assert all(calls) and start not in [p for call in calls for p in call]
    assert tried[0] == (start, 0.0) and len(tried) == len({p for p, _ in tried})


def test_fit_without_gain_stays_off():
    best, tried = fit_bonuses(lambda priors: [1.0 for _ in priors], [2, 3], [4, 8])
    assert not best.active and len(tried) == 1 + 2 * 2


def test_match_class_is_the_longest_matched_order():
    index = NgramIndex([2, 3, 4], [1, 2, 3, 9, 2, 3])
    found = index.matches([9, 2, 3], PRIOR)
    assert {o: m.token for o, m in found.items()} == {2: 9, 3: 9} and match_class(found) == 3  # (2, 3) -> 9; (9, 2, 3) never followed
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


def test_confidence_fit_never_turns_the_head_upside_down():
    """A class accepted less often the more confident the head is gets scale 0 and its base
    rate: the calibrated confidence must not rank steps against the head's own order."""
    rng = np.random.default_rng(1)
    z = rng.normal(0, 2, (20000, 2))
    accepted = (rng.random(z.shape) < 1 / (1 + np.exp(0.3 * z - 1.5))).astype(float)  # true scale -0.3
    classes = np.full(z.shape, 6)
    reached = np.concatenate([np.ones((len(z), 1)), accepted[:, :1]], axis=1) > 0
    rate = accepted[reached].mean()
    scale, shift = fit_confidence(z, accepted, classes)[6]
    assert scale == 0.0 and shift == pytest.approx(np.log(rate / (1 - rate)), abs=5e-3)  # up to the tiny ridge


# ---------------------------------------------------------------- the learned copy decision

ORDERS = (2, 3, 5)


def brute_force_evidence(seq: list[int], orders: tuple[int, ...], prompt_len: int) -> tuple[int, dict[int, Candidate]]:
    """The spec of `NgramIndex.evidence` for the position after seq: per order, the followers of
    the earlier occurrences of seq's last o - 1 tokens; per copied token (the latest follower),
    the evidence of the longest order proposing it, and how many orders propose it."""
    longest, out = 0, {}
    for o in orders:
        key = seq[len(seq) - o + 1 :]
        if len(seq) < o - 1:
            continue
        at = [i for i in range(o - 1, len(seq)) if seq[i - o + 1 : i] == key]  # follower positions, oldest first
        if not at:
            continue
        followers = [seq[i] for i in at]
        distinct = len(set(followers))
        kind = "u" if len(at) == 1 else ("c" if distinct == 1 else "a")
        token, pos = followers[-1], at[-1]
        agree = out[token].agree + 1 if token in out else 1
        out[token] = Candidate(o, kind, len(at), len(seq) - pos, agree, min(distinct, MAX_DISTINCT), pos < prompt_len)
        longest = o
    return longest, out


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 7), min_size=1, max_size=40), fresh=st.integers(0, 8), prompt_len=st.integers(0, 20))
def test_evidence_over_committed_and_drafted_tokens_matches_a_scan(seq, fresh, prompt_len):
    fresh = min(fresh, len(seq) - 1)
    committed, path = seq[: len(seq) - fresh], seq[len(seq) - fresh :]
    index = NgramIndex(ORDERS, committed, prompt_len=prompt_len)
    suffix = committed[-(max(ORDERS) - 1) :] + path
    assert index.evidence(suffix, ORDERS, fresh=len(path)) == brute_force_evidence(seq, ORDERS, prompt_len)


def test_evidence_tells_distance_agreement_and_the_prompt_apart():
    # prompt [4, 1, 2, 3], answer so far [9, 1, 2]: (1, 2) -> 3 in the prompt; (2,) -> 3 too
    index = NgramIndex((2, 3), [4, 1, 2, 3, 9, 1, 2], prompt_len=4)
    cls, cands = index.evidence([9, 1, 2], (2, 3))
    assert cls == 3 and cands == {3: Candidate(3, "u", 1, 4, 2, 1, True)}  # follower at 3, drafting position 7
    # a drafted 2 -> 8 makes (2,) ambiguous and its latest follower 8, drafted one position ago
    cls, cands = index.evidence([1, 2, 8, 2], (2, 3), fresh=2)
    assert cands[8] == Candidate(2, "a", 2, 2, 1, 2, False) and cls == 2


def scorer_with(**named: float) -> CopyScorer:
    names = scorer_features(ORDERS)
    return CopyScorer(ORDERS, tuple(named.get(n, 0.0) for n in names))


def test_scorer_gives_each_candidate_the_odds_its_utility_says():
    """A candidate's logit becomes l_top1 + u(c): p(c) / p(top-1) = exp(u(c)); the top-1 itself
    is never rescored, and with zero weights every candidate ties with it."""
    scorer = scorer_with(bias=-1.0, gap=-2.0, **{"3c": 3.0}, from_prompt=0.5)
    step = StepView(k=2, top1=7, l_top1=5.0, lse=6.0, z=0.3)
    cands = {
        11: Candidate(3, "c", 4, 10, 2, 1, True),
        12: Candidate(2, "u", 1, 3, 1, 1, False),
        7: Candidate(5, "u", 1, 2, 1, 1, False),
    }
    logits = {11: (3.0, True), 12: (4.0, False), 7: (5.0, True)}
    new = scorer.rescore(cands, logits, step)
    # 11: -1 - 2 * (5 - 3) / 10 + 3 + 0.5 = 2.1; 12: -1 - 2 * (5 - 4) / 10 = -1.2
    assert new == pytest.approx({11: 5.0 + 2.1, 12: 5.0 - 1.2})
    odds = np.exp(new[11] - step.l_top1)
    assert odds == pytest.approx(np.exp(scorer.utility(cands[11], *logits[11], step)))
    assert scorer_with().rescore(cands, logits, step) == {11: 5.0, 12: 5.0}
    assert not scorer_with().active and scorer.active and scorer.span == 4


def test_scorer_validates_and_round_trips():
    scorer = scorer_with(bias=0.25, agree=1.5, **{"5a": -2.0}).with_confidence({0: (1.2, 0.1), 5: (0.5, 1.0)})
    d = scorer.to_dict()
    assert d["scorer"]["weights"]["5a"] == -2.0 and d["confidence"]["5"] == [0.5, 1.0]
    assert copy_rule_from_dict(d) == scorer
    assert copy_rule_from_dict(PRIOR.to_dict()) == PRIOR and copy_rule_from_dict(None) is None
    with pytest.raises(ValueError, match="weights"):
        CopyScorer(ORDERS, (0.0,) * 3)
    bad = {"scorer": {"orders": [2, 3], "weights": d["scorer"]["weights"]}}  # weights of another order set
    with pytest.raises(ValueError, match="do not match"):
        copy_rule_from_dict(bad)


def test_fit_copy_scorer_recovers_a_known_conditional_logit():
    """Decisions drawn from a known rule (the top-1 at utility 0, each candidate at w . phi) with
    a fixed seed: the fit recovers w, and its decisions agree with the true rule's."""
    rng = np.random.default_rng(0)
    names = scorer_features(ORDERS)
    true = np.zeros(len(names))
    true[[names.index(n) for n in ("bias", "gap", "2u", "3c", "agree", "confidence")]] = [1.0, -4.0, -1.5, 2.0, 1.0, 0.8]
    decisions = []
    for _ in range(6000):
        m = int(rng.integers(1, 4))
        phi = np.zeros((m, len(names)))
        phi[:, 0] = 1.0
        phi[:, 1] = rng.uniform(0, 2, m)
        phi[np.arange(m), 2 + rng.integers(0, 3 * len(ORDERS), m)] = 1.0
        phi[:, names.index("agree")] = rng.integers(1, 4, m) / 4
        phi[:, names.index("confidence")] = rng.normal(0, 1, m)
        u = np.concatenate([[0.0], phi @ true])
        p = np.exp(u - u.max())
        decisions.append((phi.tolist(), int(rng.choice(m + 1, p=p / p.sum()))))
    scorer, info = fit_copy_scorer(decisions, ORDERS, l2=1e-6)
    fitted = np.array(scorer.weights)
    for n in ("bias", "gap", "2u", "3c", "agree", "confidence"):
        assert fitted[names.index(n)] == pytest.approx(true[names.index(n)], abs=0.35), n
    assert info["decisions"] == 6000 and 0.0 < info["top1_right"] < 1.0
    agree = np.mean([np.argmax(np.concatenate([[0.0], np.array(f) @ fitted])) == np.argmax(np.concatenate([[0.0], np.array(f) @ true]))
                     for f, _ in decisions])
    assert agree > 0.95
