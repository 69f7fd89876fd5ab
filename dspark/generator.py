"""The public API: `DSparkGenerator(target, drafter, scheduler).generate(prompts, ...)`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from dspark.cost_model import load_or_profile
from dspark.draft_gate import gate_for
from dspark.drafters import make_drafter
from dspark.drafters.base import Drafter
from dspark.engine import Request, SpeculativeEngine
from dspark.fallbacks import Attempt, RetryHook, call_with_fallbacks, decode_batch_size
from dspark.metrics import RequestStats
from dspark.models import EMBEDDED_NAME, TargetModel, load_model
from dspark.sampling import SamplingParams, is_int, is_real
from dspark.schedulers import Scheduler, UtilizationAdaptive, make_scheduler
from dspark.hardware import UtilizationProbe

TRUNCATION_POLICIES = ("error", "left", "right")


class PromptError(ValueError):
    """A prompt that cannot be generated from; `kind` is a stable machine-readable tag."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str  # "eos" | "length" | "stop" | "time_limit" (partial output)
    latency_s: float  # from the request's admission to its last token
    ttft_s: float  # from admission to its first token
    stats: RequestStats
    truncated: bool = False  # the prompt was cut to fit the context (truncation policy)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.latency_s if self.latency_s > 0 else 0.0


class DSparkGenerator:
    """Lossless speculative generation for a Hugging Face causal LM.

    >>> gen = DSparkGenerator.from_names("smollm2-135m-instruct", drafter="ngram", scheduler="dspark")
    >>> gen.generate(["Summarise: ..."], max_new_tokens=128)[0].text
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: str | Drafter | None = "auto",
        scheduler: str | Scheduler = "dspark",
        max_batch_size: int = 8,
        truncation: str = "error",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if truncation not in TRUNCATION_POLICIES:
            raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
        self.target = target
        self.scheduler = make_scheduler(scheduler)
        if self.scheduler.max_depth == 0 or drafter is None:
            drafter = "none"
        self.drafter = make_drafter(drafter, target) if isinstance(drafter, str) else drafter
        if getattr(self.scheduler, "needs_cost_table", False):
            self.scheduler.cost = load_or_profile(target, max_rows=max_batch_size)
            self.scheduler.needs_cost_table = False
        if isinstance(self.scheduler, UtilizationAdaptive) and isinstance(self.scheduler.probe, UtilizationProbe):
            self.scheduler.probe = UtilizationProbe(target.device)
        self.max_batch_size = max_batch_size
        self.truncation = truncation
        # one draft gate for the generator's life: what it learned about this drafter on this
        # hardware carries over from call to call instead of being re-probed every time
        self.draft_gate = gate_for(self.scheduler)
        self._plain: DSparkGenerator | None = None

    @classmethod
    def from_names(
        cls,
        target: str = EMBEDDED_NAME,
        drafter: str | None = "auto",
        scheduler: str = "dspark",
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 8,
        truncation: str = "error",
        trust_remote_code: bool = False,
    ) -> "DSparkGenerator":
        model = load_model(target, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        return cls(model, drafter, scheduler, max_batch_size=max_batch_size, truncation=truncation)

    # --- validation --------------------------------------------------------------------
    def encode(
        self, prompt: str | Sequence[int] | list[dict], chat: bool = True, max_new_tokens: int = 0, parse_special_tokens: bool = False
    ) -> list[int]:
        """Token ids for one prompt, or PromptError. Token ids (a list, tuple, 1-D tensor or
        array of integers) are used as they are. Text is literal: a string that spells a
        control token becomes text tokens, unless `parse_special_tokens`."""
        ids, _ = self._encode(prompt, chat, max_new_tokens, parse_special_tokens)
        return ids

    def _encode(self, prompt, chat: bool, max_new_tokens: int, parse_special_tokens: bool = False) -> tuple[list[int], bool]:
        literal = not parse_special_tokens
        if prompt is None:
            raise PromptError("empty_prompt", "prompt is None")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("empty_prompt", "prompt is empty or whitespace only")
            ids = self.target.encode(prompt, chat=chat, literal=literal)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.target.encode(check_messages(prompt, self.target), chat=True, literal=literal)
        elif isinstance(prompt, (torch.Tensor, np.ndarray)):
            integer = prompt.dtype.kind in "iu" if isinstance(prompt, np.ndarray) else not (
                prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool)
            if prompt.ndim != 1 or not integer:
                raise PromptError("bad_type", f"an array prompt must be 1-D integer token ids, got {prompt.ndim}-D {prompt.dtype}")
            ids = check_token_ids(prompt.tolist(), self.target.vocab_size)
        elif isinstance(prompt, (list, tuple)):
            ids = check_token_ids(prompt, self.target.vocab_size)
        else:
            raise PromptError("bad_type", f"prompt must be str, list of messages or token ids, got {type(prompt).__name__}")
        limit = self.target.max_context - max_new_tokens  # prompt + output fit the context, as in plain decoding
        if limit < 1:
            raise PromptError("too_long", f"max_new_tokens={max_new_tokens} leaves no room in the {self.target.max_context}-token context")
        if len(ids) <= limit:
            return ids, False
        if self.truncation == "error":
            raise PromptError(
                "too_long",
                f"prompt is {len(ids)} tokens; with max_new_tokens={max_new_tokens} at most {limit} fit the "
                f"{self.target.max_context}-token context (choose a truncation policy to cut it)",
            )
        keep = "end" if self.truncation == "left" else "start"
        if isinstance(prompt, str):  # cut the text, never the chat template around it
            cut = cut_to_fit(prompt, lambda text: self.target.encode(text, chat=chat, literal=literal), limit,
                             self.target.tokenizer, keep)
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):  # the last message's text
            *earlier, last = check_messages(prompt, self.target)
            cut = cut_to_fit(last["content"], lambda text: self.target.encode([*earlier, {**last, "content": text}],
                                                                              chat=True, literal=literal),
                             limit, self.target.tokenizer, keep)
        else:  # token ids: cut the ids themselves
            return (ids[-limit:] if keep == "end" else ids[:limit]), True
        if cut is None:
            raise PromptError("too_long", f"not even one token of the prompt's text fits with max_new_tokens={max_new_tokens}")
        return cut, True

    # --- generation --------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | list[dict]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = 0,
        chat: bool = True,
        progress: bool = False,
        seeds: Sequence[int] | None = None,
        time_limit_s: float | None = None,
        parse_special_tokens: bool = False,
    ) -> list[GenerationResult]:
        """Generate for every prompt (same order). Raises PromptError on an invalid prompt
        before any generation starts; validate with `encode` to handle rows one by one.

        Sampling: prompt i uses `seeds[i]` when given (so a row's output does not depend on
        which call or batch it lands in), else `seed + i`.
        time_limit_s: per prompt, wall time from when it enters the batch; a prompt past it
        stops with finish_reason "time_limit" and keeps the tokens produced so far.
        parse_special_tokens: text that spells a control token (`<|im_end|>`) is tokenized as
        that token instead of as text; only for prompts that are templated on purpose."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts; wrap a single prompt in a list")
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        sampling = SamplingParams(temperature, top_k, top_p)
        stop = stop_strings(stop)
        if seed is not None and not is_int(seed):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        if seeds is not None:
            if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence) or len(seeds) != len(prompts):
                raise ValueError(f"seeds must be a list of one integer per prompt ({len(prompts)}), got {seeds!r:.80}")
            if not all(is_int(x) for x in seeds):
                raise ValueError(f"seeds must be integers, got {seeds!r:.80}")
        if time_limit_s is not None and (not is_real(time_limit_s) or not math.isfinite(time_limit_s) or time_limit_s <= 0):
            raise ValueError(f"time_limit_s must be a finite number > 0 or None, got {time_limit_s!r}")
        requests, truncated = [], []
        for i, p in enumerate(prompts):
            try:
                ids, cut = self._encode(p, chat, max_new_tokens, parse_special_tokens)
            except PromptError as e:
                raise PromptError(e.kind, f"prompt {i}: {e}") from None
            row_seed = int(seeds[i]) if seeds is not None else (None if seed is None else seed + i)
            requests.append(Request(i, ids, int(max_new_tokens), sampling, stop, row_seed, time_limit_s))
            truncated.append(cut)
        engine = SpeculativeEngine(
            self.target, self.drafter, self.scheduler, self.max_batch_size, draft_gate=self.draft_gate or False
        )
        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not progress)
        try:
            engine.run(requests, on_finish=lambda r: bar.update(1))
        finally:
            bar.close()
        return [self._result(r, cut) for r, cut in zip(requests, truncated)]

    def generate_each(
        self,
        prompts: Sequence[str | Sequence[int] | list[dict]],
        *,
        seed: int | None = 0,
        seeds: Sequence[int] | None = None,
        on_retry: RetryHook | None = None,
        **kwargs,
    ) -> list[GenerationResult | Exception]:
        """`generate`, where a failure costs only the rows it belongs to: one result per prompt,
        a GenerationResult or the exception that prompt fails with on its own (a PromptError,
        torch.OutOfMemoryError or the engine's error). Out of memory, the same rows are retried
        with fewer rows decoding together and then without speculation; any other error splits
        the call in halves down to single rows (`dspark.fallbacks`). Each row keeps its seed
        (`seeds[i]`, else `seed + i`) wherever it lands, so retries change no output.
        on_retry(kind, rows, next attempt, error) hears of each retry ("split", "halve_batch",
        "no_speculation"). Other arguments as for `generate`."""
        if seeds is None and seed is not None:
            seeds = [seed + i for i in range(len(prompts))]
        rows = list(zip(prompts, seeds if seeds is not None else [None] * len(prompts)))

        def call(part: list, attempt: Attempt) -> list[GenerationResult]:
            generator = self if attempt.speculate else self.without_speculation()
            part_seeds = {"seeds": [s for _, s in part]} if seeds is not None else {"seed": None}
            with decode_batch_size(generator, attempt.batch_size):
                return generator.generate([p for p, _ in part], **part_seeds, **kwargs)

        return call_with_fallbacks(call, rows, Attempt(self.max_batch_size, True), on_retry)

    def without_speculation(self) -> "DSparkGenerator":
        """The same target decoding one row at a time without a drafter: the last resort after
        running out of memory. Built on first use, sharing the loaded weights; the same class,
        so a subclass keeps its behaviour."""
        if self._plain is None:
            self._plain = type(self)(self.target, drafter=None, scheduler="ar", max_batch_size=1)
        return self._plain

    def _result(self, req: Request, truncated: bool) -> GenerationResult:
        text = self.target.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if req.stop_text_len is not None:
            text = text[: req.stop_text_len]
        return GenerationResult(
            text=text,
            token_ids=list(req.output_ids),
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
            finish_reason=req.finish_reason or "length",
            latency_s=req.latency_s,
            ttft_s=req.ttft_s,
            stats=req.stats,
            truncated=truncated,
        )


