"""Drafter training pieces: split, self-distillation cache, batches, deterministic resumable
training, and a tiny train-then-generate run that must stay lossless."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import yaml
import torch

from dspark.dspark_drafter import DSparkConfig, Fingerprint, build_model, load_drafter, save_checkpoint
from dspark.dspark_drafter.copy_prior import CopyPrior, CopyScorer
from dspark.training.cache import CacheReader, anchors_for, build_cache, make_batch
from dspark.training.data import Prompt, Rewrite, load_prompts, plan_generation, read_jsonl, rewrite_prompts, split_of
from dspark.dspark_drafter.vocab import frequent_tokens, save_draft_vocab
from dspark.training.record import answer_tokens, generate_with_cache
from dspark.training.tiny import tiny_target
from dspark.training.trainer import TrainConfig, check_domain_weights, epoch_plan, evaluate, freeze_all_but, monitor_tau, spread, train

LAYERS = (1, 3)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on the shared 2-core machine two OpenMP threads contend with other
    processes and spin, which made these tests ~20x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0, layers=4)


def tiny_plan(n: int, start: int = 0) -> list:
    g = np.random.default_rng(start)
    return [
        (Prompt(f"p{start + i}", f"src{i % 2}", ["math", "chat"][i % 2], "x"), [1] + [int(x) for x in g.integers(3, 96, 4 + i % 5)])
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, target):
    d = tmp_path_factory.mktemp("cache")
    generate_with_cache(target, tiny_plan(12), d, LAYERS, context_len=6, batch_size=6, max_new_tokens=24, shard_size=6, log=lambda m: None)
    return d


def drafter_cfg(target, **kw) -> DSparkConfig:
    base = dict(num_layers=1, num_heads=4, num_kv_heads=2, gamma=4, context_len=6, markov_rank=16, target_layers=LAYERS)
    return DSparkConfig.for_target(target.model.config, **{**base, **kw})


def test_split_is_a_deterministic_function_of_id():
    ids = [f"x-{i}" for i in range(4000)]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]
    frac = {s: splits.count(s) / len(ids) for s in ("train", "calib", "eval")}
    assert abs(frac["eval"] - 1 / 8) < 0.02 and abs(frac["calib"] - 1 / 16) < 0.015


def test_a_derived_prompt_takes_its_base_prompts_split():
    """`<id>+<tag>` hashes as `<id>`: an eval or calib article never reaches training under a
    new instruction, while its own hash would land ~7/8 of them in train."""
    ids = [f"x-{i}" for i in range(400)]
    assert {split_of(i) for i in ids} == {"train", "calib", "eval"}
    assert all(split_of(f"{i}+brief") == split_of(f"{i}+points") == split_of(i) for i in ids)


def test_a_rewrite_swaps_the_instruction_of_its_domain_only():
    prompts = [
        Prompt("n-1", "news", "summarization", "Summarise the article:\n\nRain fell. Summarise the article: twice."),
        Prompt("n-2", "news", "summarization", "Other instruction:\n\nText."),
        Prompt("q-1", "qa", "chat", "Summarise the article:\n\nNot news."),
    ]
    rw = Rewrite.from_dict({"tag": "brief", "domain": "summarization", "find": "Summarise the article:", "replace": "Be brief:"})
    (p,) = rewrite_prompts(prompts, rw)
    assert (p.id, p.source, p.domain) == ("n-1+brief", "news", "summarization")
    assert p.text == "Be brief:\n\nRain fell. Summarise the article: twice."  # the first occurrence only
    assert p.split == prompts[0].split
    assert rewrite_prompts([p], rw) == []  # derived prompts are not rewritten again
    with pytest.raises(ValueError, match="replace"):
        Rewrite.from_dict({"tag": "b", "domain": "summarization", "find": "x"})
    with pytest.raises(ValueError, match="tag"):
        Rewrite.from_dict({"tag": "a~b", "domain": "summarization", "find": "x", "replace": "y"})


def test_load_prompts_keeps_unicode_line_separators(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "a-1", "domain": "chat", "turns": ["one\u2028two", "t2"]}, ensure_ascii=False) + "\n")
    (p,) = load_prompts(tmp_path)
    assert p.text == "one\u2028two" and p.source == "a" and p.split == split_of("a-1")


def test_prompt_limits_can_be_set_per_domain():
    # ids chosen so that all land in the train split
    ids = [i for i in (f"q{n}" for n in range(200)) if split_of(i) == "train"][:4]
    prompts = [
        Prompt(ids[0], "news", "summarization", "n" * 600),
        Prompt(ids[1], "news", "summarization", "n" * 900),
        Prompt(ids[2], "qa", "chat", "c" * 100),
        Prompt(ids[3], "qa", "chat", "c" * 300),
    ]
    encode = lambda text: list(range(len(text)))  # noqa: E731  one token per character
    one_limit = plan_generation(prompts, encode, "train", 256)
    assert [p.id for p, _ in one_limit] == [ids[2]]
    per_domain = plan_generation(prompts, encode, "train", {"default": 256, "summarization": 768})
    assert [p.id for p, _ in per_domain] == [ids[2], ids[0]]  # shortest first
    with pytest.raises(ValueError, match="default"):
        plan_generation(prompts, encode, "train", {"summarization": 768})


def test_recorded_cache_matches_a_full_forward(cache_dir, target, tmp_path):
    rd = CacheReader(cache_dir)
    assert len(rd.rows) == 12 and len(rd.shards) == 2
    # rerun: nothing to do (resumable)
    assert generate_with_cache(target, tiny_plan(12), cache_dir, LAYERS, 6, 6, 24, 6, log=lambda m: None) == 0
    # the same answers through a separate full forward (build_cache) give the same states
    build_cache(target, cache_dir / "answers.jsonl", tmp_path / "full", LAYERS, 6, shard_size=6, log=lambda m: None)
    full = CacheReader(tmp_path / "full")
    by_id = {r.id: r for r in full.rows}
    for info in rd.rows[:4]:
        a = CacheReader.row(rd.load_shard(info.shard), info.row)
        o = by_id[info.id]
        b = CacheReader.row(full.load_shard(o.shard), o.row)
        assert a["tokens"].tolist() == b["tokens"].tolist() and info.answer_start == o.answer_start
        n = len(a["tokens"]) - 1  # the last token's states are never computed while generating
        torch.testing.assert_close(a["feats"][:n].float(), b["feats"][:n].float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(a["final"][:n].float(), b["final"][:n].float(), atol=0.05, rtol=0.02)


def test_a_shard_moved_out_of_the_cache_is_never_written_over(cache_dir, target, tmp_path):
    """With the first of two shards moved aside, its prompts are answered again into a new
    shard after the highest one, not into the surviving shard's name."""
    import shutil

    d = tmp_path / "cache"
    shutil.copytree(cache_dir, d)
    kept = CacheReader(d).shards[1].read_bytes()
    shutil.move(d / "shard_00000.safetensors", tmp_path / "aside.safetensors")
    assert generate_with_cache(target, tiny_plan(12), d, LAYERS, 6, 6, 24, 6, log=lambda m: None) == 6
    assert sorted(p.name for p in d.glob("shard_*")) == ["shard_00001.safetensors", "shard_00002.safetensors"]
    assert (d / "shard_00001.safetensors").read_bytes() == kept
    assert len(CacheReader(d).rows) == 12


