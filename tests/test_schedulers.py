"""Schedulers: Algorithm 1 against brute force, the no-peeking property, and the simple policies."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.cost_model import BatchCostTable, CostTable
from dspark.schedulers import (
    FixedLength,
    NoSpeculation,
    Threshold,
    UtilizationAdaptive,
    make_scheduler,
    DSparkScheduler,
    packed_tokens,
    prefix_schedule,
    ragged_width_schedule,
    threshold_count,
    width_schedule,
)
from dspark.tree import DraftTree, top_survival_nodes


def survival_rows(draw_conf):
    return [list(itertools.accumulate(row, lambda a, c: a * c)) for row in draw_conf]


confidences = st.lists(
    st.lists(st.floats(0.05, 1.0), min_size=0, max_size=4), min_size=1, max_size=3
)
# Unimodal throughput: latency flat (memory-bound) up to a knee, then rising convexly.
cost_curves = st.tuples(st.floats(0.005, 0.05), st.integers(1, 12), st.floats(1e-4, 0.02), st.floats(0.0, 1e-3))


def latency_fn(curve):
    base, knee, slope, curv = curve
    return lambda b: base + slope * max(0, b - knee) + curv * max(0, b - knee) ** 2


def theta(lengths, survival, latency):
    tau = sum(1 + sum(row[:l]) for row, l in zip(survival, lengths))
    return tau / latency(packed_tokens(lengths))


@settings(max_examples=300, deadline=None)
@given(confidences, cost_curves)
def test_prefix_schedule_matches_brute_force(conf, curve):
    survival = survival_rows(conf)
    latency = latency_fn(curve)
    chosen = prefix_schedule(survival, lambda b: 1.0 / latency(b))
    best = max(
        theta(ls, survival, latency) for ls in itertools.product(*[range(len(r) + 1) for r in survival])
    )
    assert theta(chosen, survival, latency) >= best * (1 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(confidences, cost_curves, st.data())
def test_admission_of_position_j_never_depends_on_later_tokens(conf, curve, data):
    """Changing confidences after position j (they encode tokens drafted at >= j) must not
    change whether position j is verified."""
    latency = latency_fn(curve)
    sps = lambda b: 1.0 / latency(b)  # noqa: E731
    r = data.draw(st.integers(0, len(conf) - 1))
    if not conf[r]:
        return
    j = data.draw(st.integers(0, len(conf[r]) - 1))
    new_tail = data.draw(st.lists(st.floats(0.05, 1.0), min_size=0, max_size=4))
    changed = [list(row) for row in conf]
    changed[r] = conf[r][: j + 1] + new_tail
    by_width = lambda w: sps(len(conf) * w)  # noqa: E731
    ragged = lambda lengths: latency(sum(lengths)) + 0.3 * curve[2] * len(lengths) * max(lengths)  # noqa: E731
    for schedule, price in ((prefix_schedule, sps), (width_schedule, by_width), (ragged_width_schedule, ragged)):
        before = schedule(survival_rows(conf), price)
        after = schedule(survival_rows(changed), price)
        assert (before[r] > j) == (after[r] > j), schedule.__name__


@settings(max_examples=200, deadline=None)
@given(confidences, cost_curves)
def test_ragged_schedule_is_the_width_schedule_when_padding_is_what_costs(conf, curve):
    """Priced by the widest row alone (a padded forward), admitting every ready row of a column
    is free once the column is paid for: the ragged search then makes the width schedule's choice."""
    survival = survival_rows(conf)
    latency = latency_fn(curve)
    rows = len(survival)
    padded = ragged_width_schedule(survival, lambda lengths: latency(rows * max(lengths)))
    assert padded == width_schedule(survival, lambda w: 1.0 / latency(rows * w))


def test_ragged_schedule_verifies_confident_rows_deep_and_skips_weak_ones():
    # per token 5% of a round, widening 2% per column: two confident rows, two hopeless ones
    survival = survival_rows([[0.95] * 6, [0.15] * 6, [0.9] * 6, [0.1] * 6])
    price = lambda lengths: 1.0 + 0.05 * (sum(lengths) - len(lengths)) + 0.02 * (max(lengths) - 1)  # noqa: E731
    lengths = ragged_width_schedule(survival, price)
    assert lengths[1] == lengths[3] == 0
    assert lengths[0] >= 4 and lengths[2] >= 3
    # the padded schedule must give the weak rows the same width as the strong ones
    padded = width_schedule(survival, lambda w: 1.0 / price([w] * 4))
    assert len(set(padded)) == 1


