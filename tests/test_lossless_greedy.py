"""Greedy speculative output must equal plain greedy decoding, token for token."""

from __future__ import annotations

import pytest
import torch

from dspark.cost_model import BatchCostTable, CostTable
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.generator import DSparkGenerator
from dspark.models import wrap_model
from dspark.schedulers import DSparkScheduler, Threshold, make_scheduler
from tests.conftest import tiny_model

# A cost table under which verifying is cheap enough that `dspark` does speculate.
CHEAP_VERIFY = CostTable((1, 8, 64, 256), (0.010, 0.011, 0.020, 0.060))
# The same for a forward that packs ragged rows: widening the block is cheap, a token cheaper.
CHEAP_RAGGED = BatchCostTable.monotone(
    [1, 2, 4, 8], [1, 2, 4, 8], [[0.010, 0.010, 0.011, 0.012], [0.011, 0.011, 0.012, 0.014], [0.012, 0.013, 0.016, 0.020], [0.014, 0.016, 0.022, 0.035]],
    one_wide=[[0.010, 0.010, 0.011, 0.012], [0.011, 0.011, 0.012, 0.013], [0.012, 0.012, 0.013, 0.014], [0.014, 0.014, 0.015, 0.016]],
)
SCHEDULERS = ["ar", "fixed:1", "fixed:4", "threshold:0.7", "threshold:0.9", "threshold:0.3", "util", "dspark", "dspark-packed", "dspark-ragged"]


def scheduler(name: str, max_depth: int = 8):
    if name == "dspark":
        return DSparkScheduler(cost=CHEAP_VERIFY, max_depth=max_depth)
    if name == "dspark-packed":
        return DSparkScheduler(cost=CHEAP_VERIFY, packed=True, max_depth=max_depth)
    if name == "dspark-ragged":
        return DSparkScheduler(cost=CHEAP_RAGGED, max_depth=max_depth)
    if name.startswith("threshold:"):
        return Threshold(float(name.partition(":")[2]), max_depth=max_depth)
    return make_scheduler(name)


def ragged_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths, with repeats so n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        base = torch.randint(10, 400, (2 + 3 * i % 11,), generator=g).tolist()
        prompts.append(base * (1 + i % 3) + base[: i % 4])
    return prompts


def hf_greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    x = torch.tensor([prompt], device=target.device)
    out = target.model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=target.eos_token_ids,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def references(tiny_llama, tiny_qwen2):
    prompts = ragged_prompts(8)
    return {
        "llama": (prompts, [hf_greedy(tiny_llama, p, 20) for p in prompts]),
        "qwen2": (prompts, [hf_greedy(tiny_qwen2, p, 20) for p in prompts]),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("sched", SCHEDULERS)
def test_ngram_greedy_equals_plain_greedy(arch, batch_size, sched, references, tiny_llama, tiny_qwen2):
    target = tiny_llama if arch == "llama" else tiny_qwen2
    prompts, expected = references[arch]
    gen = DSparkGenerator(target, NgramDrafter(), scheduler(sched), max_batch_size=batch_size)
    results = gen.generate(prompts, max_new_tokens=20)
    assert [r.token_ids for r in results] == expected
    if sched not in ("ar",):
        assert sum(r.stats.verified for r in results) > 0, "the test must exercise verification"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("sched", ["fixed:3", "threshold:0.3", "util", "dspark"])
@pytest.mark.parametrize("draft_kind", ["same", "other"])
def test_draft_model_greedy_equals_plain_greedy(arch, batch_size, sched, draft_kind, references, tiny_llama, tiny_qwen2):
    """Drafting with the target itself accepts everything; an unrelated model rejects most."""
    target = tiny_llama if arch == "llama" else tiny_qwen2
    prompts, expected = references[arch]
    if draft_kind == "same":
        draft = target
    else:
        draft = wrap_model(tiny_model(arch, target.vocab_size, seed=7, hidden=32, layers=1, sharpen=16.0), target.tokenizer, "other")
    # drafting costs one draft-model forward per depth: keep trees shallow to keep tests quick
    gen = DSparkGenerator(target, DraftModelDrafter(draft, target), scheduler(sched, max_depth=4), max_batch_size=batch_size)
    results = gen.generate(prompts, max_new_tokens=20)
    assert [r.token_ids for r in results] == expected
    verified = sum(r.stats.verified for r in results)
    if draft_kind == "same" or sched.startswith("fixed"):
        # an unrelated model's confidence may rightly stay under a threshold; the target
        # drafting for itself is confident and always right
        assert verified > 0
    if draft_kind == "same" and sched.startswith("fixed"):
        assert sum(r.stats.accepted for r in results) == verified


def test_more_requests_than_batch_slots_and_mixed_lengths(tiny_llama):
    """Continuous batching: 11 requests through 4 slots, different max lengths finishing early."""
    prompts = ragged_prompts(11, seed=3)
    expected = [hf_greedy(tiny_llama, p, 24) for p in prompts]
    gen = DSparkGenerator(tiny_llama, NgramDrafter(), DSparkScheduler(cost=CHEAP_VERIFY), max_batch_size=4)
    results = gen.generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in results] == expected
    short = gen.generate(prompts, max_new_tokens=5)
    assert [r.token_ids for r in short] == [e[:5] for e in expected]
    assert all(r.finish_reason in ("length", "eos") for r in short)


def embedded_runs(target, prompts: list[str], drafter: str, sched: str, new_tokens: int = 32):
    """The engine's results for chat prompts at batch 3, and transformers' greedy token ids."""
    ids = [target.encode(p) for p in prompts]
    expected = [hf_greedy(target, p, new_tokens) for p in ids]
    results = DSparkGenerator(target, drafter, scheduler(sched), max_batch_size=3).generate(ids, max_new_tokens=new_tokens)
    return results, expected


@pytest.mark.embedded
@pytest.mark.parametrize("sched", ["ar", "fixed:4", "threshold:0.7", "dspark", "dspark-ragged"])
def test_embedded_smollm2_fp32(embedded_fp32, sched):
    """The shipped default target, fp32, real chat prompts: identical to transformers greedy."""
    prompts = [
        "Summarise in one sentence: The city council voted on Tuesday to expand the bike lane network.",
        "Write a Python function that returns the factorial of n.",
        "What is 17 times 23?",
    ]
    results, expected = embedded_runs(embedded_fp32, prompts, "ngram", sched)
    assert [r.token_ids for r in results] == expected


@pytest.mark.embedded
@pytest.mark.parametrize("drafter", ["dspark", "dspark+ngram"])
def test_embedded_smollm2_fp32_with_the_shipped_drafter(embedded_fp32, drafter):
    """The shipped DSpark drafter (reduced vocabulary, learned copy decision) with the dspark scheduler:
    identical to transformers greedy, on prompts whose answers repeat the prompt's words."""
    prompts = [
        "Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
        "Write a Python function is_even(n) and then a second function is_odd(n) that calls is_even.",
        "Summarise in one sentence: Maria Gonzalez, the mayor of Springfield, opened the new Springfield library.",
    ]
    results, expected = embedded_runs(embedded_fp32, prompts, drafter, "dspark")
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted for r in results) > 0
