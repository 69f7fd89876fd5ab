"""The draft gate: drafting only while it pays, decided from past rounds, never changing output."""

from __future__ import annotations

import time

import pytest

from dspark.cost_model import CostTable
from dspark.draft_gate import DraftGate
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Request, SpeculativeEngine
from dspark.generator import DSparkGenerator
from dspark.schedulers import DSparkScheduler
from dspark.tree import DraftTree

# 10 ms per plain round whatever the batch: normalised times are then seconds / 10 ms
FLAT = CostTable((1, 256), (0.010, 0.010))


def test_a_costly_drafter_with_little_gain_is_skipped_with_doubling_pauses():
    gate = DraftGate(FLAT.latency, max_skip=4)
    decisions = []
    for _ in range(14):
        drafts = gate.should_draft()
        decisions.append(drafts)
        # a drafting round takes 2 plain rounds' time and every draft is rejected
        gate.record(rows=1, seconds=0.020 if drafts else 0.010, emitted=1, drafted=drafts, propose_s=0.010 if drafts else 0.0)
    # probe, skip 1, probe, skip 2, probe, skip 4, probe, skip 4 (the cap) ...
    assert decisions == [True, False, True, False, False, True, False, False, False, False, True, False, False, False]
    assert gate.expected_speedup() < 1.0 and decisions.count(False) == 10


def test_a_drafter_that_pays_drafts_every_round():
    gate = DraftGate(FLAT.latency)
    for _ in range(20):
        assert gate.should_draft()
        gate.record(rows=4, seconds=0.014, emitted=4 * 2, drafted=True, propose_s=0.003)  # +40% time, 2x tokens
    assert gate.expected_speedup() == pytest.approx(2.0 / 1.4)


def test_a_paying_probe_resets_the_pause():
    gate = DraftGate(FLAT.latency, alpha=1.0)  # alpha 1: each round replaces the averages
    gate.record(rows=1, seconds=0.030, emitted=1, drafted=True, propose_s=0.020)  # useless: pause 1
    assert not gate.should_draft() and gate.should_draft()
    gate.record(rows=1, seconds=0.030, emitted=1, drafted=True, propose_s=0.020)  # useless again: pause 2
    assert [gate.should_draft() for _ in range(3)] == [False, False, True]
    gate.record(rows=1, seconds=0.012, emitted=3, drafted=True, propose_s=0.002)  # pays: no pause
    assert gate.should_draft()
    gate.record(rows=1, seconds=0.030, emitted=1, drafted=True, propose_s=0.020)  # useless: pause starts at 1 again
    assert [gate.should_draft() for _ in range(2)] == [False, True]


def test_a_probe_is_judged_on_the_text_after_the_pause():
    """Averages dragged down by a hard stretch do not outvote a paying probe: the probe's round
    replaces them, so drafting resumes at once where the text got easy again."""
    gate = DraftGate(FLAT.latency)  # default alpha: averages move slowly
    for _ in range(30):  # a long hard stretch: every draft rejected, rounds 1.5x as long
        if gate.should_draft():
            gate.record(rows=1, seconds=0.015, emitted=1, drafted=True, propose_s=0.003)
        else:
            gate.record(rows=1, seconds=0.010, emitted=1, drafted=False, propose_s=0.0)
    assert gate.skip_left > 0 or gate.next_skip > 1  # it paused
    while not gate.should_draft():  # sit out the pause with plain rounds
        gate.record(rows=1, seconds=0.010, emitted=1, drafted=False, propose_s=0.0)
    gate.record(rows=1, seconds=0.015, emitted=4, drafted=True, propose_s=0.003)  # the probe pays: 4 tokens
    assert gate.expected_speedup() == pytest.approx(4 / 1.5)
    assert all(gate.should_draft() for _ in range(3))  # no pause
    # a round that is not a probe joins the averages at alpha
    gate.record(rows=1, seconds=0.015, emitted=1, drafted=True, propose_s=0.003)
    assert gate.gain == pytest.approx(3.0 + gate.alpha * (0.0 - 3.0))