def test_a_sampled_pass_adds_second_answers_to_the_same_prompts(target, tmp_path):
    d = tmp_path / "cache"
    plan = tiny_plan(6)
    args = dict(batch_size=6, max_new_tokens=24, shard_size=6, log=lambda m: None)
    generate_with_cache(target, plan, d, LAYERS, 6, **args)
    assert generate_with_cache(target, plan, d, LAYERS, 6, temperature=8.0, tag="t1", **args) == 6
    assert generate_with_cache(target, plan, d, LAYERS, 6, temperature=8.0, tag="t1", **args) == 0  # resumable
    rows = {r["id"]: r for r in read_jsonl(d / "answers.jsonl")}
    assert sorted(rows) == sorted([p.id for p, _ in plan] + [f"{p.id}~t1" for p, _ in plan])
    for p, ids in plan:  # the same prompt and split, a different (sampled) answer
        sampled = rows[f"{p.id}~t1"]
        assert sampled["prompt_ids"] == ids and sampled["split"] == p.split
    assert any(rows[p.id]["output_ids"] != rows[f"{p.id}~t1"]["output_ids"] for p, _ in plan)
    # seeded per row: a fresh run writes the same sampled answers
    generate_with_cache(target, plan, tmp_path / "again", LAYERS, 6, temperature=8.0, tag="t1", **args)
    again = {r["id"]: r["output_ids"] for r in read_jsonl(tmp_path / "again" / "answers.jsonl")}
    assert again == {k: v["output_ids"] for k, v in rows.items() if k.endswith("~t1")}
    assert {r.id for r in CacheReader(d).rows} == set(rows)
    with pytest.raises(ValueError, match="tag"):
        generate_with_cache(target, plan, d, LAYERS, 6, temperature=8.0, **args)


def test_anchors_and_batch_layout(cache_dir):
    rd = CacheReader(cache_dir)
    info = rd.rows[0]
    anchors = anchors_for(info, gamma=4, stride=1)
    assert anchors[0] == info.answer_start - 1 and anchors[-1] == info.length - 2
    full = anchors_for(info, gamma=4, stride=1, full_blocks=True)
    assert full[-1] == info.length - 5
    row = CacheReader.row(rd.load_shard(0), 0)
    a = anchors[-1]
    b = make_batch([(row, [anchors[0], a])], gamma=4, context_len=6)
    # one context row for the sequence, from the first block's window to the last anchor
    lo = max(0, anchors[0] - 6)
    assert b.ctx_feats.shape == (1, a - lo, row["feats"].shape[1]) and b.tokens.shape == (2, 5)
    torch.testing.assert_close(b.ctx_feats[0], row["feats"][lo:a])
    assert b.ctx_index.tolist() == [0, 0] and b.block_pos.tolist() == [anchors[0] - lo, a - lo]
    assert b.valid[1].tolist() == [True, False, False, False]  # block runs past the end
    assert b.tokens[0].tolist() == row["tokens"][anchors[0] : anchors[0] + 5].tolist()
    # each block sees the context_len positions right before its own anchor
    for i, anchor in enumerate([anchors[0], a]):
        seen = torch.nonzero(b.ctx_valid[i]).flatten() + lo
        assert seen.tolist() == list(range(max(0, anchor - 6), anchor))


def test_domain_weights_set_how_often_an_epoch_walks_each_domain(cache_dir):
    rd = CacheReader(cache_dir)
    rows = list(range(len(rd.rows)))
    base = TrainConfig(batch_size=8, anchor_stride=2)

    def blocks(weights: dict) -> Counter:
        plan = epoch_plan(rd, rows, 4, TrainConfig(**{**base.__dict__, "domain_weights": weights}), epoch=0)
        return Counter(rd.rows[r].domain for batch in plan for r, _ in batch)

    assert epoch_plan(rd, rows, 4, base, 0) == epoch_plan(rd, rows, 4, TrainConfig(**{**base.__dict__, "domain_weights": {"chat": 1.0}}), 0)
    usual = blocks({})
    usual_per_row = Counter(r for batch in epoch_plan(rd, rows, 4, base, 0) for r, _ in batch)
    twice = blocks({"chat": 2.0, "math": 0.0})
    assert twice["math"] == 0
    # each of the two walks of an answer takes its own anchor phase: 2x the blocks, +-1 per walk
    n_chat = sum(r.domain == "chat" for r in rd.rows)
    assert abs(twice["chat"] - 2 * usual["chat"]) <= 2 * n_chat
    # weight 0.5: each math answer walked whole or not at all, about half of them (seeded)
    plan = epoch_plan(rd, rows, 4, TrainConfig(**{**base.__dict__, "domain_weights": {"math": 0.5}}), 0)
    walked = {r for batch in plan for r, _ in batch if rd.rows[r].domain == "math"}
    n_math = sum(r.domain == "math" for r in rd.rows)
    assert 0 < len(walked) < n_math
    per_row = Counter(r for batch in plan for r, _ in batch)
    assert all(abs(per_row[r] - usual_per_row[r]) <= 1 for r in walked)
    with pytest.raises(ValueError, match="not a domain"):
        check_domain_weights({"maths": 2.0}, {r.domain for r in rd.rows})
    with pytest.raises(ValueError, match=">= 0"):
        check_domain_weights({"math": -1.0}, {"math"})


def drafter_with_live_heads(target):
    """A seeded untrained drafter whose Markov bias and confidence head are not zero (as
    initialised), so chains and confidences depend on every part of the block forward."""
    torch.manual_seed(0)
    model = build_model(drafter_cfg(target), target.model)
    with torch.no_grad():
        model.markov_w2.normal_(std=0.5)
        model.conf_head.weight.normal_()
    return model


