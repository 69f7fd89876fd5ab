"""Reduced draft vocabulary (FR-Spec): the drafter scores only frequent tokens.

On CPU a draft round's cost is mostly reading vocabulary-sized matrices: the shared LM head
(V x d) for the block, and the Markov head's W2 (V x r) once per depth. Restricting the
candidates to the N tokens the target emits most often cuts both by V/N. Verification
still checks every drafted token against the full target distribution, so outputs do not
change (greedy or sampled); only acceptance can drop, when the right token is outside the
set.

Inside `DraftVocab`, logits have Vd columns and column i means token `token_ids[i]`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.cpu_matmul import KernelChoice, PackedLinear, available_kernels, build_kernels
from dspark.dspark_drafter.model import DSparkModel, lm_head_logits

VOCAB_FILE = "draft_vocab.safetensors"


def frequent_tokens(sequences: Iterable[Sequence[int]], size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids in `sequences` (ties: lower id first) plus `always`
    (e.g. EOS), sorted ascending -> int64 [<= size + len(always)]."""
    if size < 1:
        raise ValueError("draft vocabulary size must be >= 1")
    ids = set(_by_count(Counter(t for seq in sequences for t in seq))[:size]) | {int(t) for t in always}
    return torch.tensor(sorted(ids), dtype=torch.long)


def grow_vocab(kept: torch.Tensor, sequences: Iterable[Sequence[int]], size: int) -> torch.Tensor:
    """`kept` (a trained drafter's vocabulary) plus the most frequent other ids in `sequences`
    (ties: lower id first) until there are `size` (or no others are left), sorted ascending
    -> int64 [<= max(size, len(kept))].

    A warm start that widens the vocabulary keeps every token the drafter already proposes,
    so the drafter starts as the same function over them and only learns the new ones."""
    have = {int(t) for t in kept.tolist()}
    added = _by_count(Counter(t for seq in sequences for t in seq if t not in have))[: max(0, size - len(have))]
    return torch.tensor(sorted(have | set(added)), dtype=torch.long)


def _by_count(counts: Counter) -> list[int]:
    """Ids most frequent first, ties broken by the lower id."""
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def save_draft_vocab(folder: str | Path, token_ids: torch.Tensor) -> Path:
    path = Path(folder) / VOCAB_FILE
    tmp = path.with_suffix(".tmp")
    save_file({"token_ids": token_ids.to(torch.long).contiguous()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    return path


def read_draft_vocab(folder: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The checkpoint's reduced vocabulary, or None when it has none (draft from all V)."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    ids = load_file(str(path))["token_ids"].to(torch.long)
    if ids.ndim != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{path}: token ids must be a non-empty 1-D list inside the vocabulary (size {vocab_size})")
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{path}: token ids must be sorted and unique")
    return ids


class DraftVocab:
    """The tokens a drafter may propose and the head rows that score them (inference only).

    `token_ids=None` keeps the whole vocabulary (column i is token i)."""

    def __init__(self, model: DSparkModel, token_ids: torch.Tensor | None = None) -> None:
        device = model.lm_head_weight.device
        self.token_ids = None if token_ids is None else token_ids.to(device=device, dtype=torch.long)
        self.vocab_size = model.cfg.vocab_size
        self.size = self.vocab_size if token_ids is None else len(self.token_ids)
        self._dtype = model.lm_head_weight.dtype
        self._head = self._make_head(model)
        w2 = model.markov_w2.detach() if model.markov else None
        self._w2 = None if w2 is None else (w2 if self.token_ids is None else w2[self.token_ids].contiguous()).float()  # [Vd, r]

    def _make_head(self, model: DSparkModel) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.token_ids is None:
            return model.head_logits
        rows = model.lm_head_weight[self.token_ids].contiguous()  # [Vd, d]
        kernels = available_kernels(rows.device, rows.dtype)
        if not kernels:
            return lambda h: lm_head_logits(h, rows)
        linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
        linear.weight = nn.Parameter(rows, requires_grad=False)
        choice = model.head_kernels or KernelChoice.only(kernels[0])  # the target's, where it is packed
        packed = PackedLinear(linear, choice)
        build_kernels([packed])
        return packed.forward

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> base logits [..., Vd] float32."""
        return self._head(h.to(self._dtype)).float()

    def markov_bias(self, feat: torch.Tensor | None) -> torch.Tensor | float:
        """W1[prev] [..., r] -> B [..., Vd] float32 (0 without a Markov head)."""
        if feat is None or self._w2 is None:
            return 0.0
        return feat.float() @ self._w2.T

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Column indices [...] -> the token ids they stand for [...]."""
        return columns if self.token_ids is None else self.token_ids[columns.to(self.token_ids.device)]


