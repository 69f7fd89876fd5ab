"""The engine on a GPU: the lossless checks of test_lossless_* again on CUDA, and NVML readings.

Skipped where there is no CUDA device (as in CI). `DSPARK_TEST_ACCELERATOR=cpu` runs the same
checks on the CPU: that is how their own logic is checked on machines without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from dspark.cost_model import measure_batch_costs
from dspark.drafters.draft_model import DraftModelDrafter
from dspark.drafters.ngram import NgramDrafter
from dspark.generator import DSparkGenerator
from dspark.hardware import UtilizationProbe, UtilizationSampler
from dspark.models import load_model, wrap_model
from dspark.schedulers import DSparkScheduler, FixedLength
from tests.conftest import tiny_model
from tests.test_lossless_greedy import CHEAP_VERIFY, SCHEDULERS, hf_greedy, ragged_prompts, scheduler
from tests.test_lossless_sampling import DRAFTER_KINDS, check_engine_sampling, small_vocab_target_on

DEVICE = torch.device(os.environ.get("DSPARK_TEST_ACCELERATOR", "cuda"))
ON_GPU = DEVICE.type == "cuda"
pytestmark = pytest.mark.skipif(
    ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU (DSPARK_TEST_ACCELERATOR=cpu runs these checks on the CPU)"
)


@pytest.fixture(scope="module")
def targets(smol_tokenizer):
    """Tiny random Llama and Qwen2 targets in float32 on the accelerator."""
    build = {"llama": 0, "qwen2": 1}
    return {
        arch: wrap_model(tiny_model(arch, len(smol_tokenizer), seed=seed, sharpen=16.0).to(DEVICE), smol_tokenizer, f"tiny-{arch}")
        for arch, seed in build.items()
    }


@pytest.fixture(scope="module")
def references(targets):
    prompts = ragged_prompts(8)
    return {arch: (prompts, [hf_greedy(t, p, 20) for p in prompts]) for arch, t in targets.items()}


def test_targets_are_on_the_accelerator(targets):
    for t in targets.values():
        assert t.device.type == DEVICE.type and t.dtype == torch.float32


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("sched", SCHEDULERS)
def test_ngram_greedy_equals_plain_greedy(arch, batch_size, sched, targets, references):
    prompts, expected = references[arch]
    results = DSparkGenerator(targets[arch], NgramDrafter(), scheduler(sched), max_batch_size=batch_size).generate(prompts, max_new_tokens=20)
    assert [r.token_ids for r in results] == expected
    if sched != "ar":
        assert sum(r.stats.verified for r in results) > 0, "the test must exercise verification"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("sched", ["fixed:3", "dspark"])
def test_draft_model_greedy_equals_plain_greedy(arch, batch_size, sched, targets, references, smol_tokenizer):
    prompts, expected = references[arch]
    draft = wrap_model(tiny_model("llama", len(smol_tokenizer), seed=7, layers=1, sharpen=16.0).to(DEVICE), smol_tokenizer, "tiny-draft")
    gen = DSparkGenerator(targets[arch], DraftModelDrafter(draft, targets[arch]), scheduler(sched), max_batch_size=batch_size)
    results = gen.generate(prompts, max_new_tokens=20)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.verified for r in results) > 0


def test_continuous_batching(targets):
    """11 requests through 4 slots: rows leave and join the batch's KV cache on the device."""
    prompts = ragged_prompts(11, seed=3)
    expected = [hf_greedy(targets["llama"], p, 24) for p in prompts]
    gen = DSparkGenerator(targets["llama"], NgramDrafter(), DSparkScheduler(cost=CHEAP_VERIFY), max_batch_size=4)
    assert [r.token_ids for r in gen.generate(prompts, max_new_tokens=24)] == expected


# --- sampling: the chi-square checks of test_lossless_sampling, with the target on the device
@pytest.mark.parametrize("drafter_kind", DRAFTER_KINDS)
def test_sampling_matches_target_in_batches(drafter_kind):
    check_engine_sampling(small_vocab_target_on(DEVICE), drafter_kind)


# --- the embedded target --------------------------------------------------------------------
PROMPTS = [
    "Summarise in one sentence: The city council voted on Tuesday to expand the bike lane network.",
    "Write a Python function that returns the factorial of n.",
    "What is 17 times 23?",
]


