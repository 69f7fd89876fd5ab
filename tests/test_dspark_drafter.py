"""DSpark drafter: block forward, heads, losses, STS, checkpoints and the engine plug-in."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dspark.drafters.base import DraftRequest, VerifyOutcome
from dspark.dspark_drafter import (
    DrafterOptions,
    DSparkConfig,
    DSparkDrafter,
    Fingerprint,
    TargetMismatchError,
    build_model,
    confine_markov_head,
    load_drafter,
    read_checkpoint,
    save_checkpoint,
)
from dspark.dspark_drafter.calibration import ece, roc_auc, sequential_temperature_scaling, sigmoid
from dspark.dspark_drafter.copy_prior import CopyPrior, CopyScorer, NgramIndex, adjust_logits, scorer_features
from dspark.dspark_drafter.losses import LossWeights, dspark_loss, position_weights
from dspark.dspark_drafter.model import block_attention_mask, lm_head_logits
from dspark.dspark_drafter.vocab import frequent_tokens, grow_vocab, save_draft_vocab
from dspark.sampling import SamplingNoise, SamplingParams
from dspark.training.tiny import tiny_target
from dspark.tree import DraftTree


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on the shared 2-core machine two OpenMP threads contend with other
    processes and spin, which made these tests ~20x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (2, 4), (3, 7)])
def test_lm_head_logits_match_a_plain_matmul_for_draft_blocks_and_training_batches(shape):
    # (1, 7) and (2, 4) take the transposed small-batch layout, (3, 7) the usual one
    gen = torch.Generator().manual_seed(0)
    h, weight = torch.randn(*shape, 16, generator=gen), torch.randn(50, 16, generator=gen)
    out = lm_head_logits(h, weight)
    assert out.shape == (*shape, 50)
    torch.testing.assert_close(out, h @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def make_model(target, **kw):
    torch.manual_seed(1)
    cfg = DSparkConfig.for_target(target.model.config, num_layers=2, num_heads=4, num_kv_heads=2, context_len=8, gamma=5, markov_rank=8, **kw)
    return build_model(cfg, target.model)


def rand_ctx(model, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, m, dt = model.cfg.context_len, len(model.cfg.target_layers), model.cfg.target_hidden_size
    feats = torch.randn(b, n, m * dt, generator=g)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :5] = False  # a short context, left-padded
    return model.project_context(feats), valid


# ---------------------------------------------------------------- block forward


def test_block_mask_shape_and_content():
    valid = torch.tensor([[True, True, True], [False, False, True]])
    m = block_attention_mask(valid, 4)
    assert m.shape == (2, 1, 4, 7)
    assert m[0].all()  # full context + bidirectional block
    assert not m[1, 0, :, :2].any() and m[1, 0, :, 2:].all()


def test_block_forward_shapes(target):
    model = make_model(target)
    ctx, valid = rand_ctx(model)
    out = model.forward_block(ctx, valid, torch.tensor([4, 5, 6]))
    g, v, d = model.cfg.gamma, model.cfg.vocab_size, model.cfg.hidden_size
    assert out.hidden.shape == (3, g, d)
    assert out.base_logits.shape == (3, g, v) and out.base_logits.dtype == torch.float32
    assert out.conf_h.shape == (3, g)
    assert model.block_inputs(torch.tensor([4])).shape == (1, g, d)


def reference_layer(layer, x, ctx, valid, start, theta):
    """One draft layer as the method describes it, written plainly: keys/values =
    [K(H_ctx); K(block)], RoPE at positions start-N..start+G-1, every query head reading its KV
    head (repeat_interleave), bidirectional block, padded context masked."""
    from dspark.dspark_drafter.model import apply_rope, rope_cos_sin

    b, g, n = x.shape[0], x.shape[1], ctx.shape[1]
    hn = layer.input_norm(x)
    both = torch.cat([ctx, hn], dim=1)
    cos, sin = rope_cos_sin(torch.arange(start - n, start + g), layer.hd, theta)
    q = apply_rope(layer._heads(layer.q_proj(hn), layer.h), cos[n:], sin[n:])
    k = apply_rope(layer._heads(layer.k_proj(both), layer.kv), cos, sin).repeat_interleave(layer.h // layer.kv, dim=1)
    v = layer._heads(layer.v_proj(both), layer.kv).repeat_interleave(layer.h // layer.kv, dim=1)
    mask = torch.cat([valid, torch.ones(b, g, dtype=torch.bool)], dim=1)[:, None, None, :]
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    x = x + layer.o_proj(a.transpose(1, 2).reshape(b, g, -1))
    hn = layer.post_norm(x)
    return x + layer.down_proj(torch.nn.functional.silu(layer.gate_proj(hn)) * layer.up_proj(hn))


def test_block_forward_equals_the_plain_reference(target):
    """Folded query heads, keys rotated once per context position and anchors at any position
    compute exactly the plain layer."""
    model = make_model(target)
    ctx, valid = rand_ctx(model)
    anchors = torch.tensor([4, 5, 6])
    with torch.no_grad():
        x = model.block_inputs(anchors)
        for layer in model.layers:
            x = reference_layer(layer, x, ctx, valid, model.cfg.context_len, model.cfg.rope_theta)
        expected = model.final_norm(x)
        h, _ = model.backbone(model.context_kv(ctx), valid, anchors)
        torch.testing.assert_close(h, expected, atol=1e-5, rtol=1e-5)
        # the run-time frame: keys rotated at their sequence positions, anchors at 40, 41, 42
        kv = [model.context_kv(ctx[i : i + 1], start=40 + i - model.cfg.context_len) for i in range(3)]
        kv = [tuple(torch.cat([kv[i][l][j] for i in range(3)]) for j in range(2)) for l in range(len(model.layers))]
        h2, _ = model.backbone(kv, valid, anchors, block_pos=torch.tensor([40, 41, 42]))
        torch.testing.assert_close(h2, expected, atol=1e-4, rtol=1e-4)


def test_context_injection_matters_and_padding_is_ignored(target):
    model = make_model(target)
    ctx, valid = rand_ctx(model)
    anchors = torch.tensor([4, 5, 6])
    base = model.forward_block(ctx, valid, anchors).base_logits
    changed = ctx.clone()
    changed[:, -1] += 1.0  # the newest committed position
    assert not torch.allclose(model.forward_block(changed, valid, anchors).base_logits, base)
    padded = ctx.clone()
    padded[1, :5] = 123.0  # masked-out slots of row 1
    same = model.forward_block(padded, valid, anchors).base_logits
    torch.testing.assert_close(same[1], base[1])


def test_attention_inside_block_is_bidirectional(target):
    model = make_model(target)
    ctx, valid = rand_ctx(model)
    anchors = torch.tensor([4, 5, 6])
    base = model.forward_block(ctx, valid, anchors).hidden
    with torch.no_grad():
        model.mask_embed.add_(0.5)  # only positions >= 1 hold mask embeddings
    after = model.forward_block(ctx, valid, anchors).hidden
    assert not torch.allclose(after[:, 0], base[:, 0])  # position 0 sees later positions


def test_shared_weights_are_frozen_and_not_stored(target):
    model = make_model(target)
    emb = target.model.get_input_embeddings().weight
    assert model.embed_weight.data_ptr() == emb.data_ptr()  # shared, not copied
    names = {n for n, _ in model.named_parameters()}
    assert not any("embed_weight" in n or "lm_head" in n for n in names)
    assert "embed_weight" not in model.state_dict() and "lm_head_weight" not in model.state_dict()
    before = emb.clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ctx, valid = rand_ctx(model)
    tokens = torch.randint(3, 96, (3, model.cfg.gamma + 1))
    logits, conf = model.teacher_forced(ctx, valid, tokens)
    (logits.logsumexp(-1).mean() + conf.mean()).backward()
    opt.step()
    torch.testing.assert_close(emb, before)


def test_drafter_uses_a_packed_target_head_only_for_inference():
    """On a packed target the drafter's LM head runs packed at inference, with the same
    logits, and training still goes through the frozen plain weight."""
    from dspark.cpu_matmul import pack_linear_layers, packing_available

    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no oneDNN linear")
    plain, packed = tiny_target(seed=0), tiny_target(seed=0)
    pack_linear_layers(packed.model)
    model_plain, model_packed = make_model(plain), make_model(packed)
    assert model_plain.packed_head is None and model_packed.packed_head is not None
    assert set(model_packed.state_dict()) == set(model_plain.state_dict())
    ctx, valid = rand_ctx(model_plain)
    with torch.no_grad():
        a = model_plain.forward_block(ctx, valid, torch.tensor([4, 5, 6])).base_logits
        b = model_packed.forward_block(ctx, valid, torch.tensor([4, 5, 6])).base_logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    tokens = torch.randint(3, 96, (3, model_packed.cfg.gamma + 1))
    logits, _ = model_packed.teacher_forced(ctx.detach(), valid, tokens)
    logits.logsumexp(-1).mean().backward()  # grad mode: the plain path, which autograd knows
    assert model_packed.mask_embed.grad is not None


def test_drafter_on_a_packed_target_packs_and_fuses_its_own_linears():
    """The engine plug-in runs the drafter's linears packed like the target's, q/k/v and
    gate/up fused: the block forward is the plain one up to rounding, bit-equal with and
    without the fusion, the checkpoint's keys stay as they were, and grad mode (training)
    never goes through the frozen fused copies."""
    from dspark.cpu_matmul import KernelChoice, PackedLinear, available_kernels, pack_linear_layers

    kernels = available_kernels(torch.device("cpu"), torch.float32)
    if not kernels:
        pytest.skip("this torch build has no packed linear kernel")
    packed_target = tiny_target(seed=0)
    # a fixed choice, as in test_lean_forward: a measured one may put 1-3 rows on MKL's packed
    # GEMM, where the fused gate/up rounds differently and `fuse_linears` rightly declines
    pack_linear_layers(packed_target.model, KernelChoice(1, 4) if len(kernels) == 2 else KernelChoice.only(kernels[0], 1))
    plain, model = make_model(tiny_target(seed=0)), make_model(packed_target)
    keys = set(model.state_dict())
    drafter = DSparkDrafter(model)
    assert drafter.packed and set(model.state_dict()) == keys
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert type(model.ctx_proj) is PackedLinear and all(type(getattr(layer, p)) is PackedLinear for layer in model.layers for p in projections)
    assert all(layer.fused_qkv is not None and layer.fused_gate_up is not None for layer in model.layers)
    ctx, valid = rand_ctx(plain)
    anchor = torch.tensor([4, 5, 6])
    with torch.no_grad():
        fused = model.forward_block(ctx, valid, anchor).hidden
        reference = plain.forward_block(ctx, valid, anchor).hidden
        saved = [(layer.fused_qkv, layer.fused_gate_up) for layer in model.layers]
        for layer in model.layers:
            layer.fused_qkv = layer.fused_gate_up = None
        unfused = model.forward_block(ctx, valid, anchor).hidden
        for layer, (qkv, gate_up) in zip(model.layers, saved):
            layer.fused_qkv, layer.fused_gate_up = qkv, gate_up
    assert torch.equal(fused, unfused)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    model.requires_grad_(True)
    logits, _ = model.teacher_forced(ctx.detach(), valid, torch.randint(3, 96, (3, model.cfg.gamma + 1)))
    logits.logsumexp(-1).mean().backward()
    assert model.layers[0].q_proj.weight.grad is not None and model.layers[0].up_proj.weight.grad is not None


def test_markov_bias_and_confidence_use_previous_token_only(target):
    model = make_model(target)
    with torch.no_grad():
        model.markov_w2.normal_()
        model.conf_head.weight.normal_()
    ctx, valid = rand_ctx(model)
    tokens = torch.randint(3, 96, (3, model.cfg.gamma + 1))
    logits, conf = model.teacher_forced(ctx, valid, tokens)
    other = tokens.clone()
    other[:, 3] = (other[:, 3] + 1 - 3) % 93 + 3  # y_3 changes: position 3 (prev of 4) differs
    logits2, conf2 = model.teacher_forced(ctx, valid, other)
    # columns: position k (1-based) uses prev token tokens[:, k-1]
    torch.testing.assert_close(conf2[:, :3], conf[:, :3])  # positions 1..3 do not see y_3
    assert not torch.allclose(conf2[:, 3], conf[:, 3])  # position 4 conditions on y_3
    assert not torch.allclose(logits2[:, 3], logits[:, 3])
    torch.testing.assert_close(logits2[:, 4:], logits[:, 4:])


def test_parallel_only_ablation_has_no_markov_head(target):
    model = make_model(target, )
    model0 = build_model(DSparkConfig(**{**model.cfg.to_dict(), "markov_rank": 0}), target.model)
    assert not any("markov" in n for n, _ in model0.named_parameters())
    ctx, valid = rand_ctx(model0)
    tokens = torch.randint(3, 96, (3, model0.cfg.gamma + 1))
    logits, _ = model0.teacher_forced(ctx, valid, tokens)
    out = model0.forward_block(ctx, valid, tokens[:, 0])
    torch.testing.assert_close(logits, out.base_logits)


# ---------------------------------------------------------------- losses


def test_position_weights():
    torch.testing.assert_close(position_weights(4), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))


def test_loss_matches_hand_computation():
    # one block, G = 2, V = 2: p_d = softmax([0, 0]) = [.5, .5]; softmax([ln 3, 0]) = [.75, .25]
    draft = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    target = torch.tensor([[[math.log(3.0), 0.0], [math.log(3.0), 0.0]]])  # p_t = [.75, .25] twice
    labels = torch.tensor([[0, 1]])
    conf = torch.tensor([[0.0, math.log(4.0)]])  # c = .5 and .8
    valid = torch.ones(1, 2, dtype=torch.bool)
    out = dspark_loss(draft, target, labels, conf, valid)
    w1, w2 = 1.0, math.exp(-0.5)
    ce = (w1 * -math.log(0.5) + w2 * -math.log(0.25)) / (w1 + w2)
    tv = (w1 * 0.5 + w2 * 0.0) / (w1 + w2)  # ||[.5,.5]-[.75,.25]||_1 = .5; identical -> 0
    # soft labels: 1 - .25 = .75 and 1; BCE(c, y) = -(y log c + (1-y) log(1-c))
    b1 = -(0.75 * math.log(0.5) + 0.25 * math.log(0.5))
    b2 = -math.log(0.8)
    conf_l = (w1 * b1 + w2 * b2) / (w1 + w2)
    assert out.ce.item() == pytest.approx(ce, rel=1e-5)
    assert out.tv.item() == pytest.approx(tv, rel=1e-5)
    assert out.conf.item() == pytest.approx(conf_l, rel=1e-5)
    assert out.total.item() == pytest.approx(0.1 * ce + 0.9 * tv + 1.0 * conf_l, rel=1e-5)
    # an invalid position drops out of every term
    out2 = dspark_loss(draft, target, labels, conf, torch.tensor([[True, False]]))
    assert out2.ce.item() == pytest.approx(-math.log(0.5), rel=1e-5)
    assert dspark_loss(draft, target, labels, conf, valid, LossWeights(1, 0, 0)).total.item() == pytest.approx(ce, rel=1e-5)


def test_loss_over_a_reduced_vocabulary():
    # V = 3, draft vocabulary {0, 2}: p_d = softmax([0, 0]) over {0, 2} = [.5, 0, .5]
    target = torch.tensor([[[math.log(2.0), 0.0, 0.0], [math.log(2.0), 0.0, 0.0]]])  # p_t = [.5, .25, .25]
    draft = torch.zeros(1, 2, 2)
    vocab = torch.tensor([0, 2])
    conf = torch.zeros(1, 2)
    valid = torch.ones(1, 2, dtype=torch.bool)
    labels = torch.tensor([[2, 1]])  # token 1 is outside the draft vocabulary: no CE there
    out = dspark_loss(draft, target, labels, conf, valid, vocab=vocab)
    # ||[.5, 0, .5] - [.5, .25, .25]||_1 = .5 at both positions (.25 of it is the mass outside)
    assert out.tv.item() == pytest.approx(0.5, rel=1e-5)
    assert out.ce.item() == pytest.approx(-math.log(0.5), rel=1e-5)  # position 1 only
    # the same as the full-vocabulary loss with the outside tokens forbidden
    full = torch.tensor([[[0.0, -1e9, 0.0], [0.0, -1e9, 0.0]]])
    ref = dspark_loss(full, target, torch.tensor([[2, 2]]), conf, valid)
    assert out.tv.item() == pytest.approx(ref.tv.item(), rel=1e-5)
    assert out.conf.item() == pytest.approx(ref.conf.item(), rel=1e-5)


def test_teacher_forced_over_a_reduced_vocabulary_keeps_those_columns(target):
    model = make_model(target)
    with torch.no_grad():
        model.markov_w2.normal_()
    ctx, valid = rand_ctx(model)
    tokens = torch.randint(3, 96, (3, model.cfg.gamma + 1))
    vocab = torch.tensor([0, 5, 17, 40, 95])
    full, conf = model.teacher_forced(ctx, valid, tokens)
    sub, conf_sub = model.teacher_forced(ctx, valid, tokens, vocab)
    assert sub.shape == (3, model.cfg.gamma, 5)
    torch.testing.assert_close(sub, full[..., vocab], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf_sub, conf)
    sub.logsumexp(-1).mean().backward()  # only the vocabulary's Markov rows get a gradient
    rows = model.markov_w2.grad.abs().sum(-1)
    assert rows.nonzero().flatten().tolist() == vocab.tolist()


def test_loss_gradient_does_not_flow_through_soft_label():
    draft = torch.zeros(1, 1, 3, requires_grad=True)
    target = torch.tensor([[[2.0, 0.0, 0.0]]])
    conf = torch.zeros(1, 1)
    out = dspark_loss(draft, target, torch.tensor([[0]]), conf, torch.ones(1, 1, dtype=torch.bool), LossWeights(0, 0, 1))
    out.total.backward()
    assert draft.grad.abs().max() == 0  # Conf trains only the confidence head


# ---------------------------------------------------------------- calibration


def test_ece_and_auc_basics():
    assert ece(np.array([0.9, 0.9]), np.array([1, 0])) == pytest.approx(0.4)
    assert roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)


def test_sts_reduces_ece_on_overconfident_set():
    rng = np.random.default_rng(0)
    n, g = 4000, 5
    true_logit = rng.normal(0.5, 1.5, size=(n, g))
    accepted = (rng.random((n, g)) < sigmoid(true_logit)).astype(float)
    overconfident = 3.0 * true_logit  # logits 3x too sharp
    res = sequential_temperature_scaling(overconfident, accepted)
    assert res.ece_before > 0.05
    assert res.ece_after < 0.02
    assert res.ece_after < res.ece_before / 3
    assert 2.0 < res.temperatures[0] < 4.5  # recovers the over-sharpening at position 1
    assert res.auc_after > 0.7


def test_sts_offsets_fix_a_shifted_set_that_temperatures_cannot():
    """Confidences shifted up (held-out acceptance lower than the head learned): a temperature
    can only flatten them towards 0.5, losing the ranking; an offset per position corrects
    the shift and keeps it."""
    rng = np.random.default_rng(1)
    n, g = 4000, 4
    true_logit = rng.normal(-0.5, 1.5, size=(n, g))
    accepted = (rng.random((n, g)) < sigmoid(true_logit)).astype(float)
    shifted = true_logit + 1.5
    temps_only = sequential_temperature_scaling(shifted, accepted)
    with_offsets = sequential_temperature_scaling(shifted, accepted, offsets=True)
    assert temps_only.offsets is None and len(with_offsets.offsets) == g
    assert with_offsets.ece_after < 0.015 < temps_only.ece_after
    assert with_offsets.auc_after > temps_only.auc_after
    assert -2.0 < with_offsets.offsets[0] < -1.0 and 0.7 < with_offsets.temperatures[0] < 1.4  # undoes the +1.5


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip(tmp_path, target):
    model = make_model(target)
    with torch.no_grad():
        model.markov_w2.normal_()
    save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target), temperatures=[1.5] * 5, dtype=torch.float32)
    drafter = load_drafter(tmp_path / "ck", target)
    assert drafter.temperatures.tolist() == [1.5] * 5 and drafter.offsets.tolist() == [0.0] * 5
    save_checkpoint(tmp_path / "off", model, Fingerprint.of(target), temperatures=[1.5] * 5, offsets=[-0.5, 0, 0, 0, 0.25])
    assert load_drafter(tmp_path / "off", target).offsets.tolist() == [-0.5, 0, 0, 0, 0.25]
    for k, v in model.state_dict().items():
        torch.testing.assert_close(drafter.model.state_dict()[k], v)
    assert drafter.target_layers == model.cfg.target_layers
    # bf16 default halves the size and still loads
    save_checkpoint(tmp_path / "bf", model, Fingerprint.of(target))
    load_drafter(tmp_path / "bf", target)


def test_checkpoint_refuses_another_target(tmp_path, target):
    model = make_model(target)
    save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target))
    other = tiny_target(seed=0, vocab_size=80, name="tiny-other")
    with pytest.raises(TargetMismatchError, match="vocab_size.*tokenizer_hash"):
        load_drafter(tmp_path / "ck", other)
    renamed = tiny_target(seed=0, name="tiny-renamed")  # same tokenizer, other model
    with pytest.raises(TargetMismatchError, match="name"):
        load_drafter(tmp_path / "ck", renamed)
    load_drafter(tmp_path / "ck", renamed, allow_name_mismatch=True)


def test_missing_checkpoint_is_a_clear_error(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="not a DSpark drafter checkpoint"):
        load_drafter(tmp_path, target)
    with pytest.raises(FileNotFoundError, match="No shipped DSpark drafter"):
        load_drafter("default", target)


def resized(model, target, **arch):
    return build_model(DSparkConfig(**{**model.cfg.to_dict(), **arch}), target.model)


def nudge(model) -> None:
    """Trained-looking weights: every head active, zero-initialised ones included."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))