def test_blocks_sharing_a_context_row_see_what_they_would_see_alone(cache_dir, target):
    """Grouping a sequence's anchors (one context projection) changes nothing a block computes."""
    from dspark.training.trainer import ShardPool, forward_batch, load_batch

    model = drafter_with_live_heads(target)
    rd = CacheReader(cache_dir)
    pool = ShardPool(rd, 2)
    items = [(r, a) for r in (0, 1) for a in anchors_for(rd.rows[r], 4, 3)]
    together = load_batch(pool, items, 4, 6)
    assert together.ctx_feats.shape[0] == 2 and together.tokens.shape[0] == len(items)
    logits, conf = forward_batch(model, together, autocast=False)
    for i, item in enumerate(items):
        alone = load_batch(pool, [item], 4, 6)
        assert alone.ctx_feats.shape[1] <= 6
        l1, c1 = forward_batch(model, alone, autocast=False)
        torch.testing.assert_close(logits[i], l1[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(conf[i], c1[0], atol=1e-4, rtol=1e-4)


def test_training_is_deterministic_and_resumes_exactly(cache_dir, target, tmp_path):
    rd = CacheReader(cache_dir)
    rows = list(range(len(rd.rows)))
    cfg = TrainConfig(steps=6, batch_size=8, warmup=2, save_every=3, eval_every=1000, autocast_bf16=False, seed=3)

    def fresh():
        torch.manual_seed(0)
        return build_model(drafter_cfg(target), target.model)

    a = fresh()
    train(a, rd, rows, cfg, tmp_path / "a", progress=False, log=lambda m: None)
    b = fresh()
    train(b, rd, rows, TrainConfig(**{**cfg.__dict__, "steps": 3}), tmp_path / "b", progress=False, log=lambda m: None)
    b2 = fresh()  # a new process: everything comes back from the saved state
    counters = train(b2, rd, rows, cfg, tmp_path / "b", progress=False, log=lambda m: None)
    assert counters["step"] == 6
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b2.state_dict()[k], v, atol=1e-6, rtol=1e-5)


def test_trainable_trains_the_named_parameters_and_leaves_the_rest_as_they_were(cache_dir, target, tmp_path):
    rd = CacheReader(cache_dir)
    torch.manual_seed(0)
    model = build_model(drafter_cfg(target), target.model)
    with torch.no_grad():  # a trained-looking start: W2 = 0 would give W1 no gradient
        model.markov_w2.normal_(std=0.05)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = TrainConfig(steps=3, batch_size=8, warmup=1, eval_every=1000, autocast_bf16=False, trainable=["markov_", "conf_head"])
    train(model, rd, list(range(len(rd.rows))), cfg, tmp_path / "s", progress=False, log=lambda m: None)
    after = model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved == {"markov_w1.weight", "markov_w2", "conf_head.weight", "conf_head.bias"}

    with pytest.raises(ValueError, match=r"\['markov_head'\] name no parameter"):
        train(build_model(drafter_cfg(target), target.model), rd, [0], TrainConfig(steps=1, trainable=["markov_head"]),
              tmp_path / "t", progress=False, log=lambda m: None)
    with pytest.raises(ValueError, match="nothing would train"):
        freeze_all_but(build_model(drafter_cfg(target), target.model), [])

    # the train stage counts what trains: the Markov and confidence weights only
    import shutil

    from pipelines.train_drafter import stage_train

    shutil.copytree(cache_dir, tmp_path / "work" / "cache" / "train")
    model_cfg = dict(num_layers=1, num_heads=4, num_kv_heads=2, gamma=4, context_len=6, markov_rank=16, target_layers=list(LAYERS))
    lines: list[str] = []
    stage_train({"model": model_cfg, "train": {"steps": 0, "batch_size": 8, "eval_every": 1000, "autocast_bf16": False,
                                               "trainable": ["markov_", "conf_head"]}},
                target, tmp_path / "work", lines.append, None, progress=False)
    heads = sum(p.numel() for name, p in model.named_parameters() if name.startswith(("markov_", "conf_head")))
    everything = sum(p.numel() for p in model.parameters())
    assert f"{heads / 1e6:.2f}" != f"{everything / 1e6:.2f}"  # the log tells the two apart at this size
    assert any(f"model {heads / 1e6:.2f} M trainable params" in line for line in lines)


def test_the_held_out_monitor_can_walk_answers_round_by_round(cache_dir, target, tmp_path):
    rd = CacheReader(cache_dir)
    rows = list(range(len(rd.rows)))
    cfg = TrainConfig(steps=2, batch_size=8, warmup=1, eval_every=2, autocast_bf16=False, eval_answers=3)
    torch.manual_seed(0)
    model = build_model(drafter_cfg(target), target.model)
    counters = train(model, rd, rows, cfg, tmp_path / "s", {"eval": (rd, rows)}, progress=False, log=lambda m: None)
    rec = counters["history"][-1]
    assert spread(list(range(10, 20)), 4) == [10, 13, 16, 19] and spread(rows, 99) == rows
    picked = spread(rows, 3)
    walked = evaluate(model, rd, picked, stride=1).decoded_tau()
    assert rec["tau_kind"] == "per round" and rec["tau_eval"] == pytest.approx(walked)
    # the figures it could be confused with differ here: the anchor average of the same answers,
    # the walk over every answer
    assert walked != pytest.approx(evaluate(model, rd, picked, stride=1).tau())
    assert walked != pytest.approx(evaluate(model, rd, rows, stride=1).decoded_tau())
    # without eval_answers the monitor is the per-anchor average (the default)
    assert monitor_tau(model, rd, rows, TrainConfig(eval_stride=1, eval_max_blocks=None), None) == pytest.approx(evaluate(model, rd, rows, stride=1).tau())


def test_tiny_train_then_generate_is_lossless(cache_dir, target, tmp_path):
    from dspark.generator import DSparkGenerator

    rd = CacheReader(cache_dir)
    torch.manual_seed(0)
    model = build_model(drafter_cfg(target), target.model)
    rows = list(range(len(rd.rows)))
    before = evaluate(model, rd, rows, stride=1, autocast=False).tau()
    cfg = TrainConfig(steps=120, batch_size=16, lr=3e-3, warmup=10, save_every=1000, eval_every=1000, autocast_bf16=False)
    train(model, rd, rows, cfg, tmp_path / "state", progress=False, log=lambda m: None)
    after = evaluate(model, rd, rows, stride=1, autocast=False)
    assert after.tau() > before + 0.3  # it learned the target's continuations (train split)
    save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target), temperatures=[1.0] * 4)

    prompts = [ids for _, ids in tiny_plan(4, start=100)]
    ref = DSparkGenerator(target, drafter=None, scheduler="ar", max_batch_size=4).generate(prompts, max_new_tokens=20)
    for sched in ("fixed:4", "threshold:0.2", "dspark"):
        drafter = load_drafter(tmp_path / "ck", target)
        got = DSparkGenerator(target, drafter=drafter, scheduler=sched, max_batch_size=3).generate(prompts, max_new_tokens=20)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref], sched
    # the branching drafter (3 candidates per step) through the same engine
    from dspark.dspark_drafter import DrafterOptions

    drafter = load_drafter(tmp_path / "ck", target, options=DrafterOptions(branch_width=3, branch_ratio=0.0))
    got = DSparkGenerator(target, drafter=drafter, scheduler="fixed:8", max_batch_size=4).generate(prompts, max_new_tokens=20)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    # A reduced draft vocabulary (8 of the 12 tokens the target emitted; each tiny answer repeats
    # one token) is still lossless, chains and trees, at batch 1 and 3, and still accepts drafts
    # on the training prompts whose answer token it kept.
    vocab = frequent_tokens(answer_tokens(cache_dir / "answers.jsonl"), 8)
    assert len(vocab) == 8
    save_draft_vocab(tmp_path / "ck", vocab)
    seen = [ids for _, ids in tiny_plan(12)][:6]
    ref = DSparkGenerator(target, drafter=None, scheduler="ar", max_batch_size=4).generate(seen + prompts, max_new_tokens=20)
    for width, batch in ((1, 1), (3, 3)):
        drafter = load_drafter(tmp_path / "ck", target, options=DrafterOptions(branch_width=width, branch_ratio=0.0))
        assert drafter.vocab.size == 8
        got = DSparkGenerator(target, drafter=drafter, scheduler="fixed:4", max_batch_size=batch).generate(seen + prompts, max_new_tokens=20)
        assert [r.token_ids for r in got] == [r.token_ids for r in ref]
        assert sum(r.stats.accepted for r in got) > 0


