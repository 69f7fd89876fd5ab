"""Prepacked oneDNN weights for the multi-token forwards that speculative decoding runs on CPU.

Verifying a draft multiplies every weight matrix by a few rows at once (one per draft token,
times the batch). PyTorch sends `linear` to MKL's sgemm, which on some CPUs is slow for more
than a handful of rows. On the 2-core AMD EPYC (AVX2) we develop on, the matmuls of a
SmolLM2-135M forward (30 layers and the LM head, weights streamed from memory) took, in ms:

    rows                      1     2     3     4     8    16
    MKL, 2 threads         20.8  21.6  23.3  34.6  42.5  49.3
    oneDNN packed, 2 thr.  25.6  27.1  27.7  26.8  32.6  41.3
    MKL, 1 thread          39.7  39.8  43.5  66.3  91.7  96.6
    oneDNN packed, 1 thr.  47.1  49.2  47.5  47.2  55.3  69.4

MKL's small-row kernels stay at the cost of reading the weights up to 3 rows, then fall off a
cliff; oneDNN with the weights reordered once into its blocked layout is flat from 1 to 8 rows
but pays ~20% more at the bottom. `PackedLinear` keeps both: the plain weight for calls of
up to `MKL_MAX_ROWS` rows (autoregressive decoding, and verify rounds of one or two draft
tokens at batch size 1, keep MKL's speed) and a packed copy for the rest. The cost is a
second copy of each packed weight in memory.

Only the kernel changes, not the arithmetic asked for: results agree with `F.linear` to
float rounding, the same way MKL's own results depend on the row count.

oneDNN builds (and caches) a kernel per weight shape and row count, about 0.5 MB and 1 ms
each. Row counts are therefore padded up to 17 buckets, calls with more rows than a verify
round needs (long prefills) stay on MKL, and packing builds every bucket's kernel up front:
a long-running job's memory stays flat instead of growing with each new row count.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

LOG = logging.getLogger(__name__)

# oneDNN picks its blocking for this many rows; 8-16 is the width of a typical verify round.
PACK_ROWS_HINT = 16
# Up to this many rows MKL's kernels beat the packed ones (table above; both thread counts).
MKL_MAX_ROWS = 3
# Above this many rows (prefill) MKL is as fast, and every new row count would cost a kernel.
PACKED_MAX_ROWS = 128


def padded_rows(rows: int) -> int:
    """The bucket a call's row count is padded to: exact up to 8 (each row costs ~1.5 ms there
    for SmolLM2-135M, so padding 5 rows to 8 would waste ~5 ms a round), then multiples of 4
    up to 32, then of 16: 17 buckets from MKL_MAX_ROWS + 1 to PACKED_MAX_ROWS."""
    if rows <= 8:
        return rows
    step = 4 if rows <= 32 else 16
    return -(-rows // step) * step


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build can pack weights for `device`/`dtype` (CPU float32 with oneDNN)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """`nn.Linear` whose multi-row calls run on a oneDNN-packed copy of the weight.

    The original parameters stay attached (tied embeddings, `state_dict` and
    `get_output_embeddings()` see the same tensors). The packed copy is frozen: pack
    inference-only modules, never ones being trained.
    """

    def __init__(self, linear: nn.Linear, rows_hint: int = PACK_ROWS_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # a plain attribute, not a buffer: module.to()/state_dict must not touch the mkldnn tensor
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not MKL_MAX_ROWS < rows <= PACKED_MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
            return nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features)
        pad = padded_rows(rows) - rows
        if pad:
            x2 = torch.cat([x2, x2.new_zeros(pad, self.in_features)])
        bias = None if self.bias is None else self.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(x2, self._packed, bias, "none", [], "")  # [padded rows, out]
        return y[:rows].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linear_layers(model: nn.Module, rows_hint: int = PACK_ROWS_HINT) -> int:
    """Swap every `nn.Linear` in `model` for a `PackedLinear`, in place; returns how many.

    Call on a loaded inference model whose weights will not change. A no-op when oneDNN
    packing is unavailable for the model's device and dtype.
    """
    p = next(model.parameters())
    if not packing_available(p.device, p.dtype):
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    packed = [PackedLinear(child, rows_hint) for _, _, child in swaps]
    for (parent, name, _), layer in zip(swaps, packed):
        setattr(parent, name, layer)
    build_kernels(packed)
    extra = sum(child.weight.numel() for _, _, child in swaps) * p.element_size()
    LOG.info("Packed %d linear layers for oneDNN (%.0f MB extra memory)", len(swaps), extra / 2**20)
    return len(swaps)


def row_buckets() -> list[int]:
    """Every padded row count a packed call can use."""
    return sorted({padded_rows(r) for r in range(MKL_MAX_ROWS + 1, PACKED_MAX_ROWS + 1)})


@torch.no_grad()
def build_kernels(layers: list[PackedLinear]) -> None:
    """Run each distinct layer shape once per row bucket, so oneDNN's kernel cache is full
    before the first request (its kernels depend on shapes, not on the weights)."""
    shapes = {}
    for layer in layers:
        shapes.setdefault((layer.in_features, layer.out_features, layer.bias is not None), layer)
    for layer in shapes.values():
        for rows in row_buckets():
            layer(torch.zeros(rows, layer.in_features, dtype=layer.weight.dtype))


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())