def assert_same_drafter(got, want) -> None:
    """Teacher-forced logits and confidences of two drafters agree on the same random block."""
    ctx, valid = rand_ctx(want)
    tokens = torch.randint(3, 96, (3, want.cfg.gamma + 1))
    with torch.no_grad():
        want_logits, want_conf = want.teacher_forced(ctx, valid, tokens)
        got_logits, got_conf = got.teacher_forced(ctx, valid, tokens)
    torch.testing.assert_close(got_logits, want_logits)
    torch.testing.assert_close(got_conf, want_conf)


@pytest.mark.parametrize("old_rank", [0, 4])
def test_a_warm_start_may_grow_layers_and_markov_rank_and_starts_as_the_same_drafter(tmp_path, target, old_rank):
    from dspark.dspark_drafter.checkpoint import warm_start

    small = resized(make_model(target), target, num_layers=1, markov_rank=old_rank)
    nudge(small)
    save_checkpoint(tmp_path / "small", small, Fingerprint.of(target), dtype=torch.float32)
    big = resized(small, target, num_layers=2, markov_rank=8)
    warm_start(big, tmp_path / "small", target)

    assert_same_drafter(big, small)
    assert big.layers[1].q_proj.weight.abs().sum() > 0  # the new layer trains from a real init
    assert big.markov_w1.weight[:, old_rank:].abs().sum() > 0

    save_checkpoint(tmp_path / "big", big, Fingerprint.of(target), dtype=torch.float32)
    with pytest.raises(ValueError, match="may only grow"):
        warm_start(resized(small, target), tmp_path / "big", target)