def test_dspark_scheduler_prices_ragged_rows_where_the_table_does():
    seconds = [[0.010, 0.011, 0.012], [0.020, 0.040, 0.060]]
    one_wide = [[0.010, 0.011, 0.012], [0.020, 0.022, 0.024]]
    ragged = BatchCostTable.monotone([1, 4], [1, 2, 3], seconds, context=64, one_wide=one_wide)
    padded = BatchCostTable.monotone([1, 4], [1, 2, 3], seconds, context=64)
    trees = [tree_with([0.95, 0.95], [-1, 0])] + [tree_with([0.2, 0.2], [-1, 0]) for _ in range(3)]
    # padded: widening every row to 2 costs 2x for ~0.95 + 3 x 0.2 more tokens: not worth it
    assert DSparkScheduler(cost=padded).budgets(trees) == [0, 0, 0, 0]
    # packed: the confident row alone goes 2 deep for 10-20% more
    assert DSparkScheduler(cost=ragged).budgets(trees) == [2, 0, 0, 0]
    assert DSparkScheduler(cost=ragged, packed=False).budgets(trees) == [0, 0, 0, 0]


def test_prefix_schedule_verifies_more_when_verification_is_cheap():
    survival = survival_rows([[0.9, 0.9, 0.9, 0.5]] * 4)
    free = prefix_schedule(survival, lambda b: 1.0)  # flat latency: verifying is free
    costly = prefix_schedule(survival, lambda b: 1.0 / b)  # latency proportional to tokens
    assert free == [4, 4, 4, 4]
    assert costly == [0, 0, 0, 0]


def test_width_schedule_budget_falls_as_load_rises():
    """The paper's Figure 8 shape: with a memory-bound-then-compute-bound cost, more rows
    means a shorter verify budget."""
    table = CostTable((1, 16, 32, 64, 128, 256), (0.02, 0.021, 0.03, 0.05, 0.09, 0.17))
    row = [list(itertools.accumulate([0.8] * 8, lambda a, c: a * c))]
    budgets = [width_schedule(row * n, lambda w: 1.0 / table.round_latency(n, w))[0] for n in (1, 4, 16, 32)]
    assert budgets == sorted(budgets, reverse=True)
    assert budgets[0] > budgets[-1]


def tree_with(conf: list[float], parents: list[int]) -> DraftTree:
    t = DraftTree()
    for i, (c, p) in enumerate(zip(conf, parents)):
        t.add(100 + i, p, c)
    return t


def test_threshold_stops_at_first_low_confidence_on_each_path():
    chain = DraftTree.chain([1, 2, 3, 4], [0.95, 0.8, 0.6, 0.99])
    assert threshold_count(chain, 0.7) == 2
    assert threshold_count(chain, 0.9) == 1
    tree = tree_with([0.9, 0.8, 0.5, 0.95], [-1, 0, -1, 2])  # second branch fails at its root
    assert threshold_count(tree, 0.7) == 2
    assert Threshold(0.7).budgets([chain, tree]) == [2, 2]


def test_top_survival_nodes_is_ancestor_closed():
    tree = tree_with([0.9, 0.9, 0.3, 0.99, 0.5], [-1, 0, -1, 1, 2])
    for budget in range(len(tree) + 1):
        keep = top_survival_nodes(tree, budget)
        assert len(keep) == budget
        assert all(tree.parents[k] in keep or tree.parents[k] == -1 for k in keep)


def test_fixed_and_ar():
    chain = DraftTree.chain([1, 2, 3], [0.1, 0.1, 0.1])
    assert FixedLength(2).budgets([chain, DraftTree()]) == [2, 0]
    assert NoSpeculation().budgets([chain]) == [0]
    assert make_scheduler("fixed:5").max_depth == 5


