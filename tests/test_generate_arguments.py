"""`DSparkGenerator.generate` refuses bad arguments and prompts at the API boundary, with a
ValueError or PromptError naming what is wrong, before the target runs a single forward;
and a prompt that fits the context with its new tokens is generated, whatever the scheduler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dspark.generator import DSparkGenerator, PromptError, stop_strings
from dspark.models import wrap_model
from tests.conftest import tiny_model, word_tokenizer
from tests.test_lossless_greedy import hf_greedy


@pytest.fixture
def gen(tiny_llama, monkeypatch):
    """A generator whose target fails loudly if anything reaches a forward pass."""
    g = DSparkGenerator(tiny_llama, "ngram", "fixed:2")

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran before the arguments were checked")

    monkeypatch.setattr(tiny_llama.model, "forward", no_forward)
    return g


BAD_ARGUMENTS = [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0), ("temperature", "0.5"), ("temperature", True),
    ("top_k", 2.5), ("top_k", -1), ("top_k", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("max_new_tokens", 2.5), ("max_new_tokens", 0), ("max_new_tokens", True), ("max_new_tokens", "8"),
    ("stop", [5]), ("stop", [None]), ("stop", [""]), ("stop", 5),
    ("seed", 1.5), ("seeds", [1]), ("seeds", ["a", "b"]),
    ("time_limit_s", 0), ("time_limit_s", math.nan), ("time_limit_s", math.inf),
]


@pytest.mark.parametrize(("name", "value"), BAD_ARGUMENTS)
def test_a_bad_argument_is_a_value_error_naming_it(gen, name, value):
    with pytest.raises(ValueError, match=name):
        gen.generate(["hello", "there"], **{name: value})


BAD_PROMPTS = [
    ([1.7, 2.2], "bad_token_id"), (["1", "2"], "bad_token_id"), ([True, False], "bad_token_id"),
    ([1, None], "bad_token_id"), (["a"], "bad_token_id"), ([10**9], "bad_token_id"), ([-1], "bad_token_id"),
    ([{"role": "user"}], "bad_message"), ([{"content": "hi"}], "bad_message"), ([{"role": "user", "content": 3}], "bad_message"),
    (torch.tensor([[1, 2]]), "bad_type"), (torch.tensor([1.0, 2.0]), "bad_type"), (3.5, "bad_type"),
    ("", "empty_prompt"), ([], "empty_prompt"), (None, "empty_prompt"),
]


@pytest.mark.parametrize(("prompt", "kind"), BAD_PROMPTS)
def test_a_bad_prompt_is_a_prompt_error_of_its_kind(gen, prompt, kind):
    with pytest.raises(PromptError) as err:
        gen.generate(["fine", prompt])
    assert err.value.kind == kind and "prompt 1" in str(err.value)


def test_integer_token_ids_of_any_integer_type_are_accepted(tiny_llama):
    gen = DSparkGenerator(tiny_llama, "ngram", "fixed:2")
    ids = [5, 6, 7]
    assert gen.encode(np.array(ids, dtype=np.int64)) == gen.encode(torch.tensor(ids)) == gen.encode(tuple(ids)) == ids


def test_messages_for_a_target_without_a_chat_template_are_refused():
    target = wrap_model(tiny_model("llama", 8, hidden=32), word_tokenizer(8), "no-template")
    with pytest.raises(PromptError) as err:
        DSparkGenerator(target, "ngram", "fixed:2").generate([[{"role": "user", "content": "w1 w2"}]])
    assert err.value.kind == "no_chat_template"


def test_a_bare_string_stop_is_one_stop_string(tiny_llama):
    assert stop_strings("ok.") == ("ok.",) and stop_strings(None) == () and stop_strings(["a", "b"]) == ("a", "b")
    gen = DSparkGenerator(tiny_llama, "ngram", "fixed:3")
    [free] = gen.generate([[20, 21, 22, 20, 21]], max_new_tokens=16)
    stop = free.text[len(free.text) // 2 :][:4]
    assert len(stop.strip()) >= 2, "test prompt produced no usable text"
    [bare] = gen.generate([[20, 21, 22, 20, 21]], max_new_tokens=16, stop=stop)
    [listed] = gen.generate([[20, 21, 22, 20, 21]], max_new_tokens=16, stop=[stop])
    assert bare.token_ids == listed.token_ids and bare.text == listed.text == free.text[: free.text.index(stop)]


@pytest.mark.parametrize("scheduler", ["fixed:8", "dspark", "threshold:0.0"])
def test_a_prompt_that_fits_with_its_new_tokens_is_generated_to_the_end(tiny_llama, scheduler):
    """prompt + max_new_tokens == the context: plain decoding fits, so speculation must too;
    drafts shrink as the row nears the end of the context. One token more is refused."""
    ctx, new = tiny_llama.max_context, 20
    prompt = (list(range(30, 60)) * 100)[: ctx - new]
    gen = DSparkGenerator(tiny_llama, "ngram", scheduler, max_batch_size=2)
    short = [7, 8, 9, 7, 8]
    results = gen.generate([prompt, short], max_new_tokens=new)
    assert [r.num_output_tokens for r in results] == [new, new]
    assert results[0].token_ids == hf_greedy(tiny_llama, prompt, new)
    assert results[0].stats.verified > 0  # it did draft: the repeating prompt is easy to look up
    with pytest.raises(PromptError) as err:
        gen.generate([prompt + [5]], max_new_tokens=new)
    assert err.value.kind == "too_long"