def test_a_warm_start_to_rank_0_is_the_drafter_with_its_markov_head_silenced(tmp_path, target):
    """The parallel-only ablation of a trained drafter: same backbone and confidence w_h, no bias."""
    from dspark.dspark_drafter.checkpoint import warm_start

    trained = resized(make_model(target), target, markov_rank=4)
    nudge(trained)
    save_checkpoint(tmp_path / "trained", trained, Fingerprint.of(target), dtype=torch.float32)
    parallel = resized(trained, target, markov_rank=0)
    warm_start(parallel, tmp_path / "trained", target)
    with torch.no_grad():  # silence the head in place: B = W1[x] W2 = 0, confidence without W1[x]
        trained.markov_w2.zero_()
        trained.conf_head.weight[:, trained.cfg.hidden_size:] = 0.0

    assert_same_drafter(parallel, trained)
    with pytest.raises(ValueError, match="drop to 0"):  # other ranks still only grow
        warm_start(resized(trained, target, markov_rank=2), tmp_path / "trained", target)


# ---------------------------------------------------------------- engine plug-in


def fake_hidden(drafter, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, drafter.cfg.target_hidden_size, generator=g) for _ in drafter.target_layers]


def test_plugin_lifecycle_and_chain(target):
    drafter = DSparkDrafter(make_model(target), options=DrafterOptions(branch_width=1), eos_token_ids=[])
    req = DraftRequest(0, [5, 6, 7, 8], SamplingParams())
    first, later = fake_hidden(drafter, 3), fake_hidden(drafter, 10, seed=1)
    drafter.start(req, first)
    assert "ctx_kv" not in req.state and req.state["ctx_pending"].shape[0] == 3  # queued, projected when drafting
    drafter.project_context([req])
    kv_cols = drafter.cfg.num_kv_heads * drafter.cfg.head_dim
    assert [tuple(t.shape) for t in req.state["ctx_kv"][0]] == [(3, kv_cols)] * 2
    (tree,) = drafter.propose([req], max_depth=4)
    tree.validate(96)
    assert len(tree) == 4 and tree.is_chain()
    drafter.observe(req, VerifyOutcome(0, tree, [0], 9, hidden=later))
    drafter.project_context([req])
    # keys/values of the last N committed positions, each projected once
    n = drafter.cfg.context_len
    feats = torch.cat([torch.cat([a, b]) for a, b in zip(first, later)], dim=-1)[-n:]
    with torch.no_grad():  # keys rotated at their positions in the sequence (13 - n .. 12)
        expected = drafter.model.context_kv(drafter.model.project_context(feats), start=13 - n)
    assert req.state["ctx_end"] == 13
    for (k, v), (k_ref, v_ref) in zip(req.state["ctx_kv"], expected):
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)
    assert drafter.propose([req], max_depth=0)[0].tokens == []
    assert len(drafter.propose([req], max_depth=50)[0]) == drafter.cfg.gamma  # capped at gamma
    drafter.finish(req)
    assert req.state == {}