@pytest.fixture(scope="module")
def embedded_fp32_here():
    return load_model("smollm2-135m-instruct", dtype="float32", device=str(DEVICE))


@pytest.mark.embedded
@pytest.mark.parametrize("drafter", ["ngram", "dspark", "dspark+ngram"])
def test_embedded_fp32_equals_transformers_greedy(embedded_fp32_here, drafter):
    target = embedded_fp32_here
    ids = [target.encode(p) for p in PROMPTS]
    expected = [hf_greedy(target, p, 32) for p in ids]
    gen = DSparkGenerator(target, drafter, DSparkScheduler(cost=CHEAP_VERIFY), max_batch_size=3)
    results = gen.generate(ids, max_new_tokens=32)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.accepted for r in results) > 0


@pytest.mark.embedded
def test_embedded_auto_dtype_is_bf16_on_gpu():
    target = load_model("smollm2-135m-instruct", dtype="auto", device=str(DEVICE))
    if ON_GPU:
        assert target.dtype in (torch.bfloat16, torch.float16)
    results = DSparkGenerator(target, "ngram", "fixed:2", max_batch_size=3).generate(PROMPTS, max_new_tokens=16)
    assert all(r.num_output_tokens > 0 and r.text for r in results)


@pytest.mark.embedded
def test_embedded_bf16_plain_decoding_equals_transformers_greedy():
    """One row, one token per step, in bfloat16: the lean forward makes transformers' kernel
    choices on this device, so plain decoding is the same computation as `generate`'s."""
    target = load_model("smollm2-135m-instruct", dtype="bfloat16", device=str(DEVICE))
    ids = [target.encode(p) for p in PROMPTS]
    expected = [hf_greedy(target, p, 32) for p in ids]
    results = DSparkGenerator(target, None, "ar", max_batch_size=1).generate(ids, max_new_tokens=32)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoding_never_runs_cudnn_attention(arch, targets, references):
    """Neither the engine nor `generate` on a dspark-loaded model (dspark_sdpa) builds cuDNN SDPA
    plans: the key length changes every step (dspark.attention.decoding_sdpa)."""
    from torch.profiler import ProfilerActivity, profile

    from dspark.attention import ATTN_IMPLEMENTATION

    target = targets[arch]
    previous = target.model.config._attn_implementation
    target.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    prompts, expected = references[arch]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    try:
        with profile(activities=activities) as prof:
            results = DSparkGenerator(target, NgramDrafter(), FixedLength(2), max_batch_size=3).generate(prompts[:3], max_new_tokens=12)
            hf_greedy(target, prompts[0], 12)
    finally:
        target.model.set_attn_implementation(previous)
    assert [r.token_ids for r in results] == [e[:12] for e in expected[:3]]
    assert not [e.key for e in prof.key_averages() if "cudnn_attention" in e.key]


# --- readings ---------------------------------------------------------------------------------
def test_gpu_readings_come_from_nvml(targets):
    gen = DSparkGenerator(targets["llama"], NgramDrafter(), FixedLength(2), max_batch_size=8)
    with UtilizationSampler(interval_s=0.02, device=DEVICE) as sampler:
        gen.generate(ragged_prompts(8), max_new_tokens=64)
    report = sampler.report
    probe = UtilizationProbe(DEVICE).read()
    if ON_GPU:
        assert report.device == torch.cuda.get_device_name(DEVICE)
        assert report.gpu_util_mean is not None and 0.0 <= report.gpu_util_mean <= 1.0
        assert report.gpu_mem_peak_bytes is not None and report.gpu_mem_peak_bytes > 0
        assert probe is not None and 0.0 <= probe <= 1.0
    else:
        assert report.gpu_util_mean is None and report.gpu_mem_peak_bytes is None


def test_cost_table_profiles_on_the_device(targets):
    table = measure_batch_costs(targets["llama"], rows=(1, 4), widths=(1, 4, 16), context=64, reps=2)
    assert table.rows == (1, 4) and table.widths == (1, 4, 16)
    assert all(0 < s < 1.0 for line in table.seconds for s in line), table.describe()
