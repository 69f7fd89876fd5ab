"""Prepacked weights for the multi-token forwards that speculative decoding runs on CPU.

Verifying a draft multiplies every weight matrix by a few rows at once (one per draft token,
times the batch). PyTorch sends `linear` to MKL's sgemm, which on some CPUs slows down sharply
above a handful of rows, so that verifying four draft tokens costs far more than decoding one.
Two packed kernels stay nearly flat in the row count: oneDNN's inner product on the weight
reordered once into its blocked layout, and MKL's own packed GEMM (the weight packed once by
`sgemm_pack`, each call a `sgemm_compute`). Which of the three wins at which row count differs
from CPU to CPU (design note: docs/cpu-kernels.md).

So `PackedLinear` runs a call of r rows on one of three kernels (`KernelChoice`): plain MKL
on the weight itself up to `mkl_max_rows` (0 to 3), MKL's packed GEMM up to
`mkl_packed_max_rows`, oneDNN above. Each packed kernel keeps its own copy of the weight, built
by the first call that needs it, so a job holds only the copies its calls use (the separate
q/k/v/gate/up layers, which the lean forward replaces by fused ones, never build theirs there).
The two crossovers are measured once per machine on the model's own layers
(`measure_kernel_choice`) and cached.

Only the kernel changes, not the arithmetic asked for: results agree with `F.linear` to
float rounding, the same way MKL's own results depend on the row count.

oneDNN builds (and caches) a kernel per weight shape and row count, about 0.5 MB and 1 ms
each. Row counts are therefore padded up to 20 buckets (for both kernels, so that each
bucket's results can be checked once), calls with more rows than a verify round needs (long
prefills) stay on plain MKL, and packing builds every bucket's oneDNN kernel up front: a
long-running job's memory stays flat instead of growing with each new row count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from dspark.hardware import cpu_model

LOG = logging.getLogger(__name__)

# The packed kernels a multi-row call can take: oneDNN's inner product on the weight reordered
# into its blocked layout, or MKL's sgemm_compute on the weight packed once by sgemm_pack.
ONEDNN = "onednn"
MKL_PACKED = "mkl-packed"
KERNELS = (ONEDNN, MKL_PACKED)
# oneDNN picks its blocking for this many rows; 8-16 is the width of a typical verify round.
PACK_ROWS_HINT = 16
# Plain MKL can beat the packed kernels only up to this many rows; how many it does beat them
# for is measured per machine.
MKL_CANDIDATE_ROWS = 3
# Above this many rows (prefill) MKL is as fast, and every new row count would cost a kernel.
PACKED_MAX_ROWS = 128
# Row counts timed to choose between the packed kernels (verify rounds from batch 1 to ~16 rows
# of 4 tokens); where MKL's packed GEMM hands over to oneDNN is measured per machine.
KERNEL_PROBE_ROWS = (4, 6, 8, 12, 16, 24, 32, 48, 64)
# Layers timed to choose kernels: enough weight bytes to stream from memory, as a forward does
# (a sample that fits the CPU's caches would time arithmetic), few enough to pack twice.
KERNEL_SAMPLE_BYTES = 256 * 2**20


def padded_rows(rows: int) -> int:
    """The bucket a packed call's row count is padded to: exact up to 8 (small verify rounds,
    where each padded row would be a real share of the round's cost), then multiples of
    4 up to 32, then of 16: at most 20 buckets from mkl_max_rows + 1 to PACKED_MAX_ROWS. oneDNN
    builds a kernel per bucket; both kernels' results are checked per bucket (`fuse_linears`)."""
    if rows <= 8:
        return rows
    step = 4 if rows <= 32 else 16
    return -(-rows // step) * step


def available_kernels(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The packed kernels this build offers for `device`/`dtype` (CPU float32 only)."""
    if device.type != "cpu" or dtype != torch.float32:
        return ()
    offered = {
        ONEDNN: torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"),
        MKL_PACKED: torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"),
    }
    return tuple(k for k in KERNELS if offered[k])


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build can pack weights for `device`/`dtype` (CPU float32 with oneDNN or MKL)."""
    return bool(available_kernels(device, dtype))


def pack_weight(weight: torch.Tensor, kernel: str, rows_hint: int = PACK_ROWS_HINT) -> torch.Tensor:
    """[out, in] -> the weight in `kernel`'s packed layout (an opaque tensor only that kernel reads)."""
    if kernel == ONEDNN:
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
    if kernel == MKL_PACKED:
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows_hint)
    raise ValueError(f"unknown packed kernel {kernel!r} (one of {KERNELS})")


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel a call of a given row count runs: plain MKL up to `mkl_max_rows` rows, MKL's
    packed GEMM up to `mkl_packed_max_rows`, oneDNN above (up to PACKED_MAX_ROWS; longer calls
    are prefills, on plain MKL)."""

    mkl_max_rows: int = MKL_CANDIDATE_ROWS
    mkl_packed_max_rows: int = MKL_CANDIDATE_ROWS  # <= mkl_max_rows: MKL's packed GEMM is never used

    @staticmethod
    def only(kernel: str, mkl_max_rows: int = MKL_CANDIDATE_ROWS) -> "KernelChoice":
        """Every call of more than `mkl_max_rows` rows (up to PACKED_MAX_ROWS) on `kernel`."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown packed kernel {kernel!r} (one of {KERNELS})")
        return KernelChoice(mkl_max_rows, PACKED_MAX_ROWS if kernel == MKL_PACKED else mkl_max_rows)

    def kernel_for(self, rows: int) -> str | None:
        """The packed kernel for a call of `rows` rows; None: plain MKL."""
        if rows <= self.mkl_max_rows or rows > PACKED_MAX_ROWS:
            return None
        return MKL_PACKED if rows <= self.mkl_packed_max_rows else ONEDNN

    @property
    def kernels(self) -> tuple[str, ...]:
        """The packed kernels some call uses (each needs its own copy of the weight)."""
        return tuple(k for k in KERNELS if any(self.kernel_for(r) == k for r in row_buckets(self.mkl_max_rows)))

    def __str__(self) -> str:
        parts = [f"plain MKL up to {self.mkl_max_rows} rows"]
        if MKL_PACKED in self.kernels:
            parts.append(f"MKL packed up to {min(self.mkl_packed_max_rows, PACKED_MAX_ROWS)}")
        if ONEDNN in self.kernels:
            parts.append(f"oneDNN up to {PACKED_MAX_ROWS}")
        return ", ".join(parts)


