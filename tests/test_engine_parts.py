"""Model loading, prompt validation, the KV cache's bookkeeping, metrics and the evaluate CLI."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dspark.drafters.ngram import NgramDrafter
from dspark.generator import DSparkGenerator, PromptError
from dspark.models import EMBEDDED_NAME, embedded_gguf_path, is_embedded_gguf, load_model, resolve_model_dir
from dspark.runner import ModelRunner
from tests.conftest import tiny_model


def test_unknown_model_is_an_error_not_a_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_the_embedded_gguf_by_path_or_as_a_copy_is_the_embedded_target(tmp_path):
    """The shipped drafter is keyed by the target's name: a user pointing at the embedded file
    (or a copy baked into an image) gets it too. A file differing in one byte is another model."""
    embedded = embedded_gguf_path()
    assert resolve_model_dir(str(embedded))[1] == EMBEDDED_NAME
    copy = tmp_path / "smollm2.gguf"
    shutil.copyfile(embedded, copy)
    assert is_embedded_gguf(copy)
    with copy.open("r+b") as f:  # same size, last byte flipped
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 1]))
    assert not is_embedded_gguf(copy)


def test_pickle_only_checkpoints_are_refused(tmp_path, tiny_llama):
    tiny_llama.model.config.save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors or GGUF only"):
        load_model(str(tmp_path), dtype="float32")


def test_local_hf_directory_loads_with_its_tokenizer(tmp_path, tiny_llama):
    tiny_llama.model.save_pretrained(tmp_path, safe_serialization=True)
    tiny_llama.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.vocab_size == tiny_llama.vocab_size
    assert loaded.tokenizer_hash() == tiny_llama.tokenizer_hash()
    x = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded.model(x).logits, tiny_llama.model(x).logits, atol=1e-5)


def test_prompt_validation_errors_are_clear(tiny_llama):
    gen = DSparkGenerator(tiny_llama, "ngram", "fixed:2")
    for bad, kind in [("", "empty_prompt"), ("   ", "empty_prompt"), (None, "empty_prompt"), ([], "empty_prompt"),
                      (3.5, "bad_type"), ([10**9], "bad_token_id")]:
        with pytest.raises(PromptError) as err:
            gen.encode(bad)
        assert err.value.kind == kind
    too_long = list(range(10, 10 + tiny_llama.max_context))
    with pytest.raises(PromptError, match="at most") as err:
        gen.generate([[5, 6], too_long], max_new_tokens=8)
    assert err.value.kind == "too_long" and "prompt 1" in str(err.value)
    with pytest.raises(ValueError):
        gen.generate(["hi"], max_new_tokens=0)
    with pytest.raises(ValueError):
        gen.generate(["hi"], temperature=-1.0)
    with pytest.raises(TypeError):
        gen.generate("a bare string")


def test_truncation_policy_keeps_the_tail(tiny_llama):
    gen = DSparkGenerator(tiny_llama, "ngram", "fixed:2", truncation="left")
    too_long = list(range(10, 10 + tiny_llama.max_context))
    [result] = gen.generate([too_long], max_new_tokens=4)
    assert result.truncated and result.num_prompt_tokens < len(too_long)
    assert result.num_output_tokens == 4


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_cuts_the_text_and_keeps_the_chat_template_whole(tiny_llama, truncation):
    """A cut prompt still opens the user turn and ends with the assistant header, so the model
    answers instead of continuing the user's text; only the text loses tokens."""
    gen = DSparkGenerator(tiny_llama, "ngram", "fixed:2", truncation=truncation)
    text = " ".join(f"w{i}" for i in range(tiny_llama.max_context))
    fitted = gen.encode(text, max_new_tokens=8)
    whole = tiny_llama.encode(text)
    header = tiny_llama.encode("x")
    assert len(fitted) <= tiny_llama.max_context - 8 < len(whole)
    assert fitted[-3:] == whole[-3:] == header[-3:]  # "<|im_end|>\n<|im_start|>assistant\n"
    assert fitted[:5] == whole[:5]  # the system turn and "<|im_start|>user" are all there
    kept = tiny_llama.tokenizer.decode(fitted)
    assert ("w0 " in kept) == (truncation == "right") and (f"w{tiny_llama.max_context - 1}" in kept) == (truncation == "left")
    messages = [{"role": "user", "content": text}]
    assert gen.encode(messages, max_new_tokens=8) == fitted