def test_plugin_batch_matches_single(target):
    drafter = DSparkDrafter(make_model(target), eos_token_ids=[])
    reqs = [DraftRequest(i, [5 + i, 6, 7], SamplingParams()) for i in range(3)]
    for i, r in enumerate(reqs):
        drafter.start(r, fake_hidden(drafter, 2 + 2 * i, seed=i))
    batch = drafter.propose(reqs, 5)
    for r, t in zip(reqs, batch):
        (single,) = drafter.propose([r], 5)
        assert single.tokens == t.tokens and single.parents == t.parents
        assert single.confidence == pytest.approx(t.confidence, abs=1e-5)


def test_context_is_projected_once_per_position_in_one_batch_whenever_drafting_needs_it(target):
    """Rows queue their committed states; a propose projects the whole batch's queues at once.
    A row that drafts every round and a row that sat out rounds (queue capped at N) end with
    the keys/values a projection of their last N positions gives."""
    drafter = DSparkDrafter(make_model(target), options=DrafterOptions(branch_width=1), eos_token_ids=[])
    n = drafter.cfg.context_len
    every, idle = (DraftRequest(i, [5, 6, 7], SamplingParams()) for i in range(2))
    chunks = [fake_hidden(drafter, k, seed=k) for k in (5, 3, n, 2)]
    for r in (every, idle):
        drafter.start(r, chunks[0])
    drafter.propose([every, idle], 3)
    for chunk in chunks[1:]:
        for r in (every, idle):
            drafter.observe(r, VerifyOutcome(r.request_id, DraftTree(), [], 9, hidden=chunk))
        drafter.propose([every], 3)  # `idle` sits this round out: its states wait, at most N of them
        assert idle.state["ctx_pending"].shape[0] <= n and "ctx_pending" not in every.state
    drafter.propose([every, idle], 3)
    seen = sum(c[0].shape[0] for c in chunks)
    feats = torch.cat([torch.cat(layer) for layer in zip(*chunks)], dim=-1)[-n:]
    with torch.no_grad():
        expected = drafter.model.context_kv(drafter.model.project_context(feats), start=seen - n)
    for r in (every, idle):
        assert r.state["ctx_end"] == seen
        for (k, v), (k_ref, v_ref) in zip(r.state["ctx_kv"], expected):
            torch.testing.assert_close(k, k_ref)
            torch.testing.assert_close(v, v_ref)