class PackedLinear(nn.Module):
    """`nn.Linear` whose multi-row calls run on packed copies of the weight (`KernelChoice`).

    The original parameters stay attached (tied embeddings, `state_dict` and
    `get_output_embeddings()` see the same tensors). The packed copies are frozen once built:
    pack inference-only modules, never ones being trained.
    """

    def __init__(self, linear: nn.Linear, choice: KernelChoice = KernelChoice(), rows_hint: int = PACK_ROWS_HINT) -> None:
        super().__init__()
        self.choice = choice
        self.rows_hint = rows_hint
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # kernel -> packed copy, built by the kernel's first call (`packed_weight`); a plain
        # attribute, not a buffer: module.to()/state_dict must not touch the packed tensors
        self._packed: dict[str, torch.Tensor] = {}

    def packed_weight(self, kernel: str) -> torch.Tensor:
        """`kernel`'s copy of the weight, packed on first use: a layer no call of a kernel's
        rows reaches never holds that kernel's copy."""
        packed = self._packed.get(kernel)
        if packed is None:
            packed = self._packed[kernel] = pack_weight(self.weight.detach(), kernel, self.rows_hint)
        return packed

    @property
    def packed_kernels(self) -> tuple[str, ...]:
        """The kernels whose packed copy this layer holds now."""
        return tuple(k for k in KERNELS if k in self._packed)

    def release(self) -> None:
        """Drop the packed copies; the next call that needs one packs it again."""
        self._packed.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        kernel = self.choice.kernel_for(rows)
        if kernel is None or x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
            return nn.functional.linear(x, self.weight, self.bias)
        return self.packed(x.reshape(rows, self.in_features), kernel).reshape(*x.shape[:-1], self.out_features)

    def packed(self, x2: torch.Tensor, kernel: str) -> torch.Tensor:
        """[rows, in] -> [rows, out] on `kernel`'s packed weight, whatever the row count."""
        bias = None if self.bias is None else self.bias.detach()
        rows = x2.shape[0]
        pad = padded_rows(rows) - rows
        if pad:
            x2 = torch.cat([x2, x2.new_zeros(pad, self.in_features)])
        if kernel == MKL_PACKED:  # its last argument, the rows, says the packed path applies
            out = torch.ops.mkl._mkl_linear(x2.contiguous(), self.packed_weight(kernel), self.weight.detach(), bias, x2.shape[0])
        else:
            out = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight(kernel), bias, "none", [], "")
        return out[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.choice}"


