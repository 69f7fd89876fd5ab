"""Packed linear layers (oneDNN or MKL): same results as `nn.Linear`, same model, same greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import dspark.cpu_matmul as cpu_matmul
from dspark.cpu_matmul import (
    KERNEL_PROBE_ROWS,
    MKL_CANDIDATE_ROWS,
    MKL_PACKED,
    ONEDNN,
    PACKED_MAX_ROWS,
    KernelChoice,
    PackedLinear,
    available_kernels,
    choose_kernels,
    fuse_linears,
    is_packed,
    leading_wins,
    pack_linear_layers,
    packed_choice,
    packing_available,
    timing_sample,
)
from dspark.drafters.ngram import NgramDrafter
from dspark.generator import DSparkGenerator
from dspark.models import load_model, wrap_model
from dspark.schedulers import DSparkScheduler
from tests.conftest import tiny_model
from tests.test_lossless_greedy import CHEAP_VERIFY, hf_greedy, ragged_prompts

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="this torch build has neither oneDNN nor MKL linear"
)
KERNELS_HERE = available_kernels(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kernel", KERNELS_HERE)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 9, 48), (17, 48)])
@torch.no_grad()
def test_packed_linear_matches_linear(bias, shape, kernel):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    expected = linear(x)
    for mkl_max_rows in range(MKL_CANDIDATE_ROWS + 1):
        got = PackedLinear(linear, KernelChoice.only(kernel, mkl_max_rows))(x)
        assert got.shape == expected.shape == (*shape[:-1], 80)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        if x.numel() // 48 <= mkl_max_rows:  # a few rows keep the plain kernel, bit for bit
            assert torch.equal(got, expected)


OPS = {ONEDNN: "_linear_pointwise", MKL_PACKED: "_mkl_linear"}


def ops_run(layer: nn.Module, x: torch.Tensor) -> set[str]:
    """Which packed kernels a call ran."""
    with torch.no_grad(), torch.profiler.profile() as prof:
        layer(x)
    keys = {e.key for e in prof.key_averages()}
    return {kernel for kernel, op in OPS.items() if any(op in key for key in keys)}


@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_mkl_max_rows_decides_which_calls_keep_plain_mkl(kernel):
    linear = nn.Linear(48, 80)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 48)
        assert ops_run(PackedLinear(linear, KernelChoice.only(kernel, 0)), x) == {kernel}
        assert ops_run(PackedLinear(linear, KernelChoice.only(kernel, 3)), x) == ({kernel} if rows > 3 else set())
    assert ops_run(linear, torch.randn(4, 48)) == set()


@pytest.mark.skipif(len(KERNELS_HERE) < 2, reason="this torch build lacks oneDNN or MKL linear")
@torch.no_grad()
def test_the_choice_splits_row_counts_between_the_kernels():
    choice = KernelChoice(mkl_max_rows=2, mkl_packed_max_rows=16)
    assert [choice.kernel_for(r) for r in (1, 2, 3, 16, 17, 128, 129)] == [None, None, MKL_PACKED, MKL_PACKED, ONEDNN, ONEDNN, None]
    assert choice.kernels == (ONEDNN, MKL_PACKED)
    assert KernelChoice.only(MKL_PACKED).kernels == (MKL_PACKED,)
    assert KernelChoice.only(ONEDNN).kernels == (ONEDNN,)
    linear = nn.Linear(48, 80)
    layer = PackedLinear(linear, choice)
    for rows, ran, held in ((2, set(), ()), (16, {MKL_PACKED}, (MKL_PACKED,)), (20, {ONEDNN}, (ONEDNN, MKL_PACKED))):
        x = torch.randn(rows, 48)
        assert ops_run(layer, x) == ran
        assert layer.packed_kernels == held  # a kernel's copy of the weight is built by its first call
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    layer.release()
    assert layer.packed_kernels == ()
    x = torch.randn(20, 48)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)  # packed again
    assert layer.packed_kernels == (ONEDNN,)


def test_an_unknown_or_unavailable_kernel_is_refused():
    with pytest.raises(ValueError, match="unknown packed kernel"):
        KernelChoice.only("blas")
    if len(KERNELS_HERE) < 2:
        missing = next(k for k in (ONEDNN, MKL_PACKED) if k not in KERNELS_HERE)
        with pytest.raises(ValueError, match="lacks"):
            pack_linear_layers(tiny_model("llama", 300, seed=0), KernelChoice.only(missing))


def test_leading_wins_counts_entries_up_to_the_first_loss():
    assert leading_wins([20.8, 21.6, 23.3], [25.6, 27.1, 27.7]) == 3  # an AVX2 EPYC: MKL up to 3 rows
    assert leading_wins([30.7, 46.4, 57.3], [21.5, 23.9, 24.5]) == 0  # an EPYC where oneDNN wins from 1 row
    assert leading_wins([20.0, 30.0, 20.0], [25.0, 25.0, 25.0]) == 1  # no win after a loss
    assert leading_wins([25.0, 25.0, 30.0], [25.0, 25.0, 25.0]) == 2  # ties keep the first


def pass_times(mkl: list[float], onednn: list[float], mkl_packed: list[float]) -> dict[tuple[str, int], float]:
    """Pass times keyed like `measure_kernel_choice`'s: plain MKL for 1..3 rows, the packed
    kernels for 1..3 and then the probe rows."""
    rows = [*range(1, MKL_CANDIDATE_ROWS + 1), *KERNEL_PROBE_ROWS]
    times = {("mkl", r): t for r, t in zip(rows, mkl)}
    times.update({(ONEDNN, r): t for r, t in zip(rows, onednn)})
    times.update({(MKL_PACKED, r): t for r, t in zip(rows, mkl_packed)})
    return times


def test_kernels_are_chosen_per_row_range_from_pass_times():
    both = (ONEDNN, MKL_PACKED)
    # rows:   1  2  3 |  4  6  8 12 16 24 32 48 64  (like an AVX-512 Xeon: MKL packed to 16)
    xeon = pass_times([23, 25, 32], [30, 31, 36, 33, 36, 40, 45, 50, 51, 61, 76, 91], [23, 25, 31, 29, 32, 35, 40, 44, 60, 65, 87, 103])
    assert choose_kernels(xeon, both) == KernelChoice(mkl_max_rows=2, mkl_packed_max_rows=16)
    # oneDNN from one row up (as on some EPYCs), MKL packed nowhere ahead of it
    epyc = pass_times([31, 46, 57], [21, 24, 25, 28, 29, 30, 36, 42, 45, 50, 60, 70], [30, 45, 55, 47, 45, 44, 48, 53, 60, 68, 80, 95])
    assert choose_kernels(epyc, both) == KernelChoice(0, 0)
    assert choose_kernels(epyc, both).kernels == (ONEDNN,)
    # MKL packed ahead at every probe: it takes every row count up to PACKED_MAX_ROWS
    flat = pass_times([20, 20, 20], [30] * 12, [20] * 12)
    assert choose_kernels(flat, both) == KernelChoice(3, PACKED_MAX_ROWS)
    # one kernel in the build: nothing to choose between
    assert choose_kernels(xeon, (ONEDNN,)) == KernelChoice(3, 3)
    assert choose_kernels(xeon, (MKL_PACKED,)) == KernelChoice(2, PACKED_MAX_ROWS)


def test_the_timing_sample_streams_up_to_a_byte_budget():
    layers = [nn.Linear(64, 64) for _ in range(10)]  # 16 KiB of weights each
    assert timing_sample(layers, max_bytes=3 * 16384) == layers[:3]
    assert timing_sample(layers, max_bytes=1) == layers[:1]  # never empty


def test_the_kernel_choice_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    first = tiny_model("llama", 300, seed=0)
    pack_linear_layers(first, cache_dir=tmp_path)
    measured = packed_choice(first)
    assert set(measured.kernels) <= set(KERNELS_HERE) and 0 <= measured.mkl_max_rows <= MKL_CANDIDATE_ROWS
    assert {m.choice for m in first.modules() if isinstance(m, PackedLinear)} == {measured}
    (cached,) = tmp_path.glob("*.json")
    record = json.loads(cached.read_text())
    assert KernelChoice(record["mkl_max_rows"], record["mkl_packed_max_rows"]) == measured

    def no_second_measurement(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_matmul, "measure_kernel_choice", no_second_measurement)
    second = tiny_model("llama", 300, seed=1)
    pack_linear_layers(second, cache_dir=tmp_path)
    assert packed_choice(second) == measured
    third = tiny_model("llama", 300, seed=2)
    pack_linear_layers(third, KernelChoice.only(KERNELS_HERE[-1], 2))  # an explicit choice measures nothing
    assert packed_choice(third) == KernelChoice.only(KERNELS_HERE[-1], 2)


def test_a_cache_from_before_two_kernels_is_measured_again(tmp_path, monkeypatch):
    pack_linear_layers(tiny_model("llama", 300, seed=0), cache_dir=tmp_path)
    (cached,) = tmp_path.glob("*.json")
    cached.write_text(json.dumps({"mkl_max_rows": 3}))  # a one-crossover record: no mkl_packed_max_rows
    calls = []
    real = cpu_matmul.measure_kernel_choice
    monkeypatch.setattr(cpu_matmul, "measure_kernel_choice", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("llama", 300, seed=1)
    pack_linear_layers(model, cache_dir=tmp_path)
    assert calls == [1]
    assert json.loads(cached.read_text())["mkl_packed_max_rows"] == packed_choice(model).mkl_packed_max_rows


def test_packed_linear_falls_back_when_training():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    packed = PackedLinear(linear, KernelChoice.only(KERNELS_HERE[0], 0))
    x = torch.randn(5, 16, requires_grad=True)
    packed(x).sum().backward()  # the mkldnn path has no autograd: grad mode must take F.linear
    assert x.grad is not None and linear.weight.grad is not None


@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_fused_linears_give_the_parts_outputs_side_by_side_to_the_bit(kernel):
    torch.manual_seed(0)
    choice = KernelChoice.only(kernel, 2)
    parts = [PackedLinear(nn.Linear(48, n), choice) for n in (48, 16, 16)]
    fused = fuse_linears(parts)
    assert fused is not None and fused.out_features == 80 and fused.choice == choice
    assert all(layer.packed_kernels == () for layer in (fused, *parts))  # the check's copies are dropped
    for rows in (1, 2, 3, 7, 9, 40, 130):  # MKL, packed, padded buckets, past PACKED_MAX_ROWS
        x = torch.randn(rows, 48)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert fuse_linears([nn.Linear(48, 8), nn.Linear(48, 8)]) is None  # not packed
    assert fuse_linears([PackedLinear(nn.Linear(48, 8), choice), PackedLinear(nn.Linear(32, 8), choice)]) is None  # inputs differ
    assert fuse_linears([PackedLinear(nn.Linear(48, 8), choice), PackedLinear(nn.Linear(48, 8, bias=False), choice)]) is None
    if len(KERNELS_HERE) > 1:  # packed for different kernels
        assert fuse_linears([PackedLinear(nn.Linear(48, 8), KernelChoice.only(k, 2)) for k in KERNELS_HERE]) is None
    stale = [PackedLinear(nn.Linear(48, 8), KernelChoice.only(kernel, 0)) for _ in range(2)]
    with torch.no_grad():
        stale[0](torch.randn(4, 48))  # packs its copy
        stale[0].weight.add_(1.0)  # which now disagrees with it: fused results would differ
    assert fuse_linears(stale) is None


def test_packing_keeps_parameters_and_tied_head():
    model = tiny_model("llama", 300, seed=0)
    keys_before = set(model.state_dict())
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linear_layers(model) == n_linear > 0
    assert is_packed(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(m.packed_kernels == () for m in packed)  # no copy until a call needs one
    assert set(model.state_dict()) == keys_before  # the packed copies are not state
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert pack_linear_layers(model) == 0  # already packed: nothing left to swap


@pytest.mark.parametrize("scheduler", ["fixed:4", "dspark"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_packed_target_speculates_losslessly(batch_size, scheduler, kernel, smol_tokenizer):
    """The engine on a packed target equals transformers' greedy on the unpacked twin."""
    plain = wrap_model(tiny_model("llama", len(smol_tokenizer), seed=0, sharpen=16.0), smol_tokenizer, "plain")
    packed_model = tiny_model("llama", len(smol_tokenizer), seed=0, sharpen=16.0)
    pack_linear_layers(packed_model, KernelChoice.only(kernel, 1))  # one-token steps on MKL, blocks packed
    packed = wrap_model(packed_model, smol_tokenizer, "packed")
    prompts = ragged_prompts(10, seed=5)
    expected = [hf_greedy(plain, p, 20) for p in prompts]
    policy = DSparkScheduler(cost=CHEAP_VERIFY) if scheduler == "dspark" else scheduler
    results = DSparkGenerator(packed, NgramDrafter(), policy, max_batch_size=batch_size).generate(prompts, max_new_tokens=20)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.verified for r in results) > 0


@pytest.mark.embedded
def test_embedded_target_is_packed_and_unchanged(embedded_fp32):
    """load_model packs the CPU float32 target (and picks dspark_sdpa); its greedy tokens match
    the unpacked model's."""
    assert is_packed(embedded_fp32.model)
    assert embedded_fp32.model.config._attn_implementation == "dspark_sdpa"
    plain = load_model("smollm2-135m-instruct", dtype="float32", device="cpu", pack_weights=False)
    assert not is_packed(plain.model)
    prompts = [plain.encode(p) for p in ("Name three primary colours.", "Write a haiku about rain.")]
    expected = [hf_greedy(plain, p, 24) for p in prompts]
    results = DSparkGenerator(embedded_fp32, "ngram", "fixed:4", max_batch_size=2).generate(prompts, max_new_tokens=24)
    assert [r.token_ids for r in results] == expected


def test_pack_weights_true_refuses_where_unavailable():
    with pytest.raises(ValueError, match="oneDNN"):
        load_model("smollm2-135m-instruct", dtype="bfloat16", device="cpu", pack_weights=True)