def test_offline_chain_equals_the_plugin_chain(cache_dir, target):
    """The report's offline evaluation drafts exactly what the engine plug-in drafts."""
    from dspark.drafters.base import DraftRequest
    from dspark.dspark_drafter import DrafterOptions, DSparkDrafter
    from dspark.sampling import SamplingParams
    from dspark.training.trainer import free_running, load_batch, ShardPool

    model = drafter_with_live_heads(target)
    rd = CacheReader(cache_dir)
    info = rd.rows[2]
    row = CacheReader.row(rd.load_shard(info.shard), info.row)
    a = info.answer_start + 3
    batch = load_batch(ShardPool(rd, 1), [(2, a)], 4, 6)
    with torch.no_grad():
        ctx = model.project_context(batch.ctx_feats)
        out = model.forward_block(ctx, batch.ctx_valid, batch.tokens[:, 0], None, batch.ctx_index, batch.block_pos)
        toks, conf, _ = free_running(model, out.base_logits, out.conf_h, batch.tokens[:, 0])
    drafter = DSparkDrafter(model, options=DrafterOptions(branch_width=1), eos_token_ids=[])
    req = DraftRequest(0, row["tokens"][: a + 1].tolist(), SamplingParams())
    m = len(LAYERS)
    feats = row["feats"][:a].float()
    d = feats.shape[1] // m
    drafter.start(req, [feats[:, i * d : (i + 1) * d] for i in range(m)])
    (tree,) = drafter.propose([req], 4)
    assert tree.tokens == toks[0].tolist()
    assert tree.confidence == pytest.approx(torch.sigmoid(conf[0]).tolist(), abs=1e-4)
    # calibrated: c_k = sigmoid(z_k / T_k + b_k), as the report computes it
    temps, offsets = [2.0, 0.5, 1.0, 1.5], [-0.5, 0.25, 0.0, 1.0]
    calibrated = DSparkDrafter(model, temps, options=DrafterOptions(branch_width=1), eos_token_ids=[], offsets=offsets)
    req2 = DraftRequest(1, row["tokens"][: a + 1].tolist(), SamplingParams())
    calibrated.start(req2, [feats[:, i * d : (i + 1) * d] for i in range(m)])
    (tree2,) = calibrated.propose([req2], 4)
    expected = torch.sigmoid(conf[0] / torch.tensor(temps) + torch.tensor(offsets))
    assert tree2.tokens == tree.tokens and tree2.confidence == pytest.approx(expected.tolist(), abs=1e-4)


def test_threshold_sweep_counts_verified_prefix():
    from pipelines.drafter_report import threshold_sweep

    accepted = np.array([[1, 1, 0], [0, 1, 1]], dtype=float)
    conf = np.array([[0.9, 0.6, 0.3], [0.8, 0.8, 0.8]])
    tps, rate, ver = threshold_sweep(accepted, conf, np.array([0.0, 0.5, 0.7]))
    # t=0: all 3 verified per row; accepted prefixes 2 and 0 -> tokens/step 1 + 1 = 2
    assert tps.tolist() == [2.0, 2.0, 1.5] and ver.tolist() == [3.0, 2.5, 2.0]
    assert rate.tolist() == pytest.approx([2 / 6, 2 / 5, 1 / 4])


def test_draft_vocabulary_comes_from_train_answers_and_reports_coverage(tmp_path, target):
    from pipelines.train_drafter import draft_vocabulary

    assert draft_vocabulary({}, target, tmp_path) == (None, None)  # not configured: whole vocabulary
    with pytest.raises(SystemExit, match="generate stage"):
        draft_vocabulary({"draft_vocab": 2}, target, tmp_path)
    for split, answers in (("train", [[5, 5, 6], [6, 7, 5]]), ("eval", [[5, 9], [6, 6]])):
        (tmp_path / "cache" / split).mkdir(parents=True)
        (tmp_path / "cache" / split / "answers.jsonl").write_text("".join(json.dumps({"output_ids": a}) + "\n" for a in answers))
    ids, info = draft_vocabulary({"draft_vocab": 2}, target, tmp_path)
    assert ids.tolist() == sorted({5, 6} | set(target.eos_token_ids))
    assert info["eval_answer_coverage"] == pytest.approx(3 / 4)  # 9 is not in the vocabulary


def test_a_fresh_train_run_can_start_from_a_checkpoint(cache_dir, target, tmp_path):
    """`--init-from`: a fresh run starts from a checkpoint's weights (same architecture and
    target), records where it began for the card, and a resumed run ignores it."""
    import shutil

    from safetensors.torch import load_file

    from dspark.dspark_drafter.checkpoint import warm_start
    from pipelines.train_drafter import stage_train

    torch.manual_seed(0)
    source = build_model(drafter_cfg(target), target.model)
    rd = CacheReader(cache_dir)
    train(source, rd, list(range(len(rd.rows))), TrainConfig(steps=4, batch_size=8, warmup=1, eval_every=1000, autocast_bf16=False),
          tmp_path / "source-state", progress=False, log=lambda m: None)
    origin = {"checkpoint": "earlier-ck", "steps": 9, "markov_rank": 16}
    save_checkpoint(tmp_path / "ck", source, Fingerprint.of(target), extra={"training": {"steps": 4, "cpu_hours": 0.01, "init_from": origin}},
                    dtype=torch.float32)

    work = tmp_path / "work"
    shutil.copytree(cache_dir, work / "cache" / "train")
    model = dict(num_layers=1, num_heads=4, num_kv_heads=2, gamma=4, context_len=6, markov_rank=16, target_layers=list(LAYERS))
    assert DSparkConfig.for_target(target.model.config, **model) == drafter_cfg(target)
    cfg = {"model": model, "train": {"steps": 0, "batch_size": 8, "eval_every": 1000, "autocast_bf16": False}}
    lines: list[str] = []
    stage_train(cfg, target, work, lines.append, None, progress=False, init_from=tmp_path / "ck")
    state = load_file(str(work / "runs" / "dspark" / "state.safetensors"))
    for k, v in source.state_dict().items():
        torch.testing.assert_close(state[f"model.{k}"], v)  # 0 steps: exactly the checkpoint's weights
    began = json.loads((work / "runs" / "dspark" / "init_from.json").read_text())
    # the source's steps, head and own origin: a chain of warm starts stays traceable
    assert (began["steps"], began["markov_rank"], began["init_from"]) == (4, 16, origin)
    assert any("starting from the weights" in line for line in lines)
    lines.clear()
    stage_train(cfg, target, work, lines.append, None, progress=False, init_from=tmp_path / "ck")
    assert any("applies to fresh runs only" in line for line in lines)

    other = build_model(drafter_cfg(target, markov_rank=8), target.model)
    with pytest.raises(ValueError, match="markov_rank: 16 there, 8 here"):
        warm_start(other, tmp_path / "ck", target)
    wider = build_model(drafter_cfg(target, context_len=64), target.model)  # a window, not a weight shape
    warm_start(wider, tmp_path / "ck", target)
    torch.testing.assert_close(wider.state_dict(), source.state_dict())

    # a reduced-vocabulary run started from a checkpoint keeps the vocabulary it was trained over
    from dspark.dspark_drafter.vocab import read_draft_vocab, save_draft_vocab

    ids = torch.tensor([0, 3, 5, 7, 11, 13])
    save_draft_vocab(tmp_path / "ck", ids)
    cfg["train"]["reduced_vocab"] = True
    cfg["run"] = "reduced"
    stage_train(cfg, target, work, lines.append, None, progress=False, init_from=tmp_path / "ck")
    assert read_draft_vocab(work / "runs" / "reduced", target.vocab_size).tolist() == ids.tolist()

    # ... unless `draft_vocab` asks for more: then it grows by the next most frequent answer tokens
    from collections import Counter

    from dspark.training.record import answer_tokens

    counts = Counter(t for a in answer_tokens(work / "cache" / "train" / "answers.jsonl") for t in a if t not in ids.tolist())
    next_four = sorted(counts, key=lambda t: (-counts[t], t))[:4]
    cfg["draft_vocab"], cfg["run"] = 10, "grown"
    stage_train(cfg, target, work, lines.append, None, progress=False, init_from=tmp_path / "ck")
    grown = read_draft_vocab(work / "runs" / "grown", target.vocab_size).tolist()
    assert grown == sorted(ids.tolist() + next_four)
    assert any("grown to 10" in line for line in lines)