def pack_linear_layers(
    model: nn.Module,
    choice: KernelChoice | None = None,
    cache_dir: Path | None = None,
    rows_hint: int = PACK_ROWS_HINT,
) -> int:
    """Swap every `nn.Linear` in `model` for a `PackedLinear`, in place; returns how many.

    Call on a loaded inference model whose weights will not change. A no-op when no packed
    kernel is available for the model's device and dtype. choice: None measures it on the
    model's layers (`measure_kernel_choice`; cached under `cache_dir` when given).
    """
    p = next(model.parameters())
    kernels = available_kernels(p.device, p.dtype)
    if not kernels:
        return 0
    if choice is not None and set(choice.kernels) - set(kernels):
        raise ValueError(f"{choice} needs a packed kernel this build lacks (available: {kernels})")
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    if not swaps:
        return 0
    if choice is None:
        choice = cached_kernel_choice([child for _, _, child in swaps], kernels, cache_dir)
    packed = [PackedLinear(child, choice, rows_hint) for _, _, child in swaps]
    for (parent, name, _), layer in zip(swaps, packed):
        setattr(parent, name, layer)
    build_kernels(packed)
    extra = sum(child.weight.numel() for _, _, child in swaps) * p.element_size()
    LOG.info("Packed %d linear layers (%s; each kernel's copies, %.0f MB, built by its first call)", len(swaps), choice, extra / 2**20)
    return len(swaps)


def row_buckets(mkl_max_rows: int = 0) -> list[int]:
    """Every padded row count a packed call can use."""
    return sorted({padded_rows(r) for r in range(mkl_max_rows + 1, PACKED_MAX_ROWS + 1)})


@torch.no_grad()
def build_kernels(layers: list[PackedLinear]) -> None:
    """Run each distinct layer shape once per oneDNN row bucket, so oneDNN's kernel cache is
    full before the first request (its kernels depend on shapes, not on the weights), then drop
    the packed copies that took: layers still pack on first use."""
    shapes = {}
    for layer in layers:
        if ONEDNN in layer.choice.kernels:
            shapes.setdefault((layer.in_features, layer.out_features, layer.bias is not None, layer.choice), layer)
    for layer in shapes.values():
        for rows in row_buckets(layer.choice.mkl_max_rows):
            if layer.choice.kernel_for(rows) == ONEDNN:
                layer(torch.zeros(rows, layer.in_features, dtype=layer.weight.dtype))
        layer.release()


@torch.no_grad()
def fuse_linears(parts: list[nn.Module], check: bool = True) -> PackedLinear | None:
    """One packed linear whose output is the parts' outputs side by side, [..., sum(out)].

    A decoder layer's q/k/v projections read the same input, as do its MLP's gate and up
    projections: as one matmul each they cost one call instead of three or two, and each packed
    call has a fixed cost. Each output column is still the same dot product over the same
    input, and the kernels split the work by output blocks, not along the reduction, so the
    results are the parts' to the bit; `check` asserts that for
    every row count a packed call can use (1 to PACKED_MAX_ROWS) and returns None on any
    difference. None too when the parts are not packed alike (they must be `PackedLinear`s over
    one input size with one kernel choice, all with a bias or none). The fused weight is a
    copy: the parts stay as they are for the other paths (transformers' forward, long
    prefills)."""
    if not parts or not all(type(p) is PackedLinear for p in parts):
        return None
    if len({(p.in_features, p.choice, p.bias is None, p.weight.dtype) for p in parts}) != 1:
        return None
    first = parts[0]
    linear = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None, dtype=first.weight.dtype)
    linear.weight.copy_(torch.cat([p.weight for p in parts]))
    if first.bias is not None:
        linear.bias.copy_(torch.cat([p.bias for p in parts]))
    linear.requires_grad_(False)
    fused = PackedLinear(linear, first.choice)
    build_kernels([fused])
    if check:
        gen = torch.Generator().manual_seed(0)
        for rows in sorted(set(range(1, first.choice.mkl_max_rows + 1)) | set(row_buckets(first.choice.mkl_max_rows))):
            x = torch.randn(rows, first.in_features, generator=gen, dtype=first.weight.dtype)
            if not torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1)):
                LOG.info("Not fusing %d linear layers: %d rows round differently fused", len(parts), rows)
                return None
        for layer in (fused, *parts):  # the check packed every kernel: keep only what calls need
            layer.release()
    return fused


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


def packed_choice(model: nn.Module) -> KernelChoice | None:
    """The kernels a packed model runs with (None: not packed)."""
    return next((m.choice for m in model.modules() if isinstance(m, PackedLinear)), None)


def leading_wins(first_s: list[float], second_s: list[float]) -> int:
    """How many entries, from the start, `first_s` is at least as fast for without a loss in
    between: the largest r with first_s[i] <= second_s[i] for every i < r."""
    wins = 0
    for a, b in zip(first_s, second_s):
        if a > b:
            break
        wins += 1
    return wins