def test_plain_rounds_set_the_yardstick_and_batch_size_is_normalised_away():
    table = CostTable((1, 8), (0.010, 0.024))
    gate = DraftGate(table.latency, alpha=1.0)
    gate.record(rows=8, seconds=0.240, emitted=8, drafted=False, propose_s=0.0)  # the first: warm-up, left out
    assert gate.plain == 1.0
    gate.record(rows=8, seconds=0.048, emitted=8, drafted=False, propose_s=0.0)  # plain rounds run 2x the table
    gate.record(rows=8, seconds=0.072, emitted=8 * 2, drafted=True, propose_s=0.010)  # 1.5x plain time, 2x tokens
    assert gate.expected_speedup() == pytest.approx(2.0 * 2.0 / 3.0)


def test_one_slow_plain_round_does_not_make_every_draft_look_cheap():
    """Plain rounds come only from pauses, and the first pays one-off costs (kernels packed on
    first call). As the yardstick it would make a losing drafter look like a win, so that
    drafting is never paused again. The first is left out, later ones move the table's word,
    and the losing drafter is paused."""
    gate = DraftGate(FLAT.latency)
    gate.record(rows=16, seconds=0.040, emitted=16 * 2, drafted=True, propose_s=0.005)  # cold, 4x: pause
    assert not gate.should_draft()
    gate.record(rows=16, seconds=0.024, emitted=16, drafted=False, propose_s=0.0)  # a cold plain round
    assert gate.plain == 1.0  # the table's word still
    decisions = []
    for _ in range(40):  # warm: drafting rounds 2.6x a plain round for 2.2 tokens a row (0.85x)
        drafts = gate.should_draft()
        decisions.append(drafts)
        gate.record(rows=16, seconds=0.026 if drafts else 0.010, emitted=int(16 * (2.2 if drafts else 1)), drafted=drafts,
                    propose_s=0.004 if drafts else 0.0)
    assert decisions.count(False) > 20  # paused most of the time
    assert gate.plain < 1.1 and gate.expected_speedup() < 0.95


def test_a_cheap_drafter_is_never_gated_and_a_near_tie_does_not_pause():
    """n-gram lookup costs ~1% of a step: the scheduler screens its drafts round by round for
    free, so even rounds that on average lose a little (mis-priced verification) keep drafting."""
    gate = DraftGate(FLAT.latency, alpha=1.0)
    for _ in range(10):
        assert gate.should_draft()
        gate.record(rows=1, seconds=0.012, emitted=1, drafted=True, propose_s=0.0003)
    assert gate.expected_speedup() < 0.9
    costly = DraftGate(FLAT.latency, alpha=1.0)
    costly.record(rows=1, seconds=0.0102, emitted=1, drafted=True, propose_s=0.003)  # speedup 0.98
    assert costly.should_draft()  # within the 5% margin: no pause
    costly.record(rows=1, seconds=0.0110, emitted=1, drafted=True, propose_s=0.003)  # speedup 0.91
    assert not costly.should_draft()


# --- in the engine ---------------------------------------------------------------------------
class _ScriptedDrafter(NgramDrafter):
    """Proposes `reference` tokens (the target's own greedy continuation: always accepted) or
    wrong ones (always rejected), with full confidence, taking `delay_s` per call."""

    def __init__(self, reference: list[int] | None, delay_s: float):
        super().__init__()
        self.reference, self.delay_s, self.calls = reference, delay_s, 0

    def propose(self, requests, max_depth):
        self.calls += 1
        time.sleep(self.delay_s)
        trees = []
        for r in requests:
            n = len(r.token_ids)
            if self.reference is not None:
                tokens = self.reference[n : n + max_depth] or [1]
            else:
                tokens = [(t + 1) % 100 for t in r.token_ids[-1:] * max_depth]
            trees.append(DraftTree.chain(tokens, [1.0] * len(tokens)))
        return trees


