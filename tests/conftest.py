"""Shared fixtures: tiny random-weight targets (fast) and the embedded SmolLM2 (end to end)."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from dspark.models import TargetModel, resolve_model_dir, wrap_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over "w0", "w1", ... with no EOS, for small-vocabulary statistical tests."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def tiny_model(
    arch: str, vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2, eos: int | None = None, sharpen: float = 1.0
):
    """A random-weight causal LM. `sharpen` scales the (tied) embedding so next-token
    distributions are peaked, as a trained model's are, and drafters' confidences mean something."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=eos,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    if sharpen != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(sharpen)
    return model.eval()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded model's real tokenizer (de-quantises the embedded model once per machine)."""
    model_dir, _ = resolve_model_dir("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


@pytest.fixture(scope="session")
def tiny_llama(smol_tokenizer) -> TargetModel:
    # no EOS, so every row runs to max_new_tokens and comparisons cover the whole length
    return wrap_model(tiny_model("llama", len(smol_tokenizer), seed=0, sharpen=16.0), smol_tokenizer, "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen2(smol_tokenizer) -> TargetModel:
    return wrap_model(tiny_model("qwen2", len(smol_tokenizer), seed=1, sharpen=16.0), smol_tokenizer, "tiny-qwen2")


@pytest.fixture(scope="session")
def embedded_fp32() -> TargetModel:
    from dspark.models import load_model

    return load_model("smollm2-135m-instruct", dtype="float32", device="cpu")