def test_plugin_branches_with_three_candidates(target):
    model = make_model(target)
    drafter = DSparkDrafter(model, options=DrafterOptions(branch_width=3, branch_ratio=0.0, branch_extend=1, max_nodes=64), eos_token_ids=[])
    req = DraftRequest(0, [5, 6, 7], SamplingParams())
    drafter.start(req, fake_hidden(drafter, 2))
    (tree,) = drafter.propose([req], 4)
    tree.validate(96)
    kids = tree.children()
    assert len(kids[0]) == 3  # three candidates after the anchor
    assert tree.max_depth() == 4
    first = kids[0]
    conf = [tree.confidence[i] for i in first]
    assert conf[0] >= conf[1] >= conf[2]  # siblings in priority order
    # the confidence of the main child equals that of its sibling's would-be path start: it
    # depends on the anchor only, so every depth-1 node shares the same c_1 basis
    assert all(0.0 <= c <= 1.0 for c in tree.confidence)


def test_chain_spec_drafts_the_main_chain_of_the_tree(tmp_path, target):
    """`dspark-chain` is the same drafter without branches: its chain is the tree's first-child path."""
    from dspark.drafters import make_drafter

    save_checkpoint(tmp_path / "ck", make_model(target), Fingerprint.of(target), dtype=torch.float32)
    trees = []
    for spec in (f"dspark:{tmp_path / 'ck'}", f"dspark-chain:{tmp_path / 'ck'}"):
        drafter = make_drafter(spec, target)
        req = DraftRequest(0, [5, 6, 7], SamplingParams())
        drafter.start(req, fake_hidden(drafter, 2))
        trees.append(drafter.propose([req], 4)[0])
    tree, chain = trees
    assert not tree.is_chain()  # the random tiny drafter's top choices are close: it branches
    assert chain.is_chain() and len(chain) == 4
    kids, node, main = tree.children(), -1, []
    while kids[node + 1]:  # kids[0]: the anchor's children
        node = kids[node + 1][0]
        main.append(tree.tokens[node])
    assert chain.tokens == main