def test_util_policy_lengthens_when_idle_and_shortens_when_busy():
    readings = iter([0.3, 0.3, 0.9, 0.9, 0.9, None])
    sched = UtilizationAdaptive(probe=lambda: next(readings), start=2.0, max_len=4.0, min_len=1.0)
    chain = DraftTree.chain(list(range(8)), [0.9] * 8)
    lengths = [sched.budgets([chain])[0] for _ in range(6)]
    assert lengths == [3, 4, 3, 2, 1, 1]  # 2*1.5=3, 4.5->cap 4, 4*.7=2.8, 1.96, 1.37, unchanged
    assert [round(l, 2) for _, l in sched.history][:3] == [3.0, 4.0, 2.8]


def test_bad_scheduler_names_are_clear_errors():
    import pytest

    for bad in ("fixed:0", "threshold:2", "nope", "fixed:x"):
        with pytest.raises(ValueError):
            make_scheduler(bad)


def test_cost_table_is_monotone_and_interpolates():
    t = CostTable.monotone([1, 4, 8], [0.01, 0.009, 0.02])
    assert t.seconds == (0.01, 0.01, 0.02)
    assert abs(t.latency(6) - 0.015) < 1e-12
    assert t.latency(16) > t.latency(8)


def test_cost_table_profiled_on_a_busy_machine_is_measured_again(tmp_path, monkeypatch, tiny_llama):
    import json

    from dspark import cost_model

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DSPARK_REPROFILE", raising=False)
    fresh = cost_model.load_or_profile(tiny_llama, max_rows=3, context=16)
    assert fresh.rows == (1, 2, 4) and fresh.widths == cost_model.PROFILE_WIDTHS
    [path] = (tmp_path / "cost_tables").glob("*.json")
    data = json.loads(path.read_text())
    data["seconds"] = [[s / 1000 for s in line] for line in data["seconds"]]  # faster than any re-timing: kept
    path.write_text(json.dumps(data))
    kept = cost_model.load_or_profile(tiny_llama, max_rows=3, context=16)
    assert kept.seconds == tuple(tuple(line) for line in data["seconds"])
    data["seconds"] = [[s * 1e6 for s in line] for line in data["seconds"]]  # 1000x slower: profiled while swamped
    path.write_text(json.dumps(data))
    again = cost_model.load_or_profile(tiny_llama, max_rows=3, context=16)
    assert again.plain_latency(1) < 100 * fresh.plain_latency(1)
    assert json.loads(path.read_text())["seconds"][0][0] < data["seconds"][0][0]


def test_cost_table_measures_the_widest_tree_the_dspark_drafter_proposes():
    """Blocks wider than the table's widest are extrapolated from its last two widths, which on
    CPU sit on the flat part of the curve: the drafter's largest tree (its node cap plus the
    anchor) must be among the widths measured, or the scheduler verifies it as if it were free."""
    from dspark import cost_model
    from dspark.dspark_drafter import DrafterOptions

    assert max(cost_model.PROFILE_WIDTHS) >= DrafterOptions().max_nodes + 1


def test_batch_cost_table_interpolates_along_widths_then_rows_and_is_monotone():
    t = BatchCostTable.monotone([1, 4], [1, 2, 4], [[0.010, 0.009, 0.014], [0.020, 0.030, 0.050]], context=64)
    assert t.seconds == ((0.010, 0.010, 0.014), (0.020, 0.030, 0.050))  # noise never makes a width cheaper
    assert t.plain_latency(1) == 0.010 and t.plain_latency(4) == 0.020
    assert t.round_latency(1, 3) == pytest.approx(0.012)  # between widths 2 and 4
    assert t.round_latency(2, 1) == pytest.approx(0.010 + (0.020 - 0.010) / 3)  # between 1 and 4 rows
    assert t.round_latency(4, 6) == pytest.approx(0.070)  # beyond the widest: linear from the last two
    assert t.round_latency(8, 1) == pytest.approx(0.020 + 4 * (0.020 - 0.010) / 3)  # beyond the most rows
    with pytest.raises(ValueError):
        BatchCostTable((1, 2), (1,), ((0.01,),))


