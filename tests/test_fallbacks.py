"""Per-row results under failure (`dspark.fallbacks`) and the library API built on it
(`DSparkGenerator.generate_each`): a bad row costs only itself, running out of memory shrinks
the batch and then drops speculation, and no retry changes an output."""

from __future__ import annotations

import math


from dspark.fallbacks import Attempt, after_out_of_memory, call_with_fallbacks, is_out_of_memory
from dspark.generator import DSparkGenerator, GenerationResult, PromptError


class OutOfMemoryError(RuntimeError):  # the name torch.OutOfMemoryError has
    pass


def test_failing_rows_are_isolated_and_the_rest_complete():
    calls = []

    def call(items):
        calls.append(list(items))
        if any(i in (3, 11) for i in items):
            raise RuntimeError("poisoned")
        return [i * 10 for i in items]

    results = call_with_fallbacks(lambda items, _: call(items), list(range(16)), Attempt(4))
    assert [r for r in results if not isinstance(r, Exception)] == [i * 10 for i in range(16) if i not in (3, 11)]
    assert [i for i, r in enumerate(results) if isinstance(r, Exception)] == [3, 11]
    assert len(calls) <= 1 + 2 * 2 * math.ceil(math.log2(16))  # halving: O(bad * log n) calls


def test_wrong_result_count_counts_as_a_failure():
    results = call_with_fallbacks(lambda items, _: items[:1], ["a", "b"], Attempt(4))
    assert results == ["a", "b"]  # split to single rows, where one result per row is right


def test_out_of_memory_attempts_shrink_to_one_row_then_drop_speculation():
    assert after_out_of_memory(Attempt(16)) == Attempt(8)
    assert after_out_of_memory(Attempt(3)) == Attempt(1)
    assert after_out_of_memory(Attempt(1)) == Attempt(1, speculate=False)
    assert after_out_of_memory(Attempt(1, speculate=False)) is None


def test_out_of_memory_halves_the_batch_then_drops_speculation_then_gives_up_on_the_row():
    """Memory runs out when more than 2 rows decode together while speculating, and on the row
    "huge" whatever the settings: the call is retried at 2 rows, then "big" (which needs no
    speculation) and "huge" go on without speculation, and only "huge" is given up on."""
    calls = []

    def call(items, attempt):
        calls.append((tuple(items), attempt))
        if "huge" in items or (attempt.speculate and (attempt.batch_size > 2 or "big" in items)):
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [f"{'spec' if attempt.speculate else 'ar'}:{i}" for i in items]

    events = []
    results = call_with_fallbacks(call, ["a", "b", "big", "c", "huge", "d"], Attempt(16),
                                  on_retry=lambda kind, n, attempt, exc: events.append((kind, n, attempt)))
    assert results[:4] + results[5:] == ["ar:a", "ar:b", "ar:big", "ar:c", "ar:d"]
    assert isinstance(results[4], OutOfMemoryError) and is_out_of_memory(results[4])
    # the exact sequence: width 6 (the call's rows) -> 3 -> 1 -> no speculation -> isolate by halving
    assert [a for _, a in calls[:4]] == [Attempt(6), Attempt(3), Attempt(1), Attempt(1, speculate=False)]
    assert events[:3] == [("halve_batch", 6, Attempt(3)), ("halve_batch", 6, Attempt(1)),
                          ("no_speculation", 6, Attempt(1, speculate=False))]
    assert ("split", 6, Attempt(1, speculate=False)) in events
    assert all(not a.speculate for _, a in calls[3:])  # a half never goes back to speculating


def test_out_of_memory_in_a_half_after_a_plain_error_still_halves():
    def call(items, attempt):
        if "poison" in items:
            raise RuntimeError("boom")
        if attempt.batch_size > 1:
            raise OutOfMemoryError("out of memory")
        return [f"{attempt.batch_size}:{i}" for i in items]

    results = call_with_fallbacks(call, ["a", "poison", "b", "c"], Attempt(4))
    assert isinstance(results[1], RuntimeError) and not is_out_of_memory(results[1])
    assert [results[0], results[2], results[3]] == ["1:a", "1:b", "1:c"]
    # other errors never trigger the no-speculation retry on their own
    tried = []
    plain = call_with_fallbacks(lambda items, attempt: tried.append(attempt) or 1 / 0, ["x"], Attempt(4))
    assert isinstance(plain[0], ZeroDivisionError) and tried == [Attempt(1)]


class OutOfMemoryAboveTwoRows(DSparkGenerator):
    """The real engine, out of memory whenever more than 2 rows decode together while
    speculating, and on a prompt starting with token 7 whatever the settings."""

    def generate(self, prompts, **kwargs):
        width = min(self.max_batch_size, len(prompts))
        if any(p[0] == 7 for p in prompts) or (self.scheduler.max_depth > 0 and width > 2):
            raise OutOfMemoryError(f"CUDA out of memory (injected at {width} rows)")
        return super().generate(prompts, **kwargs)


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21]]


def test_generate_each_gives_each_row_its_result_or_its_own_error(tiny_llama):
    gen = DSparkGenerator(tiny_llama, "ngram", "fixed:3", max_batch_size=4)
    empty, too_big = [], [tiny_llama.vocab_size + 5]
    results = gen.generate_each([*PROMPTS[:2], empty, PROMPTS[2], too_big], max_new_tokens=8)
    assert isinstance(results[2], PromptError) and results[2].kind == "empty_prompt"
    assert isinstance(results[4], PromptError) and results[4].kind == "bad_token_id"
    plain = DSparkGenerator(tiny_llama, None, "ar").generate(PROMPTS[:3], max_new_tokens=8)
    assert [r.token_ids for r in (results[0], results[1], results[3])] == [r.token_ids for r in plain]


def test_generate_each_out_of_memory_halves_then_drops_speculation_and_changes_no_output(tiny_llama):
    gen = OutOfMemoryAboveTwoRows(tiny_llama, "ngram", "fixed:3", max_batch_size=4)
    events = []
    prompts = [*PROMPTS, [7, 1, 2]]
    results = gen.generate_each(prompts, max_new_tokens=8, on_retry=lambda kind, n, attempt, exc: events.append((kind, attempt)))
    assert events[0] == ("halve_batch", Attempt(2))  # 4 rows together -> 2, which fits
    assert isinstance(results[-1], OutOfMemoryError)  # [7, ...] runs out of memory at any size
    assert ("no_speculation", Attempt(1, speculate=False)) in events
    plain = DSparkGenerator(tiny_llama, None, "ar").generate(PROMPTS, max_new_tokens=8)
    assert all(isinstance(r, GenerationResult) for r in results[:-1])
    assert [r.token_ids for r in results[:-1]] == [r.token_ids for r in plain]


def test_generate_each_keeps_each_rows_seed_through_retries(tiny_llama):
    sampled = dict(max_new_tokens=8, temperature=1.0, seeds=[11, 12, 13, 14, 15])
    alone = [DSparkGenerator(tiny_llama, "ngram", "fixed:3").generate([p], **{**sampled, "seeds": [s]})[0]
             for p, s in zip(PROMPTS, sampled["seeds"])]
    retried = OutOfMemoryAboveTwoRows(tiny_llama, "ngram", "fixed:3", max_batch_size=4).generate_each(PROMPTS, **sampled)
    assert [r.token_ids for r in retried] == [r.token_ids for r in alone]