def sampled_chains(drafter, token_ids: list[int], sampling: SamplingParams, seeds, depth: int) -> list[list[int]]:
    """The chain the drafter draws for each row seed (the engine's noise for that row)."""
    chains = []
    for seed in seeds:
        req = DraftRequest(0, list(token_ids), sampling, noise=SamplingNoise(seed, 96))
        drafter.start(req, fake_hidden(drafter, len(token_ids) - 1))
        (tree,) = drafter.propose([req], depth)
        tree.validate(96)
        assert tree.is_chain()
        chains.append(tree.tokens)
        drafter.finish(req)
    return chains


def test_plugin_sampling_chain_draws_with_the_request_noise(target):
    """A sampled row's chain is a function of its noise: the same seed drafts the same chain,
    other seeds draw other tokens, never outside top-k."""
    drafter = DSparkDrafter(make_model(target), eos_token_ids=[])
    sampling = SamplingParams(temperature=0.8, top_k=20)
    chains = sampled_chains(drafter, [5, 6, 7], sampling, range(200), 5)
    assert all(len(c) == 5 for c in chains)
    assert sampled_chains(drafter, [5, 6, 7], sampling, [3], 5)[0] == chains[3]
    per_depth = [{c[k] for c in chains} for k in range(5)]
    assert all(len(drawn) <= 20 for drawn in per_depth) and max(len(drawn) for drawn in per_depth) > 1


def test_plugin_without_prompt_hidden_still_drafts(target):
    drafter = DSparkDrafter(make_model(target), eos_token_ids=[])
    req = DraftRequest(0, [5], SamplingParams())
    drafter.start(req, None)
    (tree,) = drafter.propose([req], 3)
    assert len(tree) >= 3


@pytest.mark.embedded
def test_shipped_checkpoint_loads_for_the_embedded_target(embedded_fp32):
    from dspark.drafters import make_drafter

    drafter = make_drafter("dspark", embedded_fp32)  # the registry name resolves to the shipped checkpoint
    assert isinstance(drafter, DSparkDrafter) and drafter.cfg.vocab_size == embedded_fp32.vocab_size
    ids = embedded_fp32.encode("What is 2 + 2?")
    req = DraftRequest(0, ids, SamplingParams())
    layers = [torch.zeros(len(ids) - 1, drafter.cfg.target_hidden_size) for _ in drafter.target_layers]
    drafter.start(req, layers)
    (tree,) = drafter.propose([req], 7)
    tree.validate(embedded_fp32.vocab_size)
    assert 1 <= tree.max_depth() <= 7


# ---------------------------------------------------------------- reduced draft vocabulary


def test_frequent_tokens_ranks_by_count_then_id_and_keeps_always():
    seqs = [[5, 5, 5, 9, 9, 2], [9, 7, 7, 3]]
    assert frequent_tokens(seqs, 2).tolist() == [5, 9]  # 5 x3, 9 x3
    assert frequent_tokens(seqs, 3).tolist() == [5, 7, 9]  # 7 x2 beats 2 and 3
    assert frequent_tokens(seqs, 1, always=[0]).tolist() == [0, 5]
    with pytest.raises(ValueError):
        frequent_tokens(seqs, 0)


def test_grow_vocab_keeps_the_trained_tokens_and_adds_the_most_frequent_others():
    seqs = [[5, 5, 5, 9, 9, 2], [9, 7, 7, 3]]
    kept = torch.tensor([0, 2])
    assert grow_vocab(kept, seqs, 4).tolist() == [0, 2, 5, 9]  # 5 x3, 9 x3; 2 is already in
    assert grow_vocab(kept, seqs, 5).tolist() == [0, 2, 5, 7, 9]
    assert grow_vocab(kept, seqs, 1).tolist() == [0, 2]  # never shrinks
    assert grow_vocab(kept, seqs, 50).tolist() == [0, 2, 3, 5, 7, 9]  # as many as there are