def _run(target, drafter, gate: bool, max_new_tokens: int = 48):
    scheduler = DSparkScheduler(cost=FLAT)
    engine = SpeculativeEngine(target, drafter, scheduler, max_batch_size=1, draft_gate=gate)
    [req] = engine.run([Request(0, [5, 6, 7, 5, 6], max_new_tokens=max_new_tokens)])
    return req


def test_engine_stops_paying_for_a_slow_useless_drafter_and_output_is_unchanged(tiny_llama):
    [plain] = DSparkGenerator(tiny_llama, None, "ar").generate([[5, 6, 7, 5, 6]], max_new_tokens=48)
    ungated = _ScriptedDrafter(None, delay_s=0.05)
    req = _run(tiny_llama, ungated, gate=False)
    # the first token comes from the prefill, so 47 rounds make 48 tokens; a draft every round
    # but the last, which has one token left to make and no room for a draft
    assert req.output_ids == plain.token_ids and ungated.calls == 46
    gated = _ScriptedDrafter(None, delay_s=0.05)
    req = _run(tiny_llama, gated, gate=True)
    assert req.output_ids == plain.token_ids
    # probes at doubling intervals (1, 2, 4, 8, 16 rounds apart): 6 or 7 drafts in 47 rounds
    assert gated.calls <= 8
    assert req.stats.drafted_rounds == gated.calls and req.stats.draft_share < 0.2


def test_engine_keeps_drafting_when_drafts_are_accepted(tiny_llama):
    [plain] = DSparkGenerator(tiny_llama, None, "ar").generate([[5, 6, 7, 5, 6]], max_new_tokens=48)
    oracle = _ScriptedDrafter([5, 6, 7, 5, 6] + plain.token_ids, delay_s=0.0)
    req = _run(tiny_llama, oracle, gate=True)
    assert req.output_ids == plain.token_ids
    assert req.stats.draft_share == 1.0 and req.stats.accepted == req.stats.verified > 0
    assert req.stats.rounds <= 48 // 9 + 1  # 8 accepted + 1 bonus token per round


def test_only_cost_aware_schedulers_gate_by_default(tiny_llama):
    drafter = NgramDrafter()
    assert SpeculativeEngine(tiny_llama, drafter, DSparkScheduler(cost=FLAT)).gate is not None
    assert SpeculativeEngine(tiny_llama, drafter, DSparkScheduler(cost=FLAT, gate=False)).gate is None
    gen = DSparkGenerator(tiny_llama, drafter, "fixed:3")
    assert SpeculativeEngine(tiny_llama, drafter, gen.scheduler).gate is None
    with pytest.raises(ValueError, match="cost table"):
        SpeculativeEngine(tiny_llama, drafter, gen.scheduler, draft_gate=True)


def test_the_generator_keeps_what_its_gate_learned_across_calls(tiny_llama):
    [plain] = DSparkGenerator(tiny_llama, None, "ar").generate([[5, 6, 7, 5, 6]], max_new_tokens=24)
    drafter = _ScriptedDrafter(None, delay_s=0.05)
    gen = DSparkGenerator(tiny_llama, drafter, DSparkScheduler(cost=FLAT))
    assert gen.draft_gate is not None
    [first] = gen.generate([[5, 6, 7, 5, 6]], max_new_tokens=24)
    first_calls, drafter.calls = drafter.calls, 0
    [second] = gen.generate([[5, 6, 7, 5, 6]], max_new_tokens=24)
    assert first.token_ids == second.token_ids == plain.token_ids
    assert first_calls == 5 and drafter.calls <= 2  # probes at rounds 1, 3, 6, 11, 20; then a long pause
    assert DSparkGenerator(tiny_llama, drafter, DSparkScheduler(cost=FLAT, gate=False)).draft_gate is None
