"""Memory: the engine frees per-request state when `generate` returns (KV cache rows,
drafter state), and a soak over many calls shows no upward RSS trend.

The target is the pipeline tests' tiny random Llama (a real model folder, its own tokenizer),
so these tests do not need the embedded model."""

from __future__ import annotations

import ctypes
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_support import TINY_NAME, build_tiny_model_dir  # noqa: E402

import dspark.generator as generator_module  # noqa: E402
from dspark.drafters.draft_model import DraftModelDrafter  # noqa: E402
from dspark.drafters.ngram import NgramDrafter  # noqa: E402
from dspark.engine import SpeculativeEngine  # noqa: E402
from dspark.generator import DSparkGenerator  # noqa: E402
from dspark.models import TargetModel, load_model  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven cats count stars near the river".split()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> TargetModel:
    return load_model(str(build_tiny_model_dir(tmp_path_factory.mktemp("models") / TINY_NAME)), dtype="float32", device="cpu")


def prompts(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 30)))) for _ in range(n)]


# --- per-request state -------------------------------------------------------------------
class RecordingEngine(SpeculativeEngine):
    """The real engine; remembers its last instance so a test can look at its KV cache."""

    last: "RecordingEngine | None" = None

    def run(self, requests, on_finish=None):
        RecordingEngine.last = self
        return super().run(requests, on_finish)


class RecordingNgram(NgramDrafter):
    """The real n-gram drafter; keeps the per-request objects it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.finished = [], 0

    def start(self, request, prompt_hidden=None) -> None:
        self.started.append(request)
        super().start(request, prompt_hidden)

    def finish(self, request) -> None:
        self.finished += 1
        super().finish(request)


def assert_cache_empty(engine: SpeculativeEngine) -> None:
    cache = engine.runner.cache
    assert cache.batch_size == 0
    assert all(layer.length == 0 for layer in cache.layers)


def test_generate_frees_kv_cache_rows_and_ngram_state(target, monkeypatch):
    monkeypatch.setattr(generator_module, "SpeculativeEngine", RecordingEngine)
    drafter = RecordingNgram()
    gen = DSparkGenerator(target, drafter, "fixed:3", max_batch_size=3)
    results = gen.generate(prompts(0, 7), max_new_tokens=12)  # 7 rows through 3 slots: rows join and leave
    assert len(results) == 7
    assert_cache_empty(RecordingEngine.last)
    assert len(drafter.started) == drafter.finished == 7
    assert all(r.state == {} for r in drafter.started)  # each row's n-gram index was dropped
    assert any(r.stats.drafted for r in results)  # it really drafted


def test_generate_frees_the_draft_models_cache_rows(target, monkeypatch):
    monkeypatch.setattr(generator_module, "SpeculativeEngine", RecordingEngine)
    drafter = DraftModelDrafter(target, target)  # the target as its own draft: same tokenizer
    gen = DSparkGenerator(target, drafter, "fixed:3", max_batch_size=3)
    for seed in range(2):  # the drafter outlives calls: nothing may pile up between them
        gen.generate(prompts(seed, 5), max_new_tokens=10)
        assert_cache_empty(RecordingEngine.last)
        assert drafter.rows == [] and drafter.seen == {}
        assert drafter.runner.cache.batch_size == 0


class FailingDraftModel(DraftModelDrafter):
    """A draft model whose 5th verification outcome raises: the engine fails mid-call."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.outcomes = 0

    def observe(self, request, outcome) -> None:
        self.outcomes += 1
        if self.outcomes == 5:
            raise RuntimeError("injected engine failure")
        super().observe(request, outcome)


def test_a_failed_generate_also_frees_the_draft_models_rows(target):
    drafter = FailingDraftModel(target, target)
    gen = DSparkGenerator(target, drafter, "fixed:3", max_batch_size=4)
    with pytest.raises(RuntimeError, match="injected"):
        gen.generate(prompts(3, 6), max_new_tokens=12)
    assert drafter.rows == [] and drafter.seen == {} and drafter.runner.cache.batch_size == 0


# --- soak --------------------------------------------------------------------------------
def release_free_heap() -> None:
    """Return free heap pages to the OS (glibc), so RSS follows live memory rather than the
    allocator's high-water mark; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_after(step: Callable[[int], None], calls: int) -> list[int]:
    """RSS after each of `calls` steps, fully garbage collected and trimmed first so that only
    live memory counts. Objects alive before the soak are frozen out of the collections (a full
    collection over everything torch and transformers hold takes about half a second)."""
    proc, samples = psutil.Process(), []
    gc.collect()
    gc.freeze()
    try:
        for i in range(calls):
            step(i)
            gc.collect()
            release_free_heap()
            samples.append(proc.memory_info().rss)
    finally:
        gc.unfreeze()
    return samples


def trend_bytes_per_call(samples: list[int], warmup: int) -> float:
    """Least-squares slope of RSS over calls after the warm-up (allocator pools, caches and the
    cost table settle in the first calls)."""
    ys = np.asarray(samples[warmup:], dtype=np.float64)
    return float(np.polyfit(np.arange(len(ys)), ys, 1)[0])


CALLS, WARMUP = 40, 10
# bytes per call: a clean engine grows a few KiB a call (allocator steps of a few hundred KiB
# included), one with the 64 KiB-per-call leak below about 68 KiB a call.
BOUND = 24 * 1024


def test_soak_many_batches_shows_no_rss_growth(target):
    gen = DSparkGenerator(target, "ngram", "dspark", max_batch_size=4)
    torch.manual_seed(0)

    def step(i: int) -> None:
        results = gen.generate(prompts(100 + i, 4), max_new_tokens=12)
        assert len(results) == 4

    slope = trend_bytes_per_call(rss_after(step, CALLS), WARMUP)
    assert slope < BOUND, f"RSS grows by {slope / 1024:.1f} KiB per call"


def test_soak_trend_detects_a_leak_of_the_size_it_guards_against(target):
    """The detector itself: the same soak, but keeping every call's results and a 64 KiB tensor
    per call (the size of one small KV cache), must show a trend above the bound."""
    gen = DSparkGenerator(target, "ngram", "dspark", max_batch_size=4)
    kept = []

    def step(i: int) -> None:
        kept.append((gen.generate(prompts(100 + i, 4), max_new_tokens=12), torch.ones(16 * 1024)))

    slope = trend_bytes_per_call(rss_after(step, 24), 6)
    assert slope > BOUND, f"a 64 KiB-per-call leak showed only {slope / 1024:.1f} KiB per call"
