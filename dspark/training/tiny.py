"""A tiny random Llama target with a word-level tokenizer, for tests and smoke runs."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from dspark.models import TargetModel, wrap_model


def tiny_tokenizer(vocab_size: int = 96) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_target(
    seed: int = 0,
    vocab_size: int = 96,
    hidden: int = 64,
    layers: int = 4,
    dtype: torch.dtype = torch.float32,
    name: str = "tiny-llama",
) -> TargetModel:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    # sharpen the random model so greedy continuations are not all near-ties
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    return wrap_model(model, tiny_tokenizer(vocab_size), name=name)
