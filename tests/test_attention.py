"""`dspark_sdpa`: grouped-query verify blocks attend over the KV heads in place, same results."""

from __future__ import annotations

import pytest
import torch

from dspark.attention import ATTN_IMPLEMENTATION, decoding_sdpa
from dspark.drafters.ngram import NgramDrafter
from dspark.generator import DSparkGenerator
from dspark.models import wrap_model
from dspark.runner import ModelRunner
from tests.conftest import tiny_model
from tests.test_lossless_greedy import hf_greedy, ragged_prompts


def tiny_gqa(arch: str, implementation: str):
    model = tiny_model(arch, 400, seed=3, sharpen=16.0)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped-query
    model.set_attn_implementation(implementation)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_block_logits_equal_transformers_sdpa(arch, monkeypatch):
    """A ragged batch with a tree block: the masked, multi-token path this module replaces."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    grouped_calls = []

    def spy(*args, **kwargs):
        grouped_calls.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    blocks = [
        ([5, 6, 7, 8, 9], [-1, 0, 0, 1, 2]),  # a tree: nodes 1 and 2 are siblings
        ([11, 12], [-1, 0]),  # a shorter row, padded
    ]
    logits = {}
    for impl in ("sdpa", ATTN_IMPLEMENTATION):
        runner = ModelRunner(tiny_gqa(arch, impl), lean=False)  # through transformers' attention
        runner.cache, _ = runner.prefill([list(range(20, 45)), list(range(50, 60))])
        grouped_calls.clear()
        logits[impl] = runner.forward_block(blocks).logits
        # transformers' sdpa expands the KV heads (repeat_kv); dspark_sdpa attends over them in place
        assert all(grouped_calls) == (impl == ATTN_IMPLEMENTATION) and grouped_calls
    torch.testing.assert_close(logits[ATTN_IMPLEMENTATION], logits["sdpa"], rtol=1e-5, atol=1e-5)


def test_engine_on_dspark_sdpa_equals_transformers_greedy(smol_tokenizer, monkeypatch):
    # the engine's runner would take the lean forward; make it use transformers' (and dspark_sdpa)
    monkeypatch.setattr("dspark.runner.lean_support", lambda model: "transformers forward for this test")
    plain = wrap_model(tiny_model("llama", len(smol_tokenizer), seed=0, sharpen=16.0), smol_tokenizer, "plain")
    model = tiny_model("llama", len(smol_tokenizer), seed=0, sharpen=16.0)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    fast = wrap_model(model, smol_tokenizer, "dspark-sdpa")
    prompts = ragged_prompts(5, seed=2)
    expected = [hf_greedy(plain, p, 16) for p in prompts]
    results = DSparkGenerator(fast, NgramDrafter(), "fixed:4", max_batch_size=3).generate(prompts, max_new_tokens=16)
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.verified for r in results) > 0


def test_decoding_sdpa_keeps_cuda_attention_off_cudnn_and_leaves_cpu_alone():
    """cuDNN's SDPA plans are per shape and decoding changes the key length every step."""
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled())
    with decoding_sdpa(torch.device("cuda")):
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()) == before
    with decoding_sdpa(torch.device("cpu")):
        assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()) == before
