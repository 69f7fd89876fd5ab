"""The public API: `DSparkGenerator(target, drafter, scheduler).generate(prompts, ...)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from dspark.cost_model import load_or_profile
from dspark.draft_gate import gate_for
from dspark.drafters import make_drafter
from dspark.drafters.base import Drafter
from dspark.engine import Request, SpeculativeEngine
from dspark.metrics import RequestStats
from dspark.models import EMBEDDED_NAME, TargetModel, load_model
from dspark.sampling import SamplingParams
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
        drafter: str | Drafter | None = "ngram",
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

    @classmethod
    def from_names(
        cls,
        target: str = EMBEDDED_NAME,
        drafter: str | None = "ngram",
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
    def encode(self, prompt: str | Sequence[int] | list[dict], chat: bool = True, max_new_tokens: int = 0) -> list[int]:
        """Token ids for one prompt, or PromptError. Token-id lists are used as they are."""
        ids, _ = self._encode(prompt, chat, max_new_tokens)
        return ids

    def _encode(self, prompt, chat: bool, max_new_tokens: int) -> tuple[list[int], bool]:
        if prompt is None:
            raise PromptError("empty_prompt", "prompt is None")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("empty_prompt", "prompt is empty or whitespace only")
            ids = self.target.encode(prompt, chat=chat)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids = self.target.encode(prompt, chat=True)
        elif isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            ids = [int(t) for t in prompt]
            if not ids:
                raise PromptError("empty_prompt", "prompt has no tokens")
            if any(not 0 <= t < self.target.vocab_size for t in ids):
                raise PromptError("bad_token_id", f"token ids must be in [0, {self.target.vocab_size})")
        else:
            raise PromptError("bad_type", f"prompt must be str, list of messages or token ids, got {type(prompt).__name__}")
        limit = self.target.max_context - max_new_tokens - self.scheduler.max_depth - 1
        if limit < 1:
            raise PromptError("too_long", f"max_new_tokens={max_new_tokens} leaves no room in the {self.target.max_context}-token context")
        if len(ids) > limit:
            if self.truncation == "error":
                raise PromptError(
                    "too_long",
                    f"prompt is {len(ids)} tokens; with max_new_tokens={max_new_tokens} at most {limit} fit the "
                    f"{self.target.max_context}-token context (choose a truncation policy to cut it)",
                )
            ids = ids[-limit:] if self.truncation == "left" else ids[:limit]
            return ids, True
        return ids, False

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
    ) -> list[GenerationResult]:
        """Generate for every prompt (same order). Raises PromptError on an invalid prompt
        before any generation starts; validate with `encode` to handle rows one by one.

        Sampling: prompt i uses `seeds[i]` when given (so a row's output does not depend on
        which call or batch it lands in), else `seed + i`.
        time_limit_s: per prompt, wall time from when it enters the batch; a prompt past it
        stops with finish_reason "time_limit" and keeps the tokens produced so far."""
        if isinstance(prompts, str):
            raise TypeError("generate takes a list of prompts; wrap a single prompt in a list")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = SamplingParams(temperature, top_k, top_p)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        if time_limit_s is not None and time_limit_s <= 0:
            raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
        requests, truncated = [], []
        for i, p in enumerate(prompts):
            try:
                ids, cut = self._encode(p, chat, max_new_tokens)
            except PromptError as e:
                raise PromptError(e.kind, f"prompt {i}: {e}") from None
            row_seed = int(seeds[i]) if seeds is not None else (None if seed is None else seed + i)
            requests.append(Request(i, ids, max_new_tokens, sampling, tuple(stop or ()), row_seed, time_limit_s))
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