def test_ragged_latency_runs_from_one_wide_row_to_every_row_wide():
    seconds = [[0.010, 0.012, 0.014], [0.040, 0.060, 0.080]]
    one_wide = [[0.010, 0.012, 0.014], [0.040, 0.045, 0.090]]  # noise: one wide row above all wide
    t = BatchCostTable.monotone([1, 4], [1, 2, 3], seconds, context=64, one_wide=one_wide)
    assert t.prices_ragged_rows
    assert t.one_wide[1] == (0.040, 0.045, 0.080)  # never above every row that wide
    assert t.ragged_latency([1, 1, 1, 1]) == pytest.approx(0.040)
    assert t.ragged_latency([2, 1, 1, 1]) == pytest.approx(0.045)  # measured: one row 2 wide
    assert t.ragged_latency([2, 2, 2, 2]) == pytest.approx(0.060)  # measured: every row 2 wide
    assert t.ragged_latency([2, 2, 1, 1]) == pytest.approx(0.045 + (0.060 - 0.045) / 3)  # linear in the total
    assert t.ragged_latency([3, 2, 2, 2]) == pytest.approx(0.080)  # one wide row clipped to all wide: 0.080 either way
    assert t.ragged_latency([3]) == t.round_latency(1, 3)
    plain = BatchCostTable.monotone([1, 4], [1, 2, 3], seconds, context=64)
    assert not plain.prices_ragged_rows
    assert plain.ragged_latency([2, 1, 1, 1]) == plain.round_latency(4, 2)  # a padded forward: the widest row


def test_profiled_costs_grow_with_rows_and_widths(tiny_llama):
    from dspark.cost_model import measure_batch_costs, profile_rows

    assert profile_rows(1) == (1,) and profile_rows(8) == (1, 2, 4, 8) and profile_rows(12) == (1, 2, 4, 8, 16)
    t = measure_batch_costs(tiny_llama, rows=(1, 4), widths=(1, 2, 8), context=32, reps=1)
    assert t.rows == (1, 4) and t.widths == (1, 2, 8) and t.context == 32
    assert all(s > 0 for line in t.seconds for s in line)
    assert t.prices_ragged_rows  # the lean forward on CPU packs ragged rows: one wide row measured too
    assert t.one_wide[0] == t.seconds[0] and all(o <= s for o, s in zip(t.one_wide[1], t.seconds[1]))
    assert t.round_latency(4, 8) >= t.round_latency(1, 8) >= t.plain_latency(1)


def test_profiling_takes_more_samples_where_they_are_cheap(tiny_llama, monkeypatch):
    """At least `reps` timed passes per row count; more, up to `max_reps`, while the row count
    is under its time budget (plus one warm-up pass)."""
    from dspark.cost_model import measure_batch_costs
    from dspark.runner import ModelRunner

    calls = []
    forward = ModelRunner.forward_block
    monkeypatch.setattr(ModelRunner, "forward_block", lambda self, blocks, *a, **k: calls.append(len(blocks)) or forward(self, blocks, *a, **k))
    measure_batch_costs(tiny_llama, rows=(1,), widths=(1, 2), context=16, reps=2, seconds_per_row_count=0.0, max_reps=6)
    assert calls.count(1) == 1 + (1 + 2) * 2  # the prefill, then (warm-up + 2 reps) x 2 widths
    calls.clear()
    measure_batch_costs(tiny_llama, rows=(1,), widths=(1, 2), context=16, reps=2, seconds_per_row_count=60.0, max_reps=6)
    assert calls.count(1) == 1 + (1 + 6) * 2


def test_cost_tables_of_different_models_with_the_same_shapes_are_kept_apart(tiny_llama, smol_tokenizer):
    from dspark.cost_model import _profile_key
    from dspark.models import wrap_model
    from tests.conftest import tiny_model

    twin = wrap_model(tiny_model("llama", len(smol_tokenizer), seed=99, sharpen=16.0), smol_tokenizer, tiny_llama.name)
    key = lambda target: _profile_key(target, 128, (1,), (1, 2))  # noqa: E731
    assert key(twin) != key(tiny_llama)
    assert key(tiny_llama) == key(tiny_llama)
