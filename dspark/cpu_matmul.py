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
but pays ~20% more at the bottom. On another 2-core AMD EPYC (session 22) oneDNN won at every
row count, 1 row included:

    rows                      1     2     3     4     8    16
    MKL, 2 threads         30.7  46.4  57.3  47.8  44.0  52.7
    oneDNN packed, 2 thr.  21.5  23.9  24.5  27.6  30.3  42.3

So `PackedLinear` keeps both: the plain weight for calls of up to `mkl_max_rows` rows and a
packed copy for the rest, where `mkl_max_rows` (0 to 3) is measured once per machine on the
model's own layers (`measure_mkl_max_rows`) and cached. The cost is a second copy of each
packed weight in memory.

Only the kernel changes, not the arithmetic asked for: results agree with `F.linear` to
float rounding, the same way MKL's own results depend on the row count.

oneDNN builds (and caches) a kernel per weight shape and row count, about 0.5 MB and 1 ms
each. Row counts are therefore padded up to 17 buckets, calls with more rows than a verify
round needs (long prefills) stay on MKL, and packing builds every bucket's kernel up front:
a long-running job's memory stays flat instead of growing with each new row count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from dspark.hardware import cpu_model

LOG = logging.getLogger(__name__)

# oneDNN picks its blocking for this many rows; 8-16 is the width of a typical verify round.
PACK_ROWS_HINT = 16
# MKL's kernels can beat the packed ones only up to this many rows (tables above); how many it
# does beat them for is measured per machine.
MKL_CANDIDATE_ROWS = 3
# Above this many rows (prefill) MKL is as fast, and every new row count would cost a kernel.
PACKED_MAX_ROWS = 128


def padded_rows(rows: int) -> int:
    """The bucket a call's row count is padded to: exact up to 8 (each row costs ~1.5 ms there
    for SmolLM2-135M, so padding 5 rows to 8 would waste ~5 ms a round), then multiples of 4
    up to 32, then of 16: at most 20 buckets from mkl_max_rows + 1 to PACKED_MAX_ROWS."""
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

    def __init__(self, linear: nn.Linear, rows_hint: int = PACK_ROWS_HINT, mkl_max_rows: int = MKL_CANDIDATE_ROWS) -> None:
        super().__init__()
        self.mkl_max_rows = mkl_max_rows  # calls of up to this many rows use the plain weight (MKL)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # a plain attribute, not a buffer: module.to()/state_dict must not touch the mkldnn tensor
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not self.mkl_max_rows < rows <= PACKED_MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
            return nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features)
        pad = padded_rows(rows) - rows
        if pad:
            x2 = torch.cat([x2, x2.new_zeros(pad, self.in_features)])
        return self.onednn(x2)[:rows].reshape(*x.shape[:-1], self.out_features)

    def onednn(self, x2: torch.Tensor) -> torch.Tensor:
        """[rows, in] -> [rows, out] on the packed weight, whatever the row count."""
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x2, self._packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def pack_linear_layers(
    model: nn.Module, rows_hint: int = PACK_ROWS_HINT, mkl_max_rows: int | None = None, cache_dir: Path | None = None
) -> int:
    """Swap every `nn.Linear` in `model` for a `PackedLinear`, in place; returns how many.

    Call on a loaded inference model whose weights will not change. A no-op when oneDNN
    packing is unavailable for the model's device and dtype. mkl_max_rows: None measures it on
    the model's layers (`measure_mkl_max_rows`; cached under `cache_dir` when given).
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
    if mkl_max_rows is None:
        mkl_max_rows = cached_mkl_max_rows(packed, cache_dir)
    for layer in packed:
        layer.mkl_max_rows = mkl_max_rows
    build_kernels(packed)
    extra = sum(child.weight.numel() for _, _, child in swaps) * p.element_size()
    LOG.info("Packed %d linear layers for oneDNN (%.0f MB extra memory)", len(swaps), extra / 2**20)
    return len(swaps)


def row_buckets(mkl_max_rows: int = 0) -> list[int]:
    """Every padded row count a packed call can use."""
    return sorted({padded_rows(r) for r in range(mkl_max_rows + 1, PACKED_MAX_ROWS + 1)})


@torch.no_grad()
def build_kernels(layers: list[PackedLinear]) -> None:
    """Run each distinct layer shape once per row bucket, so oneDNN's kernel cache is full
    before the first request (its kernels depend on shapes, not on the weights)."""
    shapes = {}
    for layer in layers:
        shapes.setdefault((layer.in_features, layer.out_features, layer.bias is not None), layer)
    for layer in shapes.values():
        for rows in row_buckets(layer.mkl_max_rows):
            layer(torch.zeros(rows, layer.in_features, dtype=layer.weight.dtype))


@torch.no_grad()
def fuse_linears(parts: list[nn.Module], check: bool = True) -> PackedLinear | None:
    """One packed linear whose output is the parts' outputs side by side, [..., sum(out)].

    A decoder layer's q/k/v projections read the same input, as do its MLP's gate and up
    projections: as one matmul each they cost one call instead of three or two. On the 2-core
    EPYC, 30 SmolLM2 layers' q/k/v/gate/up took 17.5 -> 12.0 ms for one row and 23.2 -> 17.8 ms
    for 8 (the packed calls have a fixed cost each). Each output column is still the same dot
    product over the same input, and the kernels split the work by output blocks, not along
    the reduction, so the results are the parts' to the bit there; `check` asserts that for
    every row count a packed call can use (1 to PACKED_MAX_ROWS) and returns None on any
    difference. None too when the parts are not packed alike (they must be `PackedLinear`s over
    one input size, all with a bias or none). The fused weight is a copy: the parts stay as
    they are for the other paths (transformers' forward, long prefills)."""
    if not parts or not all(type(p) is PackedLinear for p in parts):
        return None
    if len({(p.in_features, p.mkl_max_rows, p.bias is None, p.weight.dtype) for p in parts}) != 1:
        return None
    first = parts[0]
    linear = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None, dtype=first.weight.dtype)
    linear.weight.copy_(torch.cat([p.weight for p in parts]))
    if first.bias is not None:
        linear.bias.copy_(torch.cat([p.bias for p in parts]))
    linear.requires_grad_(False)
    fused = PackedLinear(linear, mkl_max_rows=first.mkl_max_rows)
    build_kernels([fused])
    if check:
        gen = torch.Generator().manual_seed(0)
        for rows in sorted(set(range(1, first.mkl_max_rows + 1)) | set(row_buckets(first.mkl_max_rows))):
            x = torch.randn(rows, first.in_features, generator=gen, dtype=first.weight.dtype)
            if not torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1)):
                LOG.info("Not fusing %d linear layers: %d rows round differently fused", len(parts), rows)
                return None
    return fused


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