def test_stop_strings_cut_the_text(tiny_llama):
    gen = DSparkGenerator(tiny_llama, "ngram", "fixed:3")
    [free] = gen.generate([[20, 21, 22, 20, 21]], max_new_tokens=12)
    stop = free.text[len(free.text) // 2 :][:3]
    if not stop.strip():
        pytest.fail("test prompt produced no usable text")
    [cut] = gen.generate([[20, 21, 22, 20, 21]], max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and free.text.startswith(cut.text)


def test_finished_rows_free_their_cache_rows(tiny_llama):
    gen = DSparkGenerator(tiny_llama, NgramDrafter(), "fixed:3", max_batch_size=4)
    from dspark.engine import Request, SpeculativeEngine

    engine = SpeculativeEngine(tiny_llama, gen.drafter, gen.scheduler, max_batch_size=4)
    reqs = [Request(i, [30 + i, 31, 32, 30 + i, 31], max_new_tokens=3 + 4 * i) for i in range(6)]
    sizes = []
    engine.run(reqs, on_finish=lambda r: sizes.append(engine.runner.cache.batch_size))
    assert engine.runner.cache.batch_size == 0
    assert engine.runner.cache.layers[0].length == 0
    assert all(r.finish_reason == "length" and len(r.output_ids) == r.max_new_tokens for r in reqs)


def test_slot_cache_rows_advance_independently():
    """Ragged commits, tree blocks, row removal and compaction reproduce full-sequence logits."""
    model = tiny_model("llama", 100, seed=5)
    runner = ModelRunner(model)

    def full(seq):
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0]

    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    fresh, _ = runner.prefill([p[:-1] for p in prompts])
    runner.cache.append_rows(fresh)
    out = runner.forward_block([([5, 20, 21, 22], [-1, 0, 1, 2]), ([8, 30, 31, 32], [-1, 0, 0, 1]), ([16], [-1])])
    assert torch.allclose(out.logits[0, :4], full([1, 2, 3, 4, 5, 20, 21, 22])[4:8], atol=1e-5)
    assert torch.allclose(out.logits[1, 2], full([7, 8, 31])[2], atol=1e-5)  # a sibling branch
    assert torch.allclose(out.logits[1, 3], full([7, 8, 30, 32])[3], atol=1e-5)
    runner.cache.commit([[0, 1, 2], [0, 2], [0]])  # row 1 keeps the second sibling
    out = runner.forward_block([([22, 40], [-1, 0]), ([50], [-1]), ([60, 61], [-1, 0])])
    assert torch.allclose(out.logits[1, 0], full([7, 8, 31, 50])[3], atol=1e-5)
    runner.cache.commit([[0, 1], [0], [0, 1]])
    runner.cache.select_rows([2, 0])
    runner.cache.maybe_compact(force=True)
    assert runner.cache.lengths.tolist() == [10, 9]
    out = runner.forward_block([([70], [-1]), ([71], [-1])])
    assert torch.allclose(out.logits[0, 0], full(prompts[2] + [60, 61, 70])[-1], atol=1e-5)
    assert torch.allclose(out.logits[1, 0], full([1, 2, 3, 4, 5, 20, 21, 22, 40, 71])[-1], atol=1e-5)


def test_slot_cache_never_reads_uninitialised_slots(monkeypatch):
    """Buffers re-allocated when rows leave or join start as NaN here: a read of any slot that
    was not written (or zeroed, for the masked padding of shorter rows) would poison the logits."""
    monkeypatch.setattr("dspark.kv._uninitialised", lambda like, *shape: torch.full(shape, float("nan"), dtype=like.dtype))
    model = tiny_model("llama", 100, seed=6)
    runner = ModelRunner(model)

    def full(seq):
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0]

    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12], [21, 22, 23, 24]
    runner.cache.append_rows(runner.prefill([a[:-1], b[:-1]])[0])
    runner.forward_block([([a[-1]], [-1]), ([b[-1]], [-1])])
    runner.cache.commit([[0], [0]])
    runner.cache.select_rows([1])  # row a leaves
    runner.cache.append_rows(runner.prefill([c[:-1]])[0])  # row c joins, shorter than the cache
    out = runner.forward_block([([30, 31], [-1, 0]), ([c[-1], 32], [-1, 0])])
    assert torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.logits[0], full(b + [30, 31])[-2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits[1], full(c + [32])[-2:], rtol=1e-5, atol=1e-5)


