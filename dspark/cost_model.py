"""What a verify round costs on this device: the `dspark` scheduler's price list.

`BatchCostTable` is what the engine profiles at start-up: the forward latency of R rows
carrying w tokens each (an anchor plus w - 1 draft tokens), every row on top of a realistic
cached context, measured on the actual device and cached per model, device, dtype, threads
and torch version. Rows and context matter, not just the token count R x w: 8 rows pay
attention over 8 caches, and the CPU kernels switch at a row count measured per machine, so a
table by total tokens alone (one row on a short cache) misprices both batched rounds and the
cheap small blocks of batch 1 (docs/cpu-kernels.md). Where the forward packs ragged
rows (the lean forward on CPU) the table also holds R rows of which one is w wide, so that a
round whose rows carry different numbers of draft tokens is priced by its total tokens and its
widest row (`BatchCostTable.ragged_latency`), not as if every row were the widest.

`CostTable` is the one-dimensional curve SPS(B) of the paper (latency by tokens in the
forward), kept for hand-written cost curves; it prices a round of R rows x w tokens as R x w.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dspark.cpu_matmul import packed_choice
from dspark.hardware import cpu_model
from dspark.lean_forward import LEAN_FORWARD_VERSION, lean_support
from dspark.models import TargetModel, cache_root

LOG = logging.getLogger(__name__)

# Widths (tokens per row) profiled: dense where verify rounds live (the CPU kernels change at a
# few rows), then up to the widest block a drafter's tree reaches (24 nodes + the anchor);
# wider ones extrapolate linearly from the last two. Without the wide ones a tree would be
# priced by extrapolating the flat stretch of small widths, far below its real cost.
PROFILE_WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 25)
# Cached tokens per row while profiling: about a prompt plus part of its answer.
PROFILE_CONTEXT = 512
# Timing passes per row count: at least `reps`, more while under this many seconds (one row
# on a 2-core CPU: ~10 passes), at most this many.
PROFILE_SECONDS_PER_ROW_COUNT = 4.0
PROFILE_MAX_REPS = 12


class RoundCost(Protocol):
    """Anything the `dspark` scheduler and the draft gate can price a round with."""

    def round_latency(self, rows: int, width: float) -> float:
        """Seconds of one target forward over `rows` rows of `width` tokens each."""
        ...

    def plain_latency(self, rows: int) -> float:
        """Seconds of a round without drafts (one token per row)."""
        ...


def interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through (xs, ys); flat below xs[0], linear beyond xs[-1] from the
    last two points (or proportional to x for a single point)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])
    i = bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def running_max(values: list[float] | tuple[float, ...]) -> list[float]:
    out, best = [], 0.0
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


@dataclass(frozen=True)
class CostTable:
    """Forward latency (seconds) by tokens in the forward, whatever the rows: the paper's
    SPS(B) curve. Linear in between, extrapolated linearly above the largest count."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise ValueError("cost table needs matching, non-empty tokens and seconds")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("cost table tokens must be strictly increasing")

    def latency(self, b: float) -> float:
        return interpolate(self.tokens, self.seconds, b)

    def round_latency(self, rows: int, width: float) -> float:
        return self.latency(rows * width)

    def plain_latency(self, rows: int) -> float:
        return self.latency(rows)

    @staticmethod
    def monotone(tokens: list[int], seconds: list[float]) -> "CostTable":
        """More tokens never cost less: take the running maximum of noisy measurements."""
        return CostTable(tuple(tokens), tuple(running_max(seconds)))