def timing_sample(linears: list[nn.Linear], max_bytes: int = KERNEL_SAMPLE_BYTES) -> list[nn.Linear]:
    """The first layers up to `max_bytes` of weights (at least one)."""
    sample, total = [], 0
    for layer in linears:
        if sample and total + layer.weight.numel() * layer.weight.element_size() > max_bytes:
            break
        sample.append(layer)
        total += layer.weight.numel() * layer.weight.element_size()
    return sample


def choose_kernels(seconds: dict[tuple[str, int], float], kernels: tuple[str, ...]) -> KernelChoice:
    """The `KernelChoice` from pass times by (kernel, rows): "mkl" (plain) for 1..MKL_CANDIDATE_ROWS,
    each available packed kernel for those and KERNEL_PROBE_ROWS. Plain MKL keeps the row counts
    it wins from 1 up against the best packed kernel; MKL's packed GEMM then keeps the probes
    it wins from there up against oneDNN (all of them: every row count up to PACKED_MAX_ROWS)."""
    small = range(1, MKL_CANDIDATE_ROWS + 1)
    best_packed = [min(seconds[k, r] for k in kernels) for r in small]
    mkl_max_rows = leading_wins([seconds["mkl", r] for r in small], best_packed)
    if MKL_PACKED not in kernels:
        return KernelChoice(mkl_max_rows, mkl_max_rows)
    if ONEDNN not in kernels:
        return KernelChoice(mkl_max_rows, PACKED_MAX_ROWS)
    probes = [r for r in (*small, *KERNEL_PROBE_ROWS) if r > mkl_max_rows]
    wins = leading_wins([seconds[MKL_PACKED, r] for r in probes], [seconds[ONEDNN, r] for r in probes])
    if wins == len(probes):
        return KernelChoice(mkl_max_rows, PACKED_MAX_ROWS)
    return KernelChoice(mkl_max_rows, probes[wins - 1] if wins else mkl_max_rows)


@torch.no_grad()
def measure_kernel_choice(linears: list[nn.Linear], kernels: tuple[str, ...] = KERNELS, reps: int = 3) -> KernelChoice:
    """Time one pass over a sample of `linears` (`timing_sample`: weights streamed from memory,
    as in a forward) with plain MKL for 1..MKL_CANDIDATE_ROWS rows and with each packed kernel
    for those and KERNEL_PROBE_ROWS rows, interleaved, fastest of `reps`; `choose_kernels`."""
    LOG.info("Timing the linear kernels on this CPU (once per machine, then cached)")
    sample = timing_sample(linears)
    packed = {k: [PackedLinear(layer, KernelChoice.only(k, 0)) for layer in sample] for k in kernels}
    small = tuple(range(1, MKL_CANDIDATE_ROWS + 1))
    runs = [("mkl", r) for r in small] + [(k, r) for r in (*small, *KERNEL_PROBE_ROWS) for k in kernels]
    inputs = {r: {layer.in_features: torch.zeros(r, layer.in_features) for layer in sample} for r in (*small, *KERNEL_PROBE_ROWS)}
    best = {run: float("inf") for run in runs}
    for _ in range(reps + 1):  # the first pass builds oneDNN's kernels
        for k, r in runs:
            t0 = time.perf_counter()
            if k == "mkl":
                for layer in sample:
                    nn.functional.linear(inputs[r][layer.in_features], layer.weight, layer.bias)
            else:
                for layer in packed[k]:
                    layer.packed(inputs[r][layer.in_features], k)
            best[k, r] = min(best[k, r], time.perf_counter() - t0)
    choice = choose_kernels(best, kernels)
    LOG.info("Linear kernels, ms per pass over %d layers by rows: %s -> %s", len(sample),
             {r: {k: round(1e3 * t, 1) for (k, rr), t in best.items() if rr == r} for r in (*small, *KERNEL_PROBE_ROWS)}, choice)
    return choice


def cached_kernel_choice(linears: list[nn.Linear], kernels: tuple[str, ...], cache_dir: Path | None) -> KernelChoice:
    """`measure_kernel_choice`, once per CPU, thread count, torch version, layer shapes and
    available kernels: the kernel choice shifts float rounding, so a machine keeps the one it
    measured first."""
    if cache_dir is None:
        return measure_kernel_choice(linears, kernels)
    shapes = sorted({(layer.in_features, layer.out_features, layer.bias is not None) for layer in linears})
    blob = f"{cpu_model()}|{torch.get_num_threads()}|{torch.__version__}|{len(linears)}|{shapes}|{kernels}"
    path = Path(cache_dir) / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    try:
        data = json.loads(path.read_text())
        return KernelChoice(int(data["mkl_max_rows"]), int(data["mkl_packed_max_rows"]))
    except (OSError, ValueError, KeyError):
        pass
    choice = measure_kernel_choice(linears, kernels)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    record = {**asdict(choice), "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__, "kernels": kernels}
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return choice