def test_evaluate_cli_writes_the_contract(tmp_path, tiny_llama, monkeypatch):
    """A tiny end-to-end run of pipelines.evaluate, numbers recomputed from outputs.jsonl."""
    from pipelines import evaluate

    tiny_llama.model.save_pretrained(tmp_path / "model", safe_serialization=True)
    tiny_llama.tokenizer.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    with prompts.open("w") as f:
        for i in range(5):
            f.write(json.dumps({"id": f"p{i}", "domain": "math" if i % 2 else "chat", "turns": [f"w{i} w{i} hello {i}"]}) + "\n")
    out = tmp_path / "out"
    rc = evaluate.main([
        "--prompts", str(prompts), "--out", str(out), "--methods", "hf,hf-pld,ar,fixed:3@ngram,dspark@ngram",
        "--batch-sizes", "1,2", "--max-new-tokens", "6", "--target", str(tmp_path / "model"), "--dtype", "float32",
    ])
    assert rc == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert {(r["method"], r["batch_size"]) for r in runs} == {
        (m, b) for m in ("hf", "ar", "fixed:3@ngram", "dspark@ngram") for b in (1, 2)
    } | {("hf-pld", 1)}
    for run in runs:
        mine = [o for o in outputs if o["method"] == run["method"] and o["batch_size"] == run["batch_size"]]
        hf = {o["prompt_id"]: o["token_ids"] for o in outputs if o["method"] == "hf" and o["batch_size"] == run["batch_size"]}
        assert run["num_prompts"] == len(mine) == 5
        assert run["output_tokens"] == sum(o["num_output_tokens"] for o in mine)
        assert run["identical_to_hf"] == sum(o["token_ids"] == hf[o["prompt_id"]] for o in mine) / 5
        assert run["tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
        assert set(run["by_category"]) == {"math", "chat"}
        if run["method"] in ("ar", "fixed:3@ngram", "dspark@ngram"):
            assert run["identical_to_hf"] == 1.0  # fp32: lossless
            verified = sum(o["stats"]["verified"] for o in mine)
            accepted = sum(o["stats"]["accepted"] for o in mine)
            if verified:
                assert run["acceptance_rate"] == pytest.approx(accepted / verified)


def test_time_limit_stops_a_row_early_and_keeps_its_tokens(tiny_llama):
    gen = DSparkGenerator(tiny_llama, "ngram", "fixed:2", max_batch_size=2)
    free = gen.generate([[5, 6, 7], [8, 9, 10]], max_new_tokens=64)
    [_, timed] = gen.generate([[5, 6, 7], [8, 9, 10]], max_new_tokens=64, time_limit_s=1e-9)
    assert free[0].finish_reason == "length" and free[0].num_output_tokens == 64
    assert timed.finish_reason == "time_limit"
    # stopped after its first round: a prefix of the free-running (greedy) output
    assert 1 <= timed.num_output_tokens < 64
    assert free[1].token_ids[: timed.num_output_tokens] == timed.token_ids
    with pytest.raises(ValueError):
        gen.generate(["hi"], time_limit_s=0)


class _HopelessDrafter(NgramDrafter):
    """Always proposes a chain, always with confidence 0: a threshold scheduler prunes it all."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def propose(self, requests, max_depth):
        from dspark.tree import DraftTree

        self.calls += 1
        return [DraftTree.chain([7] * max_depth, [0.0] * max_depth) for _ in requests]


@pytest.mark.parametrize("backoff", [0, 8])
def test_drafting_backs_off_where_the_scheduler_verifies_nothing(tiny_llama, backoff):
    from dspark.engine import Request, SpeculativeEngine

    drafter = _HopelessDrafter()
    gen = DSparkGenerator(tiny_llama, drafter, "threshold:0.5")
    engine = SpeculativeEngine(tiny_llama, drafter, gen.scheduler, max_batch_size=1, max_draft_backoff=backoff)
    [req] = engine.run([Request(0, [5, 6, 7], max_new_tokens=40)])
    [plain] = DSparkGenerator(tiny_llama, None, "ar").generate([[5, 6, 7]], max_new_tokens=40)
    assert req.output_ids == plain.token_ids  # skipping drafts never changes the output
    if backoff == 0:
        # the prefill gives token 1, then one token and one draft per round, except the last
        # round: with one token left to make there is no room for a draft
        assert drafter.calls == 38
    else:
        # drafts at rounds 1, 2, then after skips of 1, 2, 4, 8, 8 (rounds 4, 7, 12, 21, 30);
        # round 39 would be next but is the last, with no room for a draft
        assert drafter.calls == 7


def test_ngram_confidence_learns_the_acceptance_rate_and_unseen_depths_inherit_it():
    """Confidences are calibrated online: after many rounds where the first draft token is
    accepted 1 time in 4, depth 1's confidence is near 0.25, and depths never verified get about
    the same rather than an optimistic prior (which once made `dspark` verify 8-token blocks)."""
    from dspark.drafters.base import DraftRequest, VerifyOutcome
    from dspark.sampling import SamplingParams
    from dspark.tree import DraftTree

    drafter = NgramDrafter(max_ngram=2, min_ngram=2, num_candidates=1)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # "1 2" matched: proposes 3 4 5 6 7 8 9 ...
    req = DraftRequest(0, list(context), SamplingParams())
    drafter.start(req)
    assert drafter.propose([req], max_depth=8)[0].confidence[0] == 1.0  # untried: explored first
    for r in range(200):
        tree = drafter.propose([req], max_depth=8)[0]
        assert tree.tokens[:3] == [3, 4, 5]
        verified = DraftTree()
        verified.add(tree.tokens[0], -1, tree.confidence[0])  # the scheduler sent depth 1 only
        accepted = [0] if r % 4 == 0 else []
        drafter.observe(req, VerifyOutcome(0, verified, accepted, next_token=0))
        req.token_ids = list(context)  # same context every round
    tree = drafter.propose([req], max_depth=8)[0]
    assert tree.confidence[0] == pytest.approx(0.25, abs=0.03)
    assert tree.survival()[7] < 0.01  # 8 deep tokens at ~0.25 each: the scheduler will not verify them


def test_drafter_specs_name_their_settings(tiny_llama):
    from dspark.drafters import NgramDrafter, make_drafter

    default, longer, bigram = (make_drafter(s, tiny_llama) for s in ("ngram", "ngram:6", "ngram:4:2"))
    assert isinstance(default, NgramDrafter) and (default.max_ngram, default.min_ngram) == (4, 1)
    assert (longer.max_ngram, longer.min_ngram) == (6, 1)
    assert (bigram.max_ngram, bigram.min_ngram) == (4, 2)
    # auto: no DSpark drafter is shipped for this target, so n-gram lookup
    assert isinstance(make_drafter("auto", tiny_llama), NgramDrafter)
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("ngrams", tiny_llama)
    with pytest.raises(ValueError, match="min_ngram"):
        make_drafter("ngram:2:3", tiny_llama)


def test_the_first_token_comes_from_the_prefill_and_one_token_requests_need_no_round(tiny_llama):
    """Like plain decoding, the prefill's last logits give the first token: a request for one
    token finishes at admission (no verify round), and continuous batching still serves the
    queue behind it with the same tokens as longer requests start with."""
    from tests.test_lossless_greedy import hf_greedy, ragged_prompts

    prompts = ragged_prompts(5, seed=11)
    gen = DSparkGenerator(tiny_llama, NgramDrafter(), "fixed:4", max_batch_size=2)
    one = gen.generate(prompts, max_new_tokens=1)
    longer = gen.generate(prompts, max_new_tokens=6)
    assert [r.token_ids for r in one] == [hf_greedy(tiny_llama, p, 1) for p in prompts]
    assert [r.token_ids[:1] for r in longer] == [r.token_ids for r in one]
    assert all(r.stats.rounds == 0 and r.finish_reason == "length" for r in one)
    assert all(r.stats.rounds >= 1 for r in longer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_pick_the_first_maximum_like_argmax(dtype):
    from dspark.sampling import greedy_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 5, 300), generator=g).to(dtype)  # many ties per row
    logits[0, 0, [7, 9]] = 10.0  # an exact tie at the top: the first wins
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert greedy_tokens(logits)[0, 0] == 7