@dataclass(frozen=True)
class BatchCostTable:
    """Forward latency (seconds) of R rows x w tokens, measured on a grid of row counts and
    widths; linear in between along widths, then along rows, and extrapolated linearly from
    the last two points beyond the largest measured width or row count."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [len(rows)][len(widths)]
    context: int = PROFILE_CONTEXT
    # Where the forward packs ragged rows (`ModelRunner.packs_ragged_blocks`): the latency of R
    # rows of which ONE carries w tokens and the rest one each, on the same grid. None: the
    # forward pads every row to the widest (a round costs `round_latency(rows, widest)`).
    one_wide: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        if not self.rows or not self.widths:
            raise ValueError("cost table needs at least one row count and one width")
        for axis in (self.rows, self.widths):
            if list(axis) != sorted(set(axis)) or axis[0] < 1:
                raise ValueError("cost table rows and widths must be positive and strictly increasing")
        for grid in (self.seconds, self.one_wide):
            if grid is not None and (len(grid) != len(self.rows) or any(len(line) != len(self.widths) for line in grid)):
                raise ValueError("cost table seconds must be a rows x widths grid")

    def round_latency(self, rows: int, width: float) -> float:
        by_rows = tuple(interpolate(self.widths, line, width) for line in self.seconds)
        return interpolate(self.rows, by_rows, rows)

    def plain_latency(self, rows: int) -> float:
        return self.round_latency(rows, 1)

    @property
    def prices_ragged_rows(self) -> bool:
        return self.one_wide is not None

    def ragged_latency(self, lengths: list[int] | tuple[int, ...]) -> float:
        """Seconds of one forward where row r carries lengths[r] >= 1 tokens.

        Padded forwards: every row costs the widest. Packed ones (`one_wide`): projections and
        MLPs cost by the total token count, attention still by rows x the widest row; so the
        price runs linearly in the total, from one wide row among one-token rows (measured) to
        every row that wide (measured)."""
        rows, widest, total = len(lengths), max(lengths), sum(lengths)
        full = self.round_latency(rows, widest)
        if self.one_wide is None or rows == 1 or widest == 1:
            return full
        by_rows = tuple(interpolate(self.widths, line, widest) for line in self.one_wide)
        one = min(full, interpolate(self.rows, by_rows, rows))
        least, most = rows + widest - 1, rows * widest
        return one + (full - one) * (total - least) / (most - least)

    @staticmethod
    def monotone(
        rows: list[int], widths: list[int], seconds: list[list[float]], context: int = PROFILE_CONTEXT,
        one_wide: list[list[float]] | None = None,
    ) -> "BatchCostTable":
        """More rows or wider rows never cost less: running maxima along both axes (and a
        round with one wide row never costs more than one with every row that wide)."""

        def smooth(seconds: list[list[float]]) -> list[list[float]]:
            grid = [running_max(line) for line in seconds]
            for j in range(len(widths)):
                column = running_max([line[j] for line in grid])
                for i, v in enumerate(column):
                    grid[i][j] = v
            return grid

        grid = smooth(seconds)
        one = None
        if one_wide is not None:
            one = tuple(tuple(min(a, b) for a, b in zip(o, g)) for o, g in zip(smooth(one_wide), grid))
        return BatchCostTable(tuple(rows), tuple(widths), tuple(tuple(line) for line in grid), context, one)

    def describe(self) -> str:
        """One line per row count: 'R rows: w=1 35.0 ms, w=2 ...' (for logs and reports), then
        the one-wide-row latencies where the forward packs ragged rows."""
        text = "; ".join(
            f"{r} rows: " + ", ".join(f"w{w} {1000 * s:.1f}" for w, s in zip(self.widths, line)) + " ms"
            for r, line in zip(self.rows, self.seconds)
        )
        if self.one_wide is not None:
            text += "; one row wide: " + "; ".join(
                f"{r} rows: " + ", ".join(f"w{w} {1000 * s:.1f}" for w, s in zip(self.widths, line)) + " ms"
                for r, line in zip(self.rows, self.one_wide) if r > 1
            )
        return text


def profile_rows(max_rows: int) -> tuple[int, ...]:
    """Row counts to profile for batches of up to `max_rows`: powers of two up to the first
    that covers it (so batch sizes 5 to 8 share one table)."""
    rows = [1]
    while rows[-1] < max_rows:
        rows.append(2 * rows[-1])
    return tuple(rows)


def _weights_sample(target: TargetModel) -> str:
    # two models with the same name and shapes (e.g. test models saved as "model") must not
    # share a table: fold a few weights into the key
    p = next(target.model.parameters())
    return ",".join(f"{v:.6g}" for v in p.detach().flatten()[:8].float().tolist())


def _profile_key(target: TargetModel, context: int, rows: tuple[int, ...], widths: tuple[int, ...]) -> str:
    cfg = target.model.config
    blob = (
        f"{target.name}|{target.vocab_size}|{cfg.num_hidden_layers}|{cfg.hidden_size}|{_weights_sample(target)}|"
        f"{_device_name(target.device)}|{target.device}|{target.dtype}|{torch.__version__}|{context}|{torch.get_num_threads()}|"
        f"packed={packed_choice(target.model)}|{getattr(cfg, '_attn_implementation', None)}|"
        f"lean={lean_support(target.model) is None}:{LEAN_FORWARD_VERSION}|"
        f"rows={rows}|widths={widths}"
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _device_name(device: torch.device) -> str:
    # the CPU model too: a cache directory can outlive the machine it was profiled on
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {cpu_model()}"


@torch.no_grad()
def measure_batch_costs(
    target: TargetModel,
    rows: tuple[int, ...] = (1,),
    widths: tuple[int, ...] = PROFILE_WIDTHS,
    context: int = PROFILE_CONTEXT,
    reps: int = 3,
    seconds_per_row_count: float = PROFILE_SECONDS_PER_ROW_COUNT,
    max_reps: int = PROFILE_MAX_REPS,
) -> BatchCostTable:
    """Time one forward of R rows x w new tokens on top of `context` cached tokens per row,
    for every (R, w), and where the forward packs ragged rows also with only one of the R rows
    w wide (`BatchCostTable.one_wide`). Keeps the fastest of at least `reps` runs, more (up to
    `max_reps`) while a row count has taken under `seconds_per_row_count`: on a shared machine
    noise only ever adds time, and cheap shapes (one row) can afford the samples that keep
    their small differences, which decide how deep to verify, from being noise. One batched
    prefill serves every R (largest first, then rows are dropped)."""
    from dspark.runner import ModelRunner  # local: runner imports models, keep this module light

    runner = ModelRunner(target.model)
    g = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    rows = tuple(sorted(rows))
    context = max(1, min(context, target.max_context - max(widths)))
    runner.cache, _ = runner.prefill([torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(rows[-1])])
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    # shapes (w, one): every row w wide, or (where the forward packs ragged rows) one row w wide
    # and the rest 1; with one row, or w = 1, the two are the same forward
    ragged = runner.packs_ragged_blocks
    best: dict[tuple[int, int, bool], float] = {}
    for r in reversed(rows):
        runner.cache.select_rows(list(range(r)))
        shapes = [(w, False) for w in widths] + ([(w, True) for w in widths if w > 1] if ragged and r > 1 else [])
        times: dict[tuple[int, bool], list[float]] = {shape: [] for shape in shapes}
        # shapes interleaved, so that a burst of load on a shared machine inflates one sample
        # of several shapes rather than every sample of one (the scheduler reads ratios)
        started = time.perf_counter()
        for rep in range(max(reps, max_reps) + 1):  # the first pass warms up kernels for each shape
            if rep > reps and time.perf_counter() - started > seconds_per_row_count:
                break
            for w, one in shapes:
                lengths = [w] + [1 if one else w] * (r - 1)
                blocks = [(torch.randint(0, vocab, (n,), generator=g).tolist(), list(range(-1, n - 1))) for n in lengths]
                sync()
                t0 = time.perf_counter()
                runner.forward_block(blocks)
                sync()
                if rep:
                    times[(w, one)].append(time.perf_counter() - t0)
                runner.cache.commit([[]] * r)  # drop the block: the cache returns to `context` tokens
        for (w, one), ts in times.items():
            best[(r, w, one)] = min(ts)
    runner.cache.select_rows([])
    seconds = [[best[(r, w, False)] for w in widths] for r in rows]
    one_wide = [[best.get((r, w, True), best[(r, w, False)]) for w in widths] for r in rows] if ragged else None
    return BatchCostTable.monotone(list(rows), list(widths), seconds, context, one_wide)


# A cached table whose 1-token latency is this much slower than a fresh timing was measured
# on a busy machine: profile again rather than under-speculate for ever.
STALE_FACTOR = 1.5


def load_or_profile(
    target: TargetModel,
    max_rows: int = 1,
    context: int = PROFILE_CONTEXT,
    widths: tuple[int, ...] = PROFILE_WIDTHS,
    refresh: bool | None = None,
) -> BatchCostTable:
    """The cached cost table for this model/device/dtype and batches of up to `max_rows`
    rows, profiling it on first use.

    A cached table is re-measured when its one-row, one-token latency is over STALE_FACTOR
    times a fresh timing (it was profiled on a busy machine); DSPARK_REPROFILE=1 forces it."""
    if refresh is None:
        refresh = os.environ.get("DSPARK_REPROFILE", "") not in ("", "0")
    rows = profile_rows(max_rows)
    path = Path(cache_root()) / "cost_tables" / f"{_profile_key(target, context, rows, widths)}.json"
    if path.is_file() and not refresh:
        data = json.loads(path.read_text())
        one_wide = data.get("one_wide")
        cached = BatchCostTable(
            tuple(data["rows"]), tuple(data["widths"]), tuple(tuple(line) for line in data["seconds"]), data["context"],
            None if one_wide is None else tuple(tuple(line) for line in one_wide),
        )
        now = measure_batch_costs(target, rows=(1,), widths=(1,), context=context)
        if cached.plain_latency(1) <= STALE_FACTOR * now.plain_latency(1):
            LOG.info("Cost table from %s", path)
            return cached
        LOG.info("Cost table %s is stale (1 token: %.1f ms cached, %.1f ms now): profiling again",
                 path, 1000 * cached.plain_latency(1), 1000 * now.plain_latency(1))
    else:
        LOG.info("Profiling the cost table for up to %d rows (%s; first use for this model, device, dtype and thread count)",
                 rows[-1], "forced" if refresh else path)
    t0 = time.perf_counter()
    table = measure_batch_costs(target, rows=rows, widths=widths, context=context)
    LOG.info("Cost table profiled in %.1f s: %s", time.perf_counter() - t0, table.describe())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "model": target.name,
                "device": _device_name(target.device),
                "dtype": str(target.dtype),
                "context": table.context,
                "rows": list(table.rows),
                "widths": list(table.widths),
                "seconds": [list(line) for line in table.seconds],
                "one_wide": None if table.one_wide is None else [list(line) for line in table.one_wide],
            },
            indent=1,
        )
    )
    return table
