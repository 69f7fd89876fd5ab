"""Runs a causal LM over blocks of tokens for a batch of rows that share one SlotCache."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from dspark.kv import SlotCache
from dspark.lean_forward import LeanDecoder, lean_support
from dspark.tree import ancestor_mask

LOG = logging.getLogger(__name__)


@dataclass
class BlockOutput:
    logits: torch.Tensor | None  # [B, W, V]; None for a prefill that asked for none
    hidden: list[torch.Tensor] | None  # per requested layer, [B, W, d]


class ModelRunner:
    """Owns a model's batched KV cache; rows are addressed by their index in the batch.

    Llama-family models run through `LeanDecoder` (same arithmetic, less per-module overhead);
    others, or `lean=False`, through transformers' forward."""

    def __init__(self, model: PreTrainedModel, hidden_layers: tuple[int, ...] = (), lean: bool = True) -> None:
        self.model = model
        why = lean_support(model) if lean else "lean=False"
        self.lean = LeanDecoder(model) if why is None else None
        if why is not None and lean:
            LOG.debug("transformers forward for this model (%s)", why)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = model.config.num_hidden_layers
        self.hidden_layers = tuple(hidden_layers)
        # Rows of different lengths run their projections/MLPs/LM head on real tokens only
        # (`RaggedLayout`), so a round costs by its total tokens, not rows x the widest row.
        # CPU only: on CUDA the lean path keeps transformers' (padded) kernel shapes.
        self.packs_ragged_blocks = self.lean is not None and not self.lean.transformers_kernels
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
        logits_positions: str | torch.Tensor = "all",
    ) -> BlockOutput:
        """Append one block per row and run the model.

        blocks[b] = (tokens, parents): tokens[0] sits after the row's committed tokens;
        parents[i] is the block index of token i's parent (-1 for the first token), so a
        chain is parents = [-1, 0, 1, ...]. Shorter rows are padded; pads see only themselves
        (and, when `packs_ragged_blocks`, cost nothing outside attention).
        logits_positions: "all", "none" (a prefill that needs no logits), or a 1-D tensor of
        block positions: logits [B, len(positions), V] at those positions of every row.
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
        if self.lean is not None:
            keep = logits_positions.to(self.device) if isinstance(logits_positions, torch.Tensor) else None
            no_logits = isinstance(logits_positions, str) and logits_positions == "none"
            maskless, is_causal = self._maskless(blocks, cache) if self.lean.transformers_kernels else (False, False)
            lengths = torch.tensor([len(t) for t, _ in blocks], device=self.device) if self.packs_ragged_blocks else None
            logits, hidden = self.lean(
                ids, None if maskless else attn, positions, cache, self.hidden_layers, keep,
                want_logits=not no_logits, is_causal=is_causal, lengths=lengths,
            )
            return BlockOutput(logits, hidden)
        want_hidden = bool(self.hidden_layers)
        kwargs = dict(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            **{self._cache_kwarg: cache},
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        if isinstance(logits_positions, torch.Tensor):
            kwargs["logits_to_keep"] = logits_positions.to(self.device)
        elif logits_positions == "none":
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        hidden = [out.hidden_states[i] for i in self.hidden_layers] if want_hidden else None
        return BlockOutput(out.logits, hidden)

    @staticmethod
    def _maskless(blocks: list[tuple[list[int], list[int]]], cache: SlotCache) -> tuple[bool, bool]:
        """(no mask needed, causal) where transformers would pass no mask either: one row, a
        chain, every cached slot valid, and either one new token (it sees every key) or an
        empty cache (plain causal). Then SDPA may use its fastest kernel, as transformers'."""
        if len(blocks) != 1:
            return False, False
        tokens, parents = blocks[0]
        w = len(tokens)
        if parents != list(range(-1, w - 1)):
            return False, False
        if cache.num_slots == 0:
            return True, w > 1
        if w == 1 and int(cache.lengths[0]) == cache.num_slots:  # one sync: holes left by a batch?
            return True, False
        return False, False

    def prefill(self, prompts: list[list[int]]) -> tuple[SlotCache, list[torch.Tensor] | None]:
        """Fill a fresh cache with each prompt; returns it (to merge) and the requested hidden
        states [B, P, d] per layer (rows right-padded)."""
        cache, hidden, _ = self._prefill(prompts, last_logits=False)
        return cache, hidden

    def prefill_with_logits(self, prompts: list[list[int]]) -> tuple[SlotCache, list[torch.Tensor] | None, torch.Tensor]:
        """`prefill`, plus the logits at each prompt's last token [B, V]: the distribution of
        the first generated token, so decoding needs no extra forward for it."""
        cache, hidden, logits = self._prefill(prompts, last_logits=True)
        assert logits is not None
        return cache, hidden, logits

    def _prefill(self, prompts: list[list[int]], last_logits: bool):
        """Prefill in groups of similar length where the forward packs ragged rows: attention
        runs on each call's padded [rows, longest] grid, so a short prompt beside a long one
        would pay the long one's attention. The groups' caches are merged back in prompt order."""
        lengths = [len(p) for p in prompts]
        groups = prefill_groups(lengths) if self.packs_ragged_blocks and min(lengths) > 0 else [list(range(len(prompts)))]
        if len(groups) == 1:
            return self._prefill_group(prompts, last_logits)
        cache = self.new_cache()
        cache.reset_rows(0)
        parts, order = [], []
        for g in groups:
            part_cache, hidden, logits = self._prefill_group([prompts[i] for i in g], last_logits)
            cache.append_rows(part_cache)
            parts.append((hidden, logits))
            order += g
        back = sorted(range(len(order)), key=order.__getitem__)  # prompt i is merged row back[i]
        cache.select_rows(back)
        logits = torch.cat([lg for _, lg in parts])[back] if last_logits else None
        hidden = None
        if parts[0][0] is not None:
            width = max(len(p) for p in prompts)

            def merged(layer: int) -> torch.Tensor:  # [B, width, d] in prompt order, zeros past each prompt
                rows = [F.pad(h[layer], (0, 0, 0, width - h[layer].shape[1])) for h, _ in parts]
                return torch.cat(rows)[back]

            hidden = [merged(layer) for layer in range(len(parts[0][0]))]
        return cache, hidden, logits

    def _prefill_group(self, prompts: list[list[int]], last_logits: bool):
        cache = self.new_cache()
        cache.reset_rows(len(prompts))
        if max(len(p) for p in prompts) == 0:
            if last_logits:
                raise ValueError("a prompt needs at least one token to give the next token's logits")
            return cache, None, None
        blocks = [(p, list(range(-1, len(p) - 1))) for p in prompts]
        ends = sorted({len(p) - 1 for p in prompts})
        # the LM head only where some row ends (at most one position per row), or nowhere
        positions: str | torch.Tensor = torch.tensor(ends) if last_logits else "none"
        out = self.forward_block(blocks, cache=cache, logits_positions=positions)
        cache.commit([list(range(len(p))) for p in prompts])
        logits = None
        if last_logits:
            rows = torch.arange(len(prompts), device=out.logits.device)
            column = torch.tensor([ends.index(len(p) - 1) for p in prompts], device=out.logits.device)
            logits = out.logits[rows, column]
        return cache, out.hidden, logits


# A prefill group's padded grid (rows x longest prompt) may exceed its real tokens by this much.
PREFILL_PADDING = 0.25


def prefill_groups(lengths: list[int], padding: float = PREFILL_PADDING) -> list[list[int]]:
    """Prompt indices in groups for prefill: by rising length, a prompt joins the current group
    while the group's padded grid stays within (1 + padding) x its real tokens. Attention runs
    on the padded grid, so prompts of very different lengths prefill faster in separate groups
    than in one call (docs/cpu-kernels.md)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    total = 0
    for i in order:
        n = lengths[i]
        if groups and (len(groups[-1]) + 1) * n <= (1 + padding) * (total + n):
            groups[-1].append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups
