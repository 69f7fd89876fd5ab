"""A batched KV cache with per-row holes, so rows can advance by different amounts.

Layout: per layer, keys/values [B, H_kv, S, D] in preallocated buffers that grow by
doubling (no per-step `torch.cat`). A slot is a column; `valid[b, s]` says whether slot s of
row b holds a committed token. Rotary positions are baked into the keys, so a row's tokens
need not be contiguous: the attention mask simply ignores invalid slots.

One verification round:
  1. the forward appends a block of W slots to every row (`update`, called by the model);
  2. `commit(keep)` moves each row's accepted block slots to the front of the block, marks
     them valid and drops the block's tail beyond the longest row's keep. Shorter rows leave
     holes, reclaimed by `compact` when they pile up.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SlotLayer(DynamicLayer):
    """A DynamicLayer writing into a growable buffer instead of concatenating."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0  # used slots
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        b, h, _, d = key_states.shape
        self._k = key_states.new_zeros(b, h, 64, d)
        self._v = value_states.new_zeros(b, h, 64, value_states.shape[-1])
        self.is_initialized = True

    def _ensure(self, needed: int) -> None:
        cap = self._k.shape[2]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        grow = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], new_cap - cap, t.shape[3])], dim=2)  # noqa: E731
        self._k, self._v = grow(self._k), grow(self._v)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        w = key_states.shape[2]
        self._ensure(self.length + w)
        self._k[:, :, self.length : self.length + w] = key_states
        self._v[:, :, self.length : self.length + w] = value_states
        self.length += w
        return self._k[:, :, : self.length], self._v[:, :, : self.length]

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:  # DynamicLayer.__init__/reset assign these
        pass

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        pass

    def get_seq_length(self) -> int:
        return self.length


def _uninitialised(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """A buffer whose slots past the used length are never read before `update` writes them."""
    return like.new_empty(*shape)


def _select_used(buf: torch.Tensor, rows: torch.Tensor, used: int) -> torch.Tensor:
    """buf[rows] with the same capacity, copying only the `used` slots: a row leaving a long
    batch costs half the copy or less."""
    if buf.device.type != "cpu":  # index_select into a strided view: measured on CPU only
        return buf[rows]
    out = _uninitialised(buf, len(rows), *buf.shape[1:])
    torch.index_select(buf[:, :, :used], 0, rows, out=out[:, :, :used])
    return out


class SlotCache(Cache):
    """KV cache for a batch of rows that advance independently (see module doc)."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        super().__init__(layers=[SlotLayer() for _ in range(num_layers)])
        self.device = device
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=device)  # [B, S]
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # [B] committed tokens per row

    # --- shape -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return self.valid.shape[0]

    def reset_rows(self, batch_size: int) -> None:
        """Start empty with `batch_size` rows."""
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer._k = layer._v = None
            layer.length = 0
            layer.is_initialized = False

    # --- one forward -------------------------------------------------------------------
    def block_inputs(
        self, block_mask: torch.Tensor, depths: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask and position ids for appending a block of W slots to every row.

        block_mask: [B, W, W] bool, query i may see block slot j (tree ancestry, padding off)
        depths:     [B, W] long, offset of each block token after the row's committed length
        returns mask [B, 1, W, S + W] additive in `dtype`, position_ids [B, W]
        """
        b, w, _ = block_mask.shape
        past = self.valid[:, None, :].expand(b, w, self.num_slots)
        allowed = torch.cat([past, block_mask], dim=2)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        positions = self.lengths[:, None] + depths
        return mask[:, None], positions

    def commit(self, keep: list[list[int]]) -> None:
        """After a forward that appended a block: keep[b] lists block offsets to commit for
        row b, in sequence order. They are moved to the block's front and marked valid."""
        b = self.batch_size
        start = self.num_slots
        w = self.layers[0].length - start
        n_keep = [len(k) for k in keep]
        longest = max(n_keep, default=0)
        if any(k != list(range(len(k))) for k in keep):  # tree or ragged paths: move slots
            order = torch.zeros(b, w, dtype=torch.long)
            for r, k in enumerate(keep):
                rest = [j for j in range(w) if j not in set(k)]
                order[r] = torch.tensor(k + rest, dtype=torch.long)
            order = order.to(self.device)
            for layer in self.layers:
                for buf in (layer._k, layer._v):
                    block = buf[:, :, start : start + w]
                    idx = order[:, None, :, None].expand(-1, block.shape[1], -1, block.shape[3])
                    buf[:, :, start : start + w] = torch.gather(block, 2, idx)
        for layer in self.layers:
            layer.length = start + longest
        new_valid = torch.zeros(b, longest, dtype=torch.bool, device=self.device)
        for r, n in enumerate(n_keep):
            new_valid[r, :n] = True
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.lengths = self.lengths + torch.tensor(n_keep, dtype=torch.long, device=self.device)

    # --- membership --------------------------------------------------------------------
    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), then drop slots no row uses."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.valid = self.valid[idx]
        self.lengths = self.lengths[idx]
        for layer in self.layers:
            if layer._k is not None:
                layer._k, layer._v = (_select_used(buf, idx, layer.length) for buf in (layer._k, layer._v))
        self.maybe_compact(force=len(rows) == 0)

    def append_rows(self, other: "SlotCache") -> None:
        """Add the rows of another cache (freshly prefilled requests) after ours."""
        if other.batch_size == 0:
            return
        if self.batch_size == 0 or self.layers[0]._k is None:
            self.valid, self.lengths = other.valid.clone(), other.lengths.clone()
            for mine, theirs in zip(self.layers, other.layers):
                mine._k, mine._v, mine.length = theirs._k, theirs._v, theirs.length
                mine.is_initialized = theirs.is_initialized
                mine.device, mine.dtype = getattr(theirs, "device", None), getattr(theirs, "dtype", None)
            return
        s = max(self.num_slots, other.num_slots)
        pad_valid = lambda v: torch.cat([v, v.new_zeros(v.shape[0], s - v.shape[1])], dim=1)  # noqa: E731
        self.valid = torch.cat([pad_valid(self.valid), pad_valid(other.valid)], dim=0)
        self.lengths = torch.cat([self.lengths, other.lengths])
        # room to grow: the next forward appends a block, and a buffer sized exactly to `s` would
        # be copied again at once (`_ensure` doubles it then anyway)
        cap = max(2 * s, 64)
        for mine, theirs in zip(self.layers, other.layers):
            for name in ("_k", "_v"):
                a, b = getattr(mine, name), getattr(theirs, name)
                out = _uninitialised(a, a.shape[0] + b.shape[0], a.shape[1], cap, a.shape[3])
                for part, src, used in ((out[: a.shape[0]], a, mine.length), (out[a.shape[0] :], b, theirs.length)):
                    part[:, :, :used] = src[:, :, :used]
                    part[:, :, used:s].zero_()  # masked slots are still read: keep them finite
                setattr(mine, name, out)
            mine.length = s

    def maybe_compact(self, force: bool = False) -> None:
        """Squeeze out holes once they make up more than half the slots (or when forced)."""
        s = self.num_slots
        longest = int(self.lengths.max()) if self.batch_size else 0
        if not force and s <= max(64, 2 * longest):
            return
        if self.batch_size == 0:
            for layer in self.layers:
                layer.length = 0
            self.valid = self.valid[:, :0]
            return
        # stable: valid slots first, in their original order
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]  # [B, L]
        for layer in self.layers:
            for name in ("_k", "_v"):
                buf = getattr(layer, name)
                idx = order[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3])
                packed = torch.gather(buf[:, :, :s], 2, idx)
                buf[:, :, :longest] = packed
            layer.length = longest
        ar = torch.arange(longest, device=self.device)
        self.valid = ar[None, :] < self.lengths[:, None]

    def drop_last_slots(self, n: int) -> None:
        """Undo the last `n` single-slot commits made for every row (a drafter's scratch steps)."""
        if n <= 0:
            return
        for layer in self.layers:
            layer.length -= n
        self.valid = self.valid[:, :-n]
        self.lengths = self.lengths - n