def test_the_checkpoint_records_the_sequences_training_drew_from(cache_dir, target, tmp_path):
    """A shard the generate stage adds after the train stage ran is in the cache when the
    calibrate stage writes the card, but the weights never saw it: the card says 12, not 18."""
    import shutil

    from pipelines.train_drafter import stage_calibrate, stage_train

    work = tmp_path / "work"
    for split in ("train", "calib", "eval"):
        shutil.copytree(cache_dir, work / "cache" / split)
    trained_on = CacheReader(work / "cache" / "train")
    model = dict(num_layers=1, num_heads=4, num_kv_heads=2, gamma=4, context_len=6, markov_rank=16, target_layers=list(LAYERS))
    cfg = {"model": model, "eval": {"stride": 1}, "train": {"steps": 2, "batch_size": 8, "warmup": 1, "eval_every": 1000, "autocast_bf16": False}}
    torch.manual_seed(0)
    stage_train(cfg, target, work, lambda m: None, None, progress=False)
    shutil.copy(trained_on.shards[0], work / "cache" / "train" / "shard_00099.safetensors")  # generated later
    assert len(CacheReader(work / "cache" / "train").rows) == len(trained_on.rows) + 6
    extra = stage_calibrate(cfg, target, work, tmp_path / "ck", lambda m: None)
    assert extra["training"]["train_sequences"] == len(trained_on.rows) == 12
    assert extra["training"]["train_positions"] == trained_on.num_positions()


def test_a_reduced_vocabulary_run_keeps_its_vocabulary_through_calibration(cache_dir, target, tmp_path):
    """`train.reduced_vocab`: the run trains over the draft vocabulary chosen when it starts;
    more answers arriving later do not move it, and the checkpoint ships that same set."""
    import shutil

    from dspark.dspark_drafter.vocab import VOCAB_FILE, read_draft_vocab
    from pipelines.train_drafter import stage_calibrate, stage_train

    work = tmp_path / "work"
    shutil.copytree(cache_dir, work / "cache" / "train")
    shutil.copytree(cache_dir, work / "cache" / "calib")
    model = dict(num_layers=1, num_heads=4, num_kv_heads=2, gamma=4, context_len=6, markov_rank=16, target_layers=list(LAYERS))
    cfg = {"model": model, "draft_vocab": 8,
           "train": {"steps": 3, "batch_size": 8, "eval_every": 1000, "autocast_bf16": False, "reduced_vocab": True}}
    lines: list[str] = []
    stage_train(cfg, target, work, lines.append, None, progress=False)
    trained = read_draft_vocab(work / "runs" / "dspark", target.vocab_size)
    assert trained is not None and len(trained) <= 8 + len(target.eos_token_ids)
    # new answers with other tokens: a fresh choice would differ, the run's does not
    with (work / "cache" / "train" / "answers.jsonl").open("a") as f:
        for _ in range(50):
            f.write(json.dumps({"output_ids": [90, 91, 92, 93, 94, 95, 89, 88]}) + "\n")
    cfg["train"]["steps"] = 4
    stage_train(cfg, target, work, lines.append, None, progress=False)  # resumes over the same set
    assert any("the run's reduced draft vocabulary" in line for line in lines)
    extra = stage_calibrate(cfg, target, work, tmp_path / "ck", lines.append)
    assert read_draft_vocab(tmp_path / "ck", target.vocab_size).tolist() == trained.tolist()
    assert (tmp_path / "ck" / VOCAB_FILE).is_file() and "trained over" in extra["draft_vocab"]["source"]


def test_a_sampled_pass_can_answer_only_the_shorter_train_prompts(target, tmp_path):
    from pipelines.train_drafter import Logger, stage_generate

    ids = [i for i in (f"r{n}" for n in range(200)) if split_of(i) == "train"][:4]
    words = lambda n: " ".join(f"w{3 + k}" for k in range(n))  # noqa: E731
    rows = [{"id": i, "domain": "chat", "turns": [words(4 if k % 2 else 24)]} for k, i in enumerate(ids)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "prompts": {"dir": str(tmp_path), "train_max_prompt_tokens": 40},
        "generate": {"batch_size": 4, "max_new_tokens": 6, "shard_size": 4, "train_samples": [{"temperature": 1.0, "tag": "s", "max_prompt_tokens": 10}]},
        "model": {"num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "gamma": 4, "context_len": 6, "markov_rank": 16, "target_layers": list(LAYERS)},
    }
    stage_generate(cfg, target, tmp_path / "work", Logger(tmp_path / "log.txt"), deadline=None)
    answered = sorted(r["id"] for r in read_jsonl(tmp_path / "work" / "cache" / "train" / "answers.jsonl"))
    assert answered == sorted(ids + [f"{i}~s" for k, i in enumerate(ids) if k % 2])


def test_a_rewrite_pass_answers_train_prompts_under_the_new_instruction(target, tmp_path):
    """`generate.train_rewrites`: one more greedy answer per train prompt of the domain, rows
    `id+tag`, after the greedy train pass; eval prompts are rewritten into no split's cache."""
    from pipelines.train_drafter import Logger, stage_generate

    train = [i for i in (f"r{n}" for n in range(200)) if split_of(i) == "train"][:3]
    held_out = [i for i in (f"r{n}" for n in range(200)) if split_of(i) == "eval"][:1]
    rows = [{"id": i, "domain": "summarization", "turns": ["w3 w4: w5 w6 w7"]} for i in train + held_out]
    rows.append({"id": "chat-1", "domain": "chat", "turns": ["w3 w4: w8"]})
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "prompts": {"dir": str(tmp_path)},
        "generate": {"batch_size": 4, "max_new_tokens": 6, "shard_size": 4, "train_rewrites": [{"tag": "v", "domain": "summarization", "find": "w3 w4:", "replace": "w9 w10 w11:"}]},
        "model": {"num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "gamma": 4, "context_len": 6, "markov_rank": 16, "target_layers": list(LAYERS)},
    }
    work = tmp_path / "work"
    stage_generate(cfg, target, work, Logger(tmp_path / "log.txt"), deadline=None)
    answers = {r["id"]: r for r in read_jsonl(work / "cache" / "train" / "answers.jsonl")}
    base = [i for i in train + ["chat-1"] if split_of(i) == "train"]
    assert sorted(answers) == sorted(base + [f"{i}+v" for i in train])
    for i in train:  # the new instruction's three tokens in place of the old two
        assert len(answers[f"{i}+v"]["prompt_ids"]) == len(answers[i]["prompt_ids"]) + 1
        assert answers[f"{i}+v"]["split"] == "train"
    eval_ids = [r["id"] for r in read_jsonl(work / "cache" / "eval" / "answers.jsonl")]
    assert eval_ids == held_out  # the held-out article is answered once, under its own instruction
    assert "rewrite 'v'" in (tmp_path / "log.txt").read_text()


def test_generate_dtype_sets_the_generating_target_only(tmp_path):
    """`generate.dtype` answers (and records the cache) in another dtype, e.g. bf16 on a CPU with
    fast bf16 matmuls; the train and calibrate stages keep the config's `dtype`."""
    from pipelines.train_drafter import load_target, main

    ids = [i for i in (f"r{n}" for n in range(200)) if split_of(i) == "train"][:3]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "domain": "chat", "turns": ["w3 w4 w5"]}) + "\n" for i in ids))
    cfg = {
        "target": "tiny", "dtype": "float32", "work_dir": str(tmp_path / "work"),
        "prompts": {"dir": str(tmp_path)},
        "generate": {"dtype": "bfloat16", "batch_size": 3, "max_new_tokens": 4, "shard_size": 3},
        "model": {"num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "gamma": 4, "context_len": 6, "markov_rank": 16, "target_layers": list(LAYERS)},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "c.yaml"), "--stages", "generate", "--no-progress"]) == 0
    log = (tmp_path / "work" / "train_drafter.log").read_text()
    assert "generate train, greedy, target in bfloat16: 3 prompts planned" in log
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "work" / "cache" / "train" / "answers.jsonl")) == sorted(ids)
    assert load_target(cfg).dtype == torch.float32 and load_target(cfg, "bfloat16").dtype == torch.bfloat16


def test_calibrating_a_checkpoint_fits_a_copy_prior_that_raises_tau(cache_dir, target, tmp_path):
    """`--stages calibrate --init-from CK` without a training state: the copy prior's bonuses
    are fitted on calib by tau (the tiny target's answers repeat tokens, so copying pays), the
    confidence gets its per-match-class correction, and the checkpoint carries both."""
    import shutil

    from pipelines.train_drafter import stage_calibrate

    torch.manual_seed(0)
    source = build_model(drafter_cfg(target), target.model)
    save_checkpoint(tmp_path / "source", source, Fingerprint.of(target), extra={"training": {"steps": 7}}, dtype=torch.float32)
    work = tmp_path / "work"
    for split in ("calib", "eval"):
        shutil.copytree(cache_dir, work / "cache" / split)
    model = dict(num_layers=1, num_heads=4, num_kv_heads=2, gamma=4, context_len=6, markov_rank=16, target_layers=list(LAYERS))
    copy = {"orders": [2, 3], "grid": [2, 8, 32], "kinds": ["u", "c", "a"], "kind_grid": [4]}
    cfg = {"model": model, "eval": {"stride": 1}, "copy_prior": copy}
    lines: list[str] = []
    with pytest.raises(SystemExit, match="--init-from"):
        stage_calibrate(cfg, target, work, tmp_path / "ck", lines.append)
    extra = stage_calibrate(cfg, target, work, tmp_path / "ck", lines.append, init_from=tmp_path / "source")
    assert extra["eval_tau_kind"] == "per round"  # stride 1: every answer walked round by round
    eval_rows = CacheReader(work / "cache" / "eval").rows
    assert extra["eval_answers"]["all"] == len(eval_rows) == sum(n for d, n in extra["eval_answers"].items() if d != "all")
    assert extra["eval_answers"] == {"all": 12, "chat": 6, "math": 6}  # tiny_plan(12): math and chat in turn
    with_copy, without = extra["eval_tau_greedy"]["all"], extra["eval_tau_greedy_without_copy"]["all"]
    assert with_copy > without + 0.2
    drafter = load_drafter(tmp_path / "ck", target)
    assert drafter.copy is not None and drafter.copy.active and drafter.copy.confidence
    assert extra["training"]["steps"] == 7 and extra["copy_prior_fit"]["tried"]
    assert any("copy prior on" in line for line in lines)
    # the per-kind sweep tried kinded priors, and the checkpoint carries the best-scoring prior
    tried = {CopyPrior.from_dict(p): t for p, t in extra["copy_prior_fit"]["tried"]}
    assert any(p.kind_bonuses for p in tried) and any("per match kind" in line for line in lines)
    shipped = CopyPrior(drafter.copy.bonuses, kind_bonuses=drafter.copy.kind_bonuses)  # without its confidence correction
    assert tried[shipped] == max(tried.values())