def masked_greedy_chain(model, ctx, valid, anchor, subset, depth):
    """What a reduced-vocabulary drafter must propose: the full model's Markov chain with
    every token outside `subset` forbidden."""
    out = model.forward_block(ctx, valid, anchor, depth)
    forbid = torch.full((model.cfg.vocab_size,), float("-inf"))
    forbid[subset] = 0.0
    prev, chain = anchor, []
    for k in range(depth):
        logits = out.base_logits[:, k] + model.markov_bias(model.markov_features(prev)) + forbid
        prev = logits.argmax(-1)
        chain.append(int(prev))
    return chain


def test_reduced_vocab_drafts_the_masked_chain(target):
    model = make_model(target)
    with torch.no_grad():
        model.markov_w2.normal_()
    subset = torch.tensor([3, 10, 11, 40, 41, 42, 77, 90])
    drafter = DSparkDrafter(model, options=DrafterOptions(branch_width=1), eos_token_ids=[], draft_vocab=subset)
    req = DraftRequest(0, [5, 6, 7], SamplingParams())
    hidden = fake_hidden(drafter, 4)
    drafter.start(req, hidden)
    (tree,) = drafter.propose([req], 5)
    tree.validate(96)
    assert set(tree.tokens) <= set(subset.tolist())
    with torch.no_grad():
        ctx = model.project_context(torch.cat(hidden, dim=-1))[None]  # [1, 4, d]
    valid = torch.ones(1, 4, dtype=torch.bool)
    assert tree.tokens == masked_greedy_chain(model, ctx, valid, torch.tensor([7]), subset, 5)
    # the whole vocabulary as the "subset" drafts exactly what the full drafter drafts
    everything = DSparkDrafter(model, eos_token_ids=[], draft_vocab=torch.arange(96))
    full = DSparkDrafter(model, eos_token_ids=[])
    for d in (everything, full):
        d.start(req, fake_hidden(drafter, 4))
    a, b = everything.propose([req], 5)[0], full.propose([req], 5)[0]
    assert (a.tokens, a.parents) == (b.tokens, b.parents)
    assert a.confidence == pytest.approx(b.confidence, abs=1e-6)


def test_reduced_vocab_sampling_draws_from_the_subset(target):
    subset = torch.tensor([1, 2, 3, 50, 60, 70])
    drafter = DSparkDrafter(make_model(target), eos_token_ids=[], draft_vocab=subset)
    chains = sampled_chains(drafter, [5, 6, 7], SamplingParams(temperature=1.0), range(100), 5)
    drawn = {t for c in chains for t in c}
    assert drawn <= set(subset.tolist()) and len(drawn) > 1


def test_checkpoint_carries_its_draft_vocabulary(tmp_path, target):
    model = make_model(target)
    save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target))
    assert load_drafter(tmp_path / "ck", target).vocab.token_ids is None  # none saved: all V
    save_draft_vocab(tmp_path / "ck", torch.tensor([2, 4, 8, 16]))
    assert load_drafter(tmp_path / "ck", target).vocab.token_ids.tolist() == [2, 4, 8, 16]
    assert load_drafter(tmp_path / "ck", target, full_vocab=True).vocab.token_ids is None
    save_draft_vocab(tmp_path / "ck", torch.tensor([2, 4, 500]))  # 500 >= vocab size 96
    with pytest.raises(ValueError, match="inside the vocabulary"):
        load_drafter(tmp_path / "ck", target)


def test_w2_is_stored_over_the_draft_vocabulary_and_drafts_the_same(tmp_path, target):
    model = make_model(target)  # Markov rank 8
    with torch.no_grad():
        model.markov_w2.normal_()  # a trained W2 (a fresh one is zero)
    vocab = torch.tensor([0, 3, 5, 9, 17, 40, 41, 42, 43, 44, 95])
    with pytest.raises(ValueError, match="outside the draft vocabulary"):
        save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target), dtype=torch.float32, draft_vocab=vocab)
    before = model.markov_w2.detach().clone()
    assert confine_markov_head(model, vocab) == 96 - len(vocab)
    assert torch.equal(model.markov_w2[vocab], before[vocab]) and int(model.markov_w2.count_nonzero(dim=1).gt(0).sum()) == len(vocab)
    save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target), dtype=torch.float32, draft_vocab=vocab)

    stored = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert "markov_w2" not in stored and stored["markov_w2.draft_rows"].shape == (len(vocab), 8)
    ck = read_checkpoint(tmp_path / "ck")
    assert torch.equal(ck.state["markov_w2"], model.markov_w2.detach()) and torch.equal(ck.draft_vocab, vocab)
    hidden = fake_hidden(DSparkDrafter(model, eos_token_ids=[]), 6)

    def chain(m):
        drafter = DSparkDrafter(m, options=DrafterOptions(branch_width=1), eos_token_ids=[], draft_vocab=vocab)
        req = DraftRequest(0, [40, 41, 42, 43, 44, 40, 41], SamplingParams())
        drafter.start(req, hidden)
        return drafter.propose([req], 5)[0].tokens

    assert chain(load_drafter(tmp_path / "ck", target).model) == chain(model)

    (tmp_path / "ck" / "draft_vocab.safetensors").unlink()  # the rows mean nothing without their tokens
    with pytest.raises(ValueError, match="draft-vocabulary rows"):
        read_checkpoint(tmp_path / "ck")


# ---------------------------------------------------------------- copy prior