def cut_to_fit(
    text: str, encode: Callable[[str], list[int]], limit: int | None, tokenizer, keep: str = "start"
) -> list[int] | None:
    """The longest cut of `text`, in whole tokens from its start (keep="start") or its end
    ("end"), whose prompt `encode(cut)` is at most `limit` tokens (None: `encode` raises
    PromptError when a prompt does not fit): a binary search over the text tokens kept. Returns
    the prompt's ids, or None when not even one token fits. Only the text is
    cut: whatever `encode` wraps around it (a chat template, a prompt template) stays whole."""
    text_ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def fitting(n: int) -> list[int] | None:
        cut = tokenizer.decode(text_ids[:n] if keep == "start" else text_ids[len(text_ids) - n:])
        try:
            ids = encode(cut)
        except PromptError:
            return None
        return ids if limit is None or len(ids) <= limit else None

    lo, hi, best = 1, len(text_ids) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        found = fitting(mid)
        if found is None:
            hi = mid - 1
        else:
            best, lo = found, mid + 1
    return best


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """The `stop` argument as a tuple of non-empty strings; a bare string is one stop string."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, bytes) or not isinstance(stop, Sequence):
        raise ValueError(f"stop must be a string, a list of strings or None, got {type(stop).__name__}")
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r:.80}")
    return tuple(stop)


def check_token_ids(ids: Sequence, vocab_size: int) -> list[int]:
    """A token-id prompt as ints, or PromptError: never rounded, parsed or taken from bools."""
    if not ids:
        raise PromptError("empty_prompt", "prompt has no tokens")
    bad = [t for t in ids if not is_int(t)]
    if bad:
        raise PromptError("bad_token_id", f"token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})")
    ids = [int(t) for t in ids]
    if any(not 0 <= t < vocab_size for t in ids):
        raise PromptError("bad_token_id", f"token ids must be in [0, {vocab_size})")
    return ids


def check_messages(messages: Sequence[dict], target: TargetModel) -> list[dict]:
    """Chat messages as the template expects them, or PromptError."""
    if not getattr(target.tokenizer, "chat_template", None):
        raise PromptError("no_chat_template", f"{target.name} has no chat template; pass text or token ids")
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptError("bad_message", f"message {i} needs a string 'role' and a string 'content', got {sorted(m)}")
    if not any(m["content"].strip() for m in messages):
        raise PromptError("empty_prompt", "every message is empty")
    return list(messages)
