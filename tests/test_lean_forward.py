"""The lean decoder forward computes what transformers' forward computes, on the engine's cache."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from dspark.cpu_matmul import KernelChoice, available_kernels, pack_linear_layers, packing_available
from dspark.lean_forward import LeanDecoder, fused_projections, lean_support
from dspark.runner import ModelRunner
from tests.conftest import tiny_model

# prefill of ragged prompts, then two rounds: ragged chains and a tree, with ragged commits
ROUNDS = [
    ([([5], [-1]), ([6, 7, 8], [-1, 0, 1]), ([9, 10, 11, 12], [-1, 0, 0, 1])], [[0], [0, 1], [0, 2]]),
    ([([1], [-1]), ([2], [-1]), ([3, 4], [-1, 0])], [[0], [0], [0, 1]]),
]


def real_positions(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """A block output [B, W, ...] without its padding (what a padded position holds is undefined:
    the lean forward on CPU packs rows and leaves zeros there)."""
    return torch.cat([t[b, :n] for b, n in enumerate(lengths)])


def run_rounds(model, lean: bool, hidden_layers: tuple[int, ...], fused: bool = True) -> list[torch.Tensor]:
    runner = ModelRunner(model, hidden_layers=hidden_layers, lean=lean)
    assert (runner.lean is not None) == lean
    if not fused:
        runner.lean.fused = None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (40, 7, 23)]
    runner.cache, hidden, logits = runner.prefill_with_logits(prompts)
    outs = [logits, *(real_positions(h, [40, 7, 23]) for h in hidden)]
    for blocks, keep in ROUNDS:
        out = runner.forward_block(blocks)
        lengths = [len(t) for t, _ in blocks]
        outs += [real_positions(t, lengths) for t in (out.logits, *out.hidden)]
        runner.cache.commit(keep)
    runner.cache.select_rows([0])  # one row, one token: the autoregressive step
    for tok in (13, 14):
        out = runner.forward_block([([tok], [-1])])
        outs += [out.logits, *out.hidden]
        runner.cache.commit([[0]])
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_matches_transformers_forward(arch):
    model = tiny_model(arch, 256, seed=3, layers=3)
    assert lean_support(model) is None
    layers = (0, 1, 3)  # embeddings, after layer 1, after the final norm
    reference = run_rounds(model, lean=False, hidden_layers=layers)
    lean = run_rounds(model, lean=True, hidden_layers=layers)
    assert len(lean) == len(reference)
    for ref, got in zip(reference, lean):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.float32), reason="this torch build has neither oneDNN nor MKL linear")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_projections_change_no_bit(arch):
    """With packed CPU weights, q/k/v and gate/up run as one matmul each: prefills, ragged
    verify blocks, trees and one-token steps give the separate layers' logits and hidden states
    to the bit (qwen2: with q/k/v biases)."""
    model = tiny_model(arch, 256, seed=7, layers=2)
    kernels = available_kernels(torch.device("cpu"), torch.float32)
    # one-token steps on plain MKL, blocks on both packed kernels where the build has both
    pack_linear_layers(model, KernelChoice(1, 4) if len(kernels) == 2 else KernelChoice.only(kernels[0], 1))
    fused = fused_projections(model)
    assert fused is not None and len(fused) == 2
    assert fused_projections(model) is fused  # built once per model, shared by its runners
    layers = (1, 2)
    separate = run_rounds(model, lean=True, hidden_layers=layers, fused=False)
    together = run_rounds(model, lean=True, hidden_layers=layers)
    assert len(together) == len(separate)
    for ref, got in zip(separate, together):
        assert torch.equal(got, ref)


def test_unpacked_models_keep_separate_projections():
    model = tiny_model("llama", 256, seed=7, layers=2)
    assert fused_projections(model) is None
    assert LeanDecoder(model).fused is None


def test_lean_matches_a_llama_with_biases_everywhere():
    # attention_bias puts biases on q/k/v/o, mlp_bias on the MLP: the modules carry them
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, mlp_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)  # transformers initialises biases to zero
    assert lean_support(model) is None
    for ref, got in zip(run_rounds(model, lean=False, hidden_layers=(1,)), run_rounds(model, lean=True, hidden_layers=(1,))):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_ragged_rows_run_their_projections_and_lm_head_on_real_tokens_only(monkeypatch):
    """On CPU a verify round of rows 1, 4 and 2 tokens wide multiplies 7 token rows through the
    projections, MLPs and LM head, not 3 x 4; each row's logits are what it gets alone."""
    model = tiny_model("llama", 256, seed=6, layers=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 5, 12)]
    blocks = [([5], [-1]), ([6, 7, 8, 9], [-1, 0, 1, 1]), ([10, 11], [-1, 0])]
    runner = ModelRunner(model)
    assert runner.packs_ragged_blocks
    runner.cache, _, _ = runner.prefill_with_logits(prompts)
    seen = []
    layer = model.model.layers[0]
    for name, module in (("q_proj", layer.self_attn.q_proj), ("down_proj", layer.mlp.down_proj), ("lm_head", model.lm_head)):
        forward = module.forward
        monkeypatch.setattr(module, "forward", lambda x, forward=forward, name=name: seen.append((name, x.numel() // x.shape[-1])) or forward(x))
    together = runner.forward_block(blocks).logits
    assert sorted(seen) == [("down_proj", 7), ("lm_head", 7), ("q_proj", 7)]
    monkeypatch.undo()
    for r, (prompt, block) in enumerate(zip(prompts, blocks)):
        alone = ModelRunner(model)
        alone.cache, _, _ = alone.prefill_with_logits([prompt])
        n = len(block[0])
        torch.testing.assert_close(together[r, :n], alone.forward_block([block]).logits[0], rtol=1e-5, atol=1e-5)
        assert not together[r, n:].any()  # padding: zeros, never read


def test_prefill_groups_prompts_of_similar_length():
    from dspark.runner import prefill_groups

    assert prefill_groups([50, 500, 52, 480, 49, 7]) == [[5], [4, 0, 2], [3, 1]]
    assert prefill_groups([10, 10, 10]) == [[0, 1, 2]]
    assert prefill_groups([10, 10, 10], padding=0.0) == [[0, 1, 2]]
    assert prefill_groups([9, 10], padding=0.0) == [[0], [1]]


def test_a_grouped_prefill_is_the_one_call_prefill(monkeypatch):
    """Prompts of 40, 7 and 23 tokens prefill in three calls on CPU; the merged cache, logits
    and hidden states are in prompt order and decode exactly as one padded call's would."""
    model = tiny_model("llama", 256, seed=7, layers=2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (40, 7, 23)]
    grouped = ModelRunner(model, hidden_layers=(1,))
    calls = []
    one = grouped._prefill_group
    monkeypatch.setattr(grouped, "_prefill_group", lambda ps, last: calls.append(len(ps)) or one(ps, last))
    grouped.cache, g_hidden, g_logits = grouped.prefill_with_logits(prompts)
    assert calls == [1, 1, 1]
    single = ModelRunner(model, hidden_layers=(1,))
    single.packs_ragged_blocks = False  # one padded call
    single.cache, s_hidden, s_logits = single.prefill_with_logits(prompts)
    torch.testing.assert_close(g_logits, s_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(real_positions(g_hidden[0], [40, 7, 23]), real_positions(s_hidden[0], [40, 7, 23]), rtol=1e-5, atol=1e-5)
    assert grouped.cache.lengths.tolist() == [40, 7, 23]
    blocks = [([5, 6], [-1, 0]), ([7], [-1]), ([8, 9, 10], [-1, 0, 1])]
    torch.testing.assert_close(
        real_positions(grouped.forward_block(blocks).logits, [2, 1, 3]),
        real_positions(single.forward_block(blocks).logits, [2, 1, 3]), rtol=1e-5, atol=1e-5,
    )


def test_lean_final_hidden_state_is_what_the_lm_head_reads():
    model = tiny_model("llama", 256, seed=4, layers=2)
    runner = ModelRunner(model, hidden_layers=(2,))
    runner.cache, hidden, logits = runner.prefill_with_logits([[5, 6, 7, 8]])
    torch.testing.assert_close(model.lm_head(hidden[0][:, -1]), logits)


def test_lean_prefill_without_logits_skips_the_lm_head(monkeypatch):
    model = tiny_model("llama", 256, seed=4, layers=2)
    runner = ModelRunner(model, hidden_layers=(1,))
    monkeypatch.setattr(model.lm_head, "forward", lambda x: pytest.fail("the LM head ran for a prefill without logits"))
    cache, hidden = runner.prefill([[5, 6, 7], [8, 9]])
    assert hidden[0].shape == (2, 3, 64)
    assert cache.lengths.tolist() == [3, 2]


def test_unsupported_models_keep_the_transformers_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert "gpt2" in lean_support(gpt2)
    with pytest.raises(ValueError, match="cannot run"):
        LeanDecoder(gpt2)
    windowed = tiny_model("llama", 64, layers=1)
    windowed.model.layers[0].self_attn.sliding_window = 16
    assert lean_support(windowed) == "sliding-window attention"
    assert ModelRunner(windowed).lean is None


# --- transformers' kernel choices (the CUDA policy), checked on the CPU -----------------------
def run_single_row(model, lean: bool) -> list[torch.Tensor]:
    """One row: prefill, one-token steps, a chain on a filled cache, a partial commit, a step."""
    runner = ModelRunner(model, lean=lean)
    runner.cache, _, logits = runner.prefill_with_logits([[5, 9, 17, 33, 2, 71, 8]])
    outs = [logits]
    for blocks, keep in [([([13], [-1])], [[0]]), ([([14], [-1])], [[0]]), ([([3, 4, 5], [-1, 0, 1])], [[0, 1]]), ([([6], [-1])], [[0]])]:
        out = runner.forward_block(blocks)
        outs.append(out.logits)
        runner.cache.commit(keep)
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_with_transformers_kernels_matches_transformers_forward(arch, monkeypatch):
    """The device policy used on CUDA (transformers' RMSNorm; KV heads expanded under a mask; no
    mask where transformers passes none) computes the same logits, and takes each path."""
    import torch.nn.functional as F

    model = tiny_model(arch, 256, seed=3, layers=3)
    reference = run_rounds(model, lean=False, hidden_layers=(0, 1, 3)) + run_single_row(model, lean=False)
    monkeypatch.setattr("dspark.lean_forward.transformers_kernels", lambda device: True)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
        calls.append((attn_mask is None, is_causal, q.shape[1] == k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = run_rounds(model, lean=True, hidden_layers=(0, 1, 3)) + run_single_row(model, lean=True)
    for ref, out in zip(reference, got, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    kinds = set(calls)
    assert (False, False, True) in kinds, "masked attention must see expanded KV heads"
    assert (True, True, False) in kinds, "a one-row prefill runs causal SDPA without a mask"
    assert (True, False, False) in kinds, "a one-row, one-token step runs SDPA without a mask"
    assert not any(not maskless and not same_heads for maskless, _, same_heads in calls)


def test_engine_greedy_with_transformers_kernels(tiny_llama, monkeypatch):
    from dspark.drafters.ngram import NgramDrafter
    from dspark.generator import DSparkGenerator
    from tests.test_lossless_greedy import CHEAP_VERIFY, hf_greedy, ragged_prompts
    from dspark.schedulers import DSparkScheduler

    prompts = ragged_prompts(5, seed=2)
    expected = [hf_greedy(tiny_llama, p, 16) for p in prompts]
    monkeypatch.setattr("dspark.lean_forward.transformers_kernels", lambda device: True)
    taken = []
    maskless = ModelRunner._maskless
    monkeypatch.setattr(ModelRunner, "_maskless", staticmethod(lambda blocks, cache: taken.append(maskless(blocks, cache)) or taken[-1]))
    for batch, scheduler in ((1, "ar"), (1, DSparkScheduler(cost=CHEAP_VERIFY)), (3, DSparkScheduler(cost=CHEAP_VERIFY))):
        gen = DSparkGenerator(tiny_llama, NgramDrafter(), scheduler, max_batch_size=batch)
        assert [r.token_ids for r in gen.generate(prompts, max_new_tokens=16)] == expected
    assert {(True, True), (True, False), (False, False)} <= set(taken), "every attention path must run"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_blocks_fold_query_groups(monkeypatch, dtype):
    """CPU: blocks of 2 to FOLD_MAX_TOKENS tokens run grouped-query attention as plain SDPA
    over each KV head's stacked queries (faster); one-token steps of several rows do so in
    bfloat16 (where SDPA's one-query grouped kernel is several times slower), while float32
    and one-row steps keep SDPA's own `enable_gqa`. The result is SDPA's `enable_gqa` to float
    rounding (bit for bit on some CPUs and sizes)."""
    import torch.nn.functional as F

    import dspark.lean_forward as lf

    model = tiny_model("llama", 256, seed=3, layers=3).to(dtype)
    calls = []
    fold = lf.fold_query_groups
    monkeypatch.setattr(lf, "fold_query_groups", lambda *a: calls.append(a[0].shape[0:3:2]) or fold(*a))  # (rows, width)

    def rounds() -> list[torch.Tensor]:  # run_rounds ends with one-row steps; then a 3-row one-token step
        runner = ModelRunner(model, lean=True)
        runner.cache, _, _ = runner.prefill_with_logits([[5, 9, 17], [4, 8], [7, 7, 7, 7]])
        return run_rounds(model, lean=True, hidden_layers=(1, 3)) + [runner.forward_block([([13], [-1]), ([14], [-1]), ([15], [-1])]).logits]

    folded = rounds()
    assert any(w >= 2 for _, w in calls), "multi-token blocks must take the folded path"
    assert (1, 1) not in calls, "one-row steps keep grouped SDPA (transformers' rounding)"
    if dtype == torch.float32:
        assert (3, 1) not in calls, "float32 one-token steps keep grouped SDPA"
    else:
        assert (3, 1) in calls, "bfloat16 one-token steps of several rows must fold"
    assert any(w == 40 for _, w in calls), "a prompt of up to FOLD_MAX_TOKENS tokens folds too"

    def unfolded(q, k, v, m):  # the folded mask's first W rows are the block's own mask; None: no mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if m is None else m[:, :, : q.shape[2]], enable_gqa=True)

    monkeypatch.setattr(lf, "fold_query_groups", unfolded)
    grouped = rounds()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(folded, grouped, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_long_blocks_keep_grouped_sdpa(monkeypatch):
    """Prefills longer than FOLD_MAX_TOKENS keep grouped SDPA (folding copies the mask per query
    head and gains nothing there); verify-sized blocks still fold."""
    import dspark.lean_forward as lf

    monkeypatch.setattr(lf, "FOLD_MAX_TOKENS", 4)
    calls = []
    fold = lf.fold_query_groups
    monkeypatch.setattr(lf, "fold_query_groups", lambda *a: calls.append(a[0].shape[2]) or fold(*a))
    run_rounds(tiny_model("llama", 256, seed=3, layers=3), lean=True, hidden_layers=(1,))
    assert calls and set(calls) <= {2, 3, 4}, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_and_rms_norm_are_transformers_ops_to_the_bit(dtype):
    """`rotate` (q and k rolled, the sign on sin) and `rms_norm` (the weight inside the call in
    float32) change how many ops run, not one bit of what transformers computes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from dspark.lean_forward import rms_norm, rotate, signed_sin

    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 9, 5, 64, generator=g) * 3).to(dtype)  # [B, H, W, dh]
    k = (torch.randn(1, 3, 5, 64, generator=g) * 3).to(dtype)
    angles = torch.rand(1, 5, 32, generator=g) * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)  # [B, W, dh]
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q = rotate(q, cos[:, None], signed_sin(sin[:, None]))
    got_k = rotate(k, cos[:, None], signed_sin(sin[:, None]))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)

    norm = LlamaRMSNorm(64, eps=1e-5)
    norm.weight.data = torch.rand(64, generator=g) + 0.5
    norm = norm.to(dtype)
    x = (torch.randn(7, 64, generator=g) * 4).to(dtype)
    assert torch.equal(rms_norm(x, norm), norm(x))