def test_copy_prior_copies_a_repeated_phrase_even_outside_the_draft_vocabulary(target):
    model = make_model(target)
    subset = torch.tensor([0, 1, 2, 3])  # none of the phrase's tokens
    prior = CopyPrior(((3, 1e4),))  # overwhelming: the chain must follow the earlier occurrence
    drafter = DSparkDrafter(model, options=DrafterOptions(branch_width=1), eos_token_ids=[], draft_vocab=subset, copy=prior)
    req = DraftRequest(0, [40, 41, 42, 43, 44, 40, 41], SamplingParams())
    drafter.start(req, fake_hidden(drafter, 6))
    (tree,) = drafter.propose([req], 5)
    tree.validate(96)
    assert tree.tokens == [42, 43, 44, 40, 41]  # (40, 41) -> 42 -> 43 -> 44, then along the path itself
    # committed tokens join the index: after the round the phrase continues from the new tail
    req.token_ids += [42, 43]
    drafter.observe(req, VerifyOutcome(0, tree, [0], 43, hidden=fake_hidden(drafter, 2, seed=1)))
    assert req.state["ngrams"].size == len(req.token_ids)
    assert drafter.propose([req], 2)[0].tokens == [44, 40]
    # without the prior: only draft-vocabulary tokens
    plain = DSparkDrafter(model, options=DrafterOptions(branch_width=1), eos_token_ids=[], draft_vocab=subset)
    plain.start(req, fake_hidden(drafter, 8))
    assert set(plain.propose([req], 5)[0].tokens) <= set(subset.tolist())


def learned_rule() -> CopyScorer:
    """A copy scorer with hand-set weights under which, in the chains below, some steps copy
    and others follow the model; confidence corrections per match class as a calibrated
    checkpoint has them."""
    names = scorer_features((2, 3))
    weights = {"bias": 1.0, "gap": -3.0, "2u": -0.5, "3c": 1.0, "agree": 0.5, "log_distance": -0.4, "confidence": 0.3, "from_prompt": 0.2}
    return CopyScorer((2, 3), tuple(weights.get(n, 0.0) for n in names), ((0, 1.0, -0.5), (2, 0.5, 1.0), (3, 2.0, 0.25)))


@pytest.mark.parametrize("rule", ["bonuses", "scorer"])
@pytest.mark.parametrize("vocab", [None, "reduced"])
def test_runtime_copy_chain_equals_the_offline_walk(target, vocab, rule):
    """The engine plug-in proposes exactly the chain the offline evaluation scores: the
    Markov walk with the copy rule (bonuses, or the learned scorer), copied tokens scored from
    their LM-head rows."""
    from dspark.training.trainer import free_running

    model = make_model(target)
    with torch.no_grad():
        model.markov_w2.normal_()
    subset = None if vocab is None else torch.tensor(sorted({3, 5, 6, 10, 11, 40, 41, 77, 90}))
    # small bonuses: in these chains some steps copy, others follow the model; confidence
    # corrections per match class as a calibrated checkpoint has them
    prior = CopyPrior(((2, 0.6), (3, 1.2)), ((0, 1.0, -0.5), (2, 0.5, 1.0), (3, 2.0, 0.25))) if rule == "bonuses" else learned_rule()
    plain = DSparkDrafter(model, options=DrafterOptions(branch_width=1), eos_token_ids=[], draft_vocab=subset)
    changed = 0
    drafter = DSparkDrafter(model, options=DrafterOptions(branch_width=1), eos_token_ids=[], draft_vocab=subset, copy=prior)
    seen_classes = set()
    for seed, tokens in enumerate(([5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3, 1, 2, 4, 1, 2], [9, 8, 9, 8, 9])):
        req = DraftRequest(0, list(tokens), SamplingParams())
        hidden = fake_hidden(drafter, len(tokens) - 1, seed=seed)
        drafter.start(req, hidden)
        (tree,) = drafter.propose([req], 5)
        alone = DraftRequest(0, list(tokens), SamplingParams())
        plain.start(alone, hidden)
        changed += plain.propose([alone], 5)[0].tokens != tree.tokens
        with torch.no_grad():
            ctx = model.project_context(torch.cat(hidden, dim=-1)[-model.cfg.context_len :])[None]
            out = model.forward_block(ctx, torch.ones(1, ctx.shape[1], dtype=torch.bool), torch.tensor([tokens[-1]]), 5)
            masked = out.base_logits.clone()
            if subset is not None:
                forbid = torch.full((96,), float("-inf"))
                forbid[subset] = 0.0
                masked = masked + forbid
            chain, conf, classes = free_running(model, masked, out.conf_h, torch.tensor([tokens[-1]]), True, prior,
                                                [(NgramIndex(prior.orders, tokens, prompt_len=len(tokens) - 1), list(tokens))], out.base_logits)
        assert tree.tokens == chain[0].tolist()
        adjusted = adjust_logits(prior, conf[0].numpy(), classes[0].numpy())  # the class corrections
        assert tree.confidence == pytest.approx((1 / (1 + np.exp(-adjusted))).tolist(), abs=1e-5)
        seen_classes.update(classes[0].tolist())
    if rule == "bonuses":
        assert seen_classes == {0, 2, 3}  # steps without a match, and with matches of both orders
    else:
        assert seen_classes - {0} and changed >= 1  # the learned rule made the drafter propose something else


def test_copy_prior_sampling_draws_copied_tokens_outside_the_vocabulary(target):
    subset = torch.tensor([1, 2, 3])
    prior = CopyPrior(((2, 6.0),))
    drafter = DSparkDrafter(make_model(target), eos_token_ids=[], draft_vocab=subset, copy=prior)
    chains = sampled_chains(drafter, [50, 60, 50, 60, 50], SamplingParams(temperature=1.0), range(100), 4)
    assert {t for c in chains for t in c} <= set(subset.tolist()) | {50, 60}  # the vocabulary plus what the prior copies
    assert any(c[0] == 60 for c in chains)  # after 50 the sequence had 60: its column can be drawn


@pytest.mark.parametrize("rule", ["bonuses", "scorer"])
def test_checkpoint_carries_its_copy_prior(tmp_path, target, rule):
    model = make_model(target)
    prior = CopyPrior(((2, 0.0), (3, 8.0))) if rule == "bonuses" else learned_rule()
    save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target), copy_prior=prior)
    assert load_drafter(tmp_path / "ck", target).copy == prior
    assert load_drafter(tmp_path / "ck", target, copy_prior=False).copy is None
    save_checkpoint(tmp_path / "none", model, Fingerprint.of(target))
    assert load_drafter(tmp_path / "none", target).copy is None