def test_calibrating_with_a_copy_scorer_learns_when_to_copy(cache_dir, target, tmp_path):
    """`copy_prior: {scorer: ...}`: the copy decision is fitted on calib along the target's own
    path (the tiny target's answers repeat tokens, so copying pays); the checkpoint carries the
    learned rule with its confidence correction, and eval tau rises with it."""
    import shutil

    from pipelines.train_drafter import stage_calibrate

    torch.manual_seed(0)
    source = build_model(drafter_cfg(target), target.model)
    save_checkpoint(tmp_path / "source", source, Fingerprint.of(target), dtype=torch.float32)
    work = tmp_path / "work"
    for split in ("calib", "eval"):
        shutil.copytree(cache_dir, work / "cache" / split)
    model = dict(num_layers=1, num_heads=4, num_kv_heads=2, gamma=4, context_len=6, markov_rank=16, target_layers=list(LAYERS))
    cfg = {"model": model, "eval": {"stride": 1}, "copy_prior": {"scorer": {"orders": [2, 3, 4]}}}
    lines: list[str] = []
    extra = stage_calibrate(cfg, target, work, tmp_path / "ck", lines.append, init_from=tmp_path / "source")
    fit = extra["copy_prior_fit"]
    assert fit["decisions"] > 100 and fit["calib_tau"] > fit["calib_tau_without"]
    assert extra["eval_tau_greedy"]["all"] > extra["eval_tau_greedy_without_copy"]["all"] + 0.2
    drafter = load_drafter(tmp_path / "ck", target)
    assert isinstance(drafter.copy, CopyScorer) and drafter.copy.orders == (2, 3, 4) and drafter.copy.confidence
    assert any("copy scorer on" in line for line in lines)
    # the drafter report reads the learned rule: tau with and without it, and what it is
    from pipelines.drafter_report import build_report

    s = build_report({"target": "tiny", "seed": 0, "work_dir": str(work)}, tmp_path / "report", tmp_path / "ck", None, None, stride=1)
    assert s["results"]["dspark"]["tau"]["all"] > s["results"]["dspark_no_copy"]["tau"]["all"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "learned scorer over orders [2, 3, 4]" in md
    # beside it, how far a perfect copy decision would go: its first row is the drafter itself
    bounds = s["results"]["dspark"]["copy_bounds"]
    assert bounds["rule"] == pytest.approx(s["results"]["dspark"]["tau"])
    assert bounds["top1"] == pytest.approx(s["results"]["dspark_no_copy"]["tau"])
    assert bounds["top1_or_candidate"]["all"] >= bounds["rule"]["all"] and "## What a better copy decision could add" in md


def test_copy_bounds_walk_the_drafters_own_chain_and_bound_a_better_decision(cache_dir, target):
    """Stepped along the target's tokens, the rule's choice accepts exactly the prefixes the
    free-running drafter does (with and without copying), so the bounds beside it are tau of the
    same walk with more of the step's options counted right."""
    from dspark.training.copy_bound import copy_bounds

    torch.manual_seed(0)
    model = drafter_with_live_heads(target)
    rd = CacheReader(cache_dir)
    rows = list(range(len(rd.rows)))
    rule = CopyPrior(((2, 4.0), (3, 8.0)))
    bounds = copy_bounds(model, rd, rows, rule, batch_size=16)  # several batches
    with_copy, without = evaluate(model, rd, rows, stride=1, copy=rule), evaluate(model, rd, rows, stride=1)
    assert bounds.rows.tolist() == with_copy.rows.tolist() and bounds.anchors.tolist() == with_copy.anchors.tolist()
    assert bounds.domains == with_copy.domains
    np.testing.assert_array_equal(np.cumprod(bounds.steps["rule"], 1), np.cumprod(with_copy.accepted, 1))
    np.testing.assert_array_equal(np.cumprod(bounds.steps["top1"], 1), np.cumprod(without.accepted, 1))
    tau = bounds.tau_by_domain()
    assert tau["rule"] == pytest.approx(with_copy.tau_by_domain(decoded=True))
    assert tau["top1"] == pytest.approx(without.tau_by_domain(decoded=True))
    # the tiny target's answers repeat tokens: a perfect decision over the rule's candidates beats
    # the rule, and every earlier follower at least matches it
    assert tau["top1_or_candidate"]["all"] > max(tau["rule"]["all"], tau["top1"]["all"])
    assert tau["top1_or_follower"]["all"] >= tau["top1_or_candidate"]["all"]
    assert (bounds.steps["top1_or_candidate"] >= bounds.steps["rule"]).all()


def test_decoded_tau_walks_the_answer_round_by_round():
    """Per-round tau: each round starts where the last one ended, unlike the anchor average."""
    from dspark.training.trainer import EvalResult

    # one answer, gamma 2, anchors 10..15; a round at 10 gains 3 (both drafts accepted), at 13
    # gains 2, at 15 gains 1: decoding visits 10, 13, 15 -> 6 tokens in 3 rounds
    acc = np.array([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [0, 1]], dtype=float)
    z = np.zeros_like(acc)
    res = EvalResult(acc, z, z, ["math"] * 6, None, np.zeros(6, np.int64), np.arange(10, 16))
    assert res.decoded_tau() == 2.0
    assert res.tau() == pytest.approx(1 + (2 + 2 + 2 + 1 + 2 + 0) / 6)  # every anchor weighs the same
    # two answers pool their tokens and rounds; a domain mask picks answers
    both = EvalResult(np.vstack([acc, [[0, 0], [1, 1]]]), np.zeros((8, 2)), np.zeros((8, 2)), ["math"] * 6 + ["chat"] * 2,
                      None, np.array([0] * 6 + [1] * 2), np.concatenate([np.arange(10, 16), [4, 5]]))
    # answer 1: anchor 4 gains 1, anchor 5 gains 3 -> 4 tokens in 2 rounds
    assert both.tau_by_domain(decoded=True) == {"chat": 2.0, "math": 2.0, "all": 10 / 5}
    with pytest.raises(ValueError, match="every anchor"):
        both.subset(np.array([True, False] * 4)).decoded_tau()  # stride 2 cannot be walked


def test_seen_before_looks_at_the_sequence_up_to_the_anchor_and_the_block_so_far():
    from dspark.training.trainer import seen_before

    tokens = [7, 8, 9, 10, 11]
    targets = np.array([[9, 11, 11], [10, 12, 12]])  # blocks at anchors 2 and 3
    # anchor 2 sees 7 8 9: 9 yes; 11 comes later in the row (not yet seen), then it is in the block
    # anchor 3 sees 7 8 9 10: 10 yes; 12 is new, then repeated inside the block
    assert seen_before(tokens, [2, 3], targets).tolist() == [[True, False, True], [True, False, True]]


def test_round_ends_classifies_the_token_where_each_round_stopped():
    from dspark.training.round_ends import round_ends
    from dspark.training.trainer import EvalResult

    # one answer, gamma 2, anchors 10..13: the walk visits 10 (gains 1), 11 (gains 3), then 14: done
    acc = np.array([[0, 1], [1, 1], [1, 0], [0, 0]], dtype=float)
    targets = np.array([[50, 1], [2, 3], [4, 60], [70, 5]])
    seen = np.array([[True, False], [False, False], [False, True], [False, False]])
    z = np.zeros_like(acc)
    res = EvalResult(acc, z, z, ["code"] * 4, None, np.zeros(4, np.int64), np.arange(10, 14), targets, seen)
    ends = round_ends(res, draft_vocab=np.arange(10))
    # 2 rounds; the one at 11 accepted its whole block; the one at 10 ended at position 1 on
    # token 50: outside the vocabulary and seen earlier
    assert ends.rounds == 2 and ends.whole_block == 0.5 and ends.ended_at == [1.0, 0.0]
    assert (ends.outside_vocab, ends.outside_vocab_seen, ends.seen) == (1.0, 1.0, 1.0)
    assert round_ends(res, draft_vocab=None).outside_vocab == 0.0  # drafting from the whole vocabulary


def test_drafter_report_gives_tau_per_round_and_the_anchor_average_beside_it(cache_dir, target, tmp_path):
    import shutil

    from pipelines.drafter_report import build_report

    torch.manual_seed(0)
    model = drafter_with_live_heads(target)
    save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target), temperatures=[1.5, 1.0, 1.0, 0.5], dtype=torch.float32)
    work = tmp_path / "work"
    shutil.copytree(cache_dir, work / "cache" / "eval")
    cfg = {"target": "tiny", "seed": 0, "work_dir": str(work)}
    rd = CacheReader(work / "cache" / "eval")
    res = evaluate(model, rd, list(range(len(rd.rows))), stride=1)

    s = build_report(cfg, tmp_path / "report", tmp_path / "ck", None, None, stride=1)
    assert s["tau_kind"] == "per round"
    assert s["results"]["dspark"]["tau"] == pytest.approx(res.tau_by_domain(decoded=True))
    assert s["results"]["dspark"]["tau_per_anchor"] == pytest.approx(res.tau_by_domain())
    md = (tmp_path / "report" / "report.md").read_text()
    assert "tokens per round" in md and "Averaged over every anchor instead" in md
    ends = s["results"]["dspark"]["round_ends"]["all"]  # every round the walk takes, classified where it ended
    assert ends["rounds"] > 0 and sum(ends["ended_at"]) == pytest.approx(1.0) and "## Where rounds end" in md
    assert all((tmp_path / "report" / f).is_file() for f in ("tau_per_domain.png", "reliability.png", "threshold_sweep.png"))
    # a stride that skips anchors cannot be walked: the report says which tau it shows
    s2 = build_report(cfg, tmp_path / "report2", tmp_path / "ck", None, None, stride=2)
    assert s2["tau_kind"] == "per anchor" and "overstates" in (tmp_path / "report2" / "report.md").read_text()
    assert "round_ends" not in s2["results"]["dspark"]


