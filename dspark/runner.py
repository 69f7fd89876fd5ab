"""Runs a causal LM over blocks of tokens for a batch of rows that share one SlotCache."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dspark.kv import SlotCache
from dspark.tree import ancestor_mask


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [B, W, V]
    hidden: list[torch.Tensor] | None  # per requested layer, [B, W, d]


class ModelRunner:
    """Owns a model's batched KV cache; rows are addressed by their index in the batch."""

    def __init__(self, model: PreTrainedModel, hidden_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = model.config.num_hidden_layers
        self.hidden_layers = tuple(hidden_layers)
        # transformers >= 5.2x renamed `past_key_values` to `cache`
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache = self.new_cache()
        self.cache.reset_rows(0)

    def new_cache(self) -> SlotCache:
        return SlotCache(self.num_layers, self.device)

    @torch.no_grad()
    def forward_block(
        self,
        blocks: list[tuple[list[int], list[int]]],
        cache: SlotCache | None = None,
        logits_positions: str = "all",
    ) -> BlockOutput:
        """Append one block per row and run the model.

        blocks[b] = (tokens, parents): tokens[0] sits after the row's committed tokens;
        parents[i] is the block index of token i's parent (-1 for the first token), so a
        chain is parents = [-1, 0, 1, ...]. Shorter rows are padded; pads see only themselves.
        logits_positions: "all" or "none" (prefill needs no logits).
        """
        cache = cache if cache is not None else self.cache
        b = len(blocks)
        w = max(len(t) for t, _ in blocks)
        ids = torch.zeros(b, w, dtype=torch.long)
        depths = torch.zeros(b, w, dtype=torch.long)
        mask = torch.eye(w, dtype=torch.bool).repeat(b, 1, 1)
        for r, (tokens, parents) in enumerate(blocks):
            n = len(tokens)
            if n == 0:
                continue
            ids[r, :n] = torch.tensor(tokens)
            # ancestor_mask works in "anchor + nodes" coordinates: node k at index k+1 with
            # parent p at p+1. Here block index 0 is the root, so shift parents down by one.
            anc = ancestor_mask([p - 1 if p >= 0 else -1 for p in parents[1:]]) if n > 1 else torch.ones(1, 1, dtype=torch.bool)
            mask[r, :n, :n] = anc
            d = torch.zeros(n, dtype=torch.long)
            for i in range(1, n):
                d[i] = d[parents[i]] + 1
            depths[r, :n] = d
        ids, depths, mask = ids.to(self.device), depths.to(self.device), mask.to(self.device)
        attn, positions = cache.block_inputs(mask, depths, self.dtype)
        want_hidden = bool(self.hidden_layers)
        kwargs = dict(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            **{self._cache_kwarg: cache},
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        if logits_positions == "none":
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        hidden = [out.hidden_states[i] for i in self.hidden_layers] if want_hidden else None
        return BlockOutput(out.logits, hidden)

    def prefill(self, prompts: list[list[int]]) -> tuple[SlotCache, list[torch.Tensor] | None]:
        """Fill a fresh cache with each prompt; returns it (to merge) and the requested
        hidden states [B, P, d] per layer (rows right-padded)."""
        cache = self.new_cache()
        cache.reset_rows(len(prompts))
        if max(len(p) for p in prompts) == 0:
            return cache, None
        blocks = [(p, list(range(-1, len(p) - 1))) for p in prompts]
        out = self.forward_block(blocks, cache=cache, logits_positions="none")
        cache.commit([list(range(len(p))) for p in prompts])
        return cache, out.hidden
