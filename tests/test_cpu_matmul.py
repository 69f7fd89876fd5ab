"""oneDNN-packed linear layers: same results as `nn.Linear`, same model, same greedy tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dspark.cpu_matmul as cpu_matmul
from dspark.cpu_matmul import (
    MKL_CANDIDATE_ROWS,
    PackedLinear,
    fuse_linears,
    is_packed,
    leading_mkl_wins,
    pack_linear_layers,
    packed_mkl_max_rows,
    packing_available,
)
from dspark.drafters.ngram import NgramDrafter
from dspark.generator import DSparkGenerator
from dspark.models import load_model, wrap_model
from dspark.schedulers import DSparkScheduler
from tests.conftest import tiny_model
from tests.test_lossless_greedy import CHEAP_VERIFY, hf_greedy, ragged_prompts

pytestmark = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN linear"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 9, 48), (17, 48)])
@torch.no_grad()
def test_packed_linear_matches_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    expected = linear(x)
    for mkl_max_rows in range(MKL_CANDIDATE_ROWS + 1):
        got = PackedLinear(linear, mkl_max_rows=mkl_max_rows)(x)
        assert got.shape == expected.shape == (*shape[:-1], 80)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        if x.numel() // 48 <= mkl_max_rows:  # a few rows keep the plain kernel, bit for bit
            assert torch.equal(got, expected)


def ran_onednn(layer: nn.Module, x: torch.Tensor) -> bool:
    with torch.no_grad(), torch.profiler.profile() as prof:
        layer(x)
    return any("_linear_pointwise" in e.key for e in prof.key_averages())


def test_mkl_max_rows_decides_which_kernel_a_call_takes():
    linear = nn.Linear(48, 80)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 48)
        assert ran_onednn(PackedLinear(linear, mkl_max_rows=0), x)
        assert ran_onednn(PackedLinear(linear, mkl_max_rows=3), x) == (rows > 3)
    assert not ran_onednn(linear, torch.randn(4, 48))


def test_leading_mkl_wins_counts_row_counts_up_to_the_first_loss():
    assert leading_mkl_wins([20.8, 21.6, 23.3], [25.6, 27.1, 27.7]) == 3  # the EPYC of sessions 1-19
    assert leading_mkl_wins([30.7, 46.4, 57.3], [21.5, 23.9, 24.5]) == 0  # the EPYC of session 22
    assert leading_mkl_wins([20.0, 30.0, 20.0], [25.0, 25.0, 25.0]) == 1  # no win after a loss
    assert leading_mkl_wins([25.0, 25.0, 30.0], [25.0, 25.0, 25.0]) == 2  # ties keep MKL


def test_the_crossover_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    first = tiny_model("llama", 300, seed=0)
    pack_linear_layers(first, cache_dir=tmp_path)
    measured = packed_mkl_max_rows(first)
    assert 0 <= measured <= MKL_CANDIDATE_ROWS
    assert {m.mkl_max_rows for m in first.modules() if isinstance(m, PackedLinear)} == {measured}
    assert len(list(tmp_path.glob("*.json"))) == 1

    def no_second_measurement(layers, reps=3):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_matmul, "measure_mkl_max_rows", no_second_measurement)
    second = tiny_model("llama", 300, seed=1)
    pack_linear_layers(second, cache_dir=tmp_path)
    assert packed_mkl_max_rows(second) == measured
    third = tiny_model("llama", 300, seed=2)
    pack_linear_layers(third, mkl_max_rows=2)  # an explicit choice measures nothing
    assert packed_mkl_max_rows(third) == 2


def test_packed_linear_falls_back_when_training():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    packed = PackedLinear(linear)
    x = torch.randn(5, 16, requires_grad=True)
    packed(x).sum().backward()  # the mkldnn path has no autograd: grad mode must take F.linear
    assert x.grad is not None and linear.weight.grad is not None


def test_fused_linears_give_the_parts_outputs_side_by_side_to_the_bit():
    torch.manual_seed(0)
    parts = [PackedLinear(nn.Linear(48, n), mkl_max_rows=2) for n in (48, 16, 16)]
    fused = fuse_linears(parts)
    assert fused is not None and fused.out_features == 80 and fused.mkl_max_rows == 2
    for rows in (1, 2, 3, 7, 9, 40, 130):  # MKL, packed, padded buckets, past PACKED_MAX_ROWS
        x = torch.randn(rows, 48)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    assert fuse_linears([nn.Linear(48, 8), nn.Linear(48, 8)]) is None  # not packed
    assert fuse_linears([PackedLinear(nn.Linear(48, 8)), PackedLinear(nn.Linear(32, 8))]) is None  # inputs differ
    assert fuse_linears([PackedLinear(nn.Linear(48, 8)), PackedLinear(nn.Linear(48, 8, bias=False))]) is None
    stale = [PackedLinear(nn.Linear(48, 8), mkl_max_rows=0) for _ in range(2)]
    with torch.no_grad():
        stale[0].weight.add_(1.0)  # its packed copy now disagrees with it: fused results would differ
    assert fuse_linears(stale) is None


def test_packing_keeps_parameters_and_tied_head():
    model = tiny_model("llama", 300, seed=0)
    keys_before = set(model.state_dict())
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linear_layers(model) == n_linear > 0
    assert is_packed(model)
    assert set(model.state_dict()) == keys_before  # the packed copies are not state
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert pack_linear_layers(model) == 0  # already packed: nothing left to swap


@pytest.mark.parametrize("scheduler", ["fixed:4", "dspark"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_packed_target_speculates_losslessly(batch_size, scheduler, smol_tokenizer):
    """The engine on a packed target equals transformers' greedy on the unpacked twin."""
    plain = wrap_model(tiny_model("llama", len(smol_tokenizer), seed=0, sharpen=16.0), smol_tokenizer, "plain")
    packed_model = tiny_model("llama", len(smol_tokenizer), seed=0, sharpen=16.0)
    pack_linear_layers(packed_model)
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