def packed_mkl_max_rows(model: nn.Module) -> int | None:
    """The MKL/oneDNN crossover a packed model runs with (None: not packed)."""
    return next((m.mkl_max_rows for m in model.modules() if isinstance(m, PackedLinear)), None)


def leading_mkl_wins(mkl_s: list[float], packed_s: list[float]) -> int:
    """How many row counts, from 1 up, MKL is at least as fast for without a loss in between:
    the largest r with mkl_s[i] <= packed_s[i] for every i < r."""
    wins = 0
    for mkl, packed in zip(mkl_s, packed_s):
        if mkl > packed:
            break
        wins += 1
    return wins


@torch.no_grad()
def measure_mkl_max_rows(layers: list[PackedLinear], reps: int = 3) -> int:
    """Time one pass over every layer (the weights streamed from memory, as in a forward) with
    each kernel for 1..MKL_CANDIDATE_ROWS rows, interleaved, fastest of `reps`; returns
    `leading_mkl_wins` of those times."""
    counts = range(1, MKL_CANDIDATE_ROWS + 1)
    inputs = {r: {layer.in_features: torch.zeros(r, layer.in_features) for layer in layers} for r in counts}
    best = {(r, kernel): float("inf") for r in counts for kernel in ("mkl", "packed")}
    for _ in range(reps):
        for r in counts:
            for kernel in ("mkl", "packed"):
                t0 = time.perf_counter()
                for layer in layers:
                    x = inputs[r][layer.in_features]
                    if kernel == "mkl":
                        nn.functional.linear(x, layer.weight, layer.bias)
                    else:
                        layer.onednn(x)
                best[r, kernel] = min(best[r, kernel], time.perf_counter() - t0)
    mkl_max_rows = leading_mkl_wins([best[r, "mkl"] for r in counts], [best[r, "packed"] for r in counts])
    LOG.info("MKL vs oneDNN, ms per pass by rows: %s -> MKL up to %d rows",
             {r: (round(1e3 * best[r, "mkl"], 1), round(1e3 * best[r, "packed"], 1)) for r in counts}, mkl_max_rows)
    return mkl_max_rows


def cached_mkl_max_rows(layers: list[PackedLinear], cache_dir: Path | None) -> int:
    """`measure_mkl_max_rows`, once per CPU, thread count, torch version and layer shapes: the
    kernel choice shifts float rounding, so a machine keeps the one it measured first."""
    if cache_dir is None:
        return measure_mkl_max_rows(layers)
    shapes = sorted({(layer.in_features, layer.out_features, layer.bias is not None) for layer in layers})
    blob = f"{cpu_model()}|{torch.get_num_threads()}|{torch.__version__}|{len(layers)}|{shapes}"
    path = Path(cache_dir) / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    try:
        return int(json.loads(path.read_text())["mkl_max_rows"])
    except (OSError, ValueError, KeyError):
        pass
    value = measure_mkl_max_rows(layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"mkl_max_rows": value, "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__}))
    os.replace(tmp, path)
    return value