def test_a_report_is_redrawn_from_its_json_alone(cache_dir, target, tmp_path):
    """report.json keeps what every plot needs (the reliability bins included), so `--replot`
    redraws the PNGs and report.md without evaluating again."""
    import shutil

    from pipelines.drafter_report import build_report, main

    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ck", drafter_with_live_heads(target), Fingerprint.of(target), dtype=torch.float32)
    shutil.copytree(cache_dir, tmp_path / "work" / "cache" / "eval")
    out = tmp_path / "report"
    build_report({"target": "tiny", "seed": 0, "work_dir": str(tmp_path / "work")}, out, tmp_path / "ck", None, None, stride=1)
    md = (out / "report.md").read_text()
    saved = json.loads((out / "report.json").read_text())["calibration"]
    for key in ("before", "after"):  # ten bins of mean predicted survival, observed frequency, count
        assert len(saved[key]["freq"]) == len(saved[key]["pred"]) == len(saved[key]["count"]) == 10
        assert sum(saved[key]["count"]) > 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "reliability.png" in pngs
    for p in out.glob("*.png"):
        p.unlink()
    (out / "report.md").unlink()

    assert main(["--replot", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == pngs
    assert (out / "report.md").read_text() == md

    # a report.json from before the bins were kept: the other plots are redrawn, the diagram kept
    old = json.loads((out / "report.json").read_text())
    old["calibration"] = {k: {m: v[m] for m in ("ece", "auc")} for k, v in old["calibration"].items()}
    (out / "report.json").write_text(json.dumps(old))
    (out / "reliability.png").write_bytes(b"kept")
    (out / "tau_per_domain.png").unlink()
    assert main(["--replot", str(out)]) == 0
    assert (out / "reliability.png").read_bytes() == b"kept" and (out / "tau_per_domain.png").is_file()
    assert (out / "report.md").read_text() == md


@pytest.mark.parametrize("chained", [False, True], ids=["direct", "via-another-ablation"])
def test_drafter_report_names_an_ablation_warm_started_from_a_markov_drafter(cache_dir, target, tmp_path, chained):
    import shutil

    from dspark.dspark_drafter.checkpoint import warm_start
    from pipelines.drafter_report import build_report

    torch.manual_seed(0)
    model = drafter_with_live_heads(target)
    save_checkpoint(tmp_path / "ck", model, Fingerprint.of(target), dtype=torch.float32, extra={"training": {"steps": 70}})
    parallel = build_model(DSparkConfig(**{**model.cfg.to_dict(), "markov_rank": 0}), target.model)
    warm_start(parallel, tmp_path / "ck", target)  # what `--init-from ck` with markov_rank 0 trains from
    with torch.no_grad():  # its training, stood in for by a nudge: it no longer equals ck with the bias off
        for p in parallel.parameters():
            p.add_(0.5 * torch.randn_like(p))
    init_from = {"checkpoint": str(tmp_path / "ck"), "steps": 70}
    if chained:  # started from an ablation of ck that had trained 20 steps without the head
        init_from = {"checkpoint": str(tmp_path / "abl-20"), "steps": 20, "markov_rank": 0, "init_from": init_from}
    without = 30 + 20 * chained
    save_checkpoint(tmp_path / "abl", parallel, Fingerprint.of(target), dtype=torch.float32,
                    extra={"training": {"steps": 30, "init_from": init_from}})
    work = tmp_path / "work"
    shutil.copytree(cache_dir, work / "cache" / "eval")
    rd = CacheReader(work / "cache" / "eval")

    s = build_report({"target": "tiny", "seed": 0, "work_dir": str(work)}, tmp_path / "report", tmp_path / "ck", tmp_path / "abl", None, stride=1)
    want = evaluate(parallel, rd, list(range(len(rd.rows))), stride=1).tau_by_domain(decoded=True)
    assert s["results"]["parallel"]["tau"] == pytest.approx(want)  # the checkpoint, not the bias switched off
    assert s["results"]["parallel"]["label"].startswith(f"parallel-only (the Markov head removed from ck, 70 steps, then {without} steps")
    assert f"the ablation continued ck's 70 steps for {without} more" in (tmp_path / "report" / "report.md").read_text()


def test_an_ablation_warm_started_twice_is_traced_to_where_the_markov_head_was_removed():
    from pipelines.drafter_report import markov_origin

    shipped = {"checkpoint": "ck/shipped", "steps": 22909, "markov_rank": 64, "init_from": {"checkpoint": "ck/run5", "steps": 34000}}
    first = {"checkpoint": "ck/r0", "steps": 6000, "markov_rank": 0, "init_from": shipped}
    # an ablation started from `first`: the head came off `shipped`, then 6000 steps before its own run
    assert markov_origin(first) == (shipped, 6000)
    assert markov_origin(shipped) == (shipped, 0)
    legacy = {"checkpoint": "ck/r0", "steps": 6000}  # recorded before the head was: its direct source
    assert markov_origin(legacy) == (legacy, 0)
    assert markov_origin(None) is None


def test_threshold_sweep_per_round_walks_the_policy():
    from pipelines.drafter_report import threshold_sweep

    # one answer, gamma 2, anchors 0..3: at t=0 a round at 0 gains 3 (both accepted), then 3 gains 1
    accepted = np.array([[1, 1], [0, 0], [1, 0], [0, 1]], dtype=float)
    conf = np.array([[0.9, 0.6], [0.9, 0.9], [0.9, 0.9], [0.9, 0.9]])
    tps, rate, ver = threshold_sweep(accepted, conf, np.array([0.0, 0.7]), np.zeros(4, np.int64), np.arange(4))
    # t=0.7 verifies only position 1 at anchor 0 (gains 2), then both at anchor 2 (gains 2)
    assert tps.tolist() == [2.0, 2.0] and ver.tolist() == [2.0, 1.5] and rate.tolist() == pytest.approx([2 / 4, 2 / 3])

