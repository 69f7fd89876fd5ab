"""SPS(B): the target's forward steps per second with B tokens in the batch.

Profiled once on the actual device at start-up (a warm KV cache, growing token counts) and
cached per model, device, dtype and torch version, so the `dspark` scheduler prices a
verification token by what it really costs on this hardware.
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

import torch

from dspark.cpu_matmul import MKL_MAX_ROWS, is_packed
from dspark.models import TargetModel, cache_root

LOG = logging.getLogger(__name__)

# Enough points to see where the forward stops being memory-bound; larger B extrapolates
# linearly. Profiling must stay cheap on a CPU (a few seconds for a 135M model).
PROFILE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class CostTable:
    """Forward latency (seconds) measured at token counts; linear in between, extrapolated
    linearly from the last two points above the largest measured count."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise ValueError("cost table needs matching, non-empty tokens and seconds")
        if list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("cost table tokens must be strictly increasing")

    def latency(self, b: int) -> float:
        xs, ys = self.tokens, self.seconds
        if b <= xs[0]:
            return ys[0]
        if b >= xs[-1]:
            if len(xs) == 1:
                return ys[0] * b / xs[0]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (b - xs[-1])
        i = bisect_left(xs, b)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)

    def sps(self, b: int) -> float:
        return 1.0 / self.latency(b)

    @staticmethod
    def monotone(tokens: list[int], seconds: list[float]) -> "CostTable":
        """More tokens never cost less: take the running maximum of noisy measurements."""
        out, best = [], 0.0
        for s in seconds:
            best = max(best, s)
            out.append(best)
        return CostTable(tuple(tokens), tuple(out))


def _weights_sample(target: TargetModel) -> str:
    # two models with the same name and shapes (e.g. test models saved as "model") must not
    # share a table: fold a few weights into the key
    p = next(target.model.parameters())
    return ",".join(f"{v:.6g}" for v in p.detach().flatten()[:8].float().tolist())


def _profile_key(target: TargetModel, context: int) -> str:
    cfg = target.model.config
    blob = (
        f"{target.name}|{target.vocab_size}|{cfg.num_hidden_layers}|{cfg.hidden_size}|{_weights_sample(target)}|"
        f"{target.device}|{target.dtype}|{torch.__version__}|{context}|{torch.get_num_threads()}|"
        f"packed={is_packed(target.model)}:{MKL_MAX_ROWS}|{getattr(cfg, '_attn_implementation', None)}"
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@torch.no_grad()
def measure_cost_table(
    target: TargetModel, context: int = 128, token_counts: tuple[int, ...] = PROFILE_TOKENS, reps: int = 5
) -> CostTable:
    """Time one forward of B new tokens on top of a `context`-token cache, for each B.
    Keeps the fastest of `reps` runs: on a shared machine noise only ever adds time."""
    from dspark.runner import ModelRunner  # local: runner imports models, keep this module light

    runner = ModelRunner(target.model)
    g = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
    base, _ = runner.prefill([prompt])
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    seconds = []
    for b in token_counts:
        times = []
        for _ in range(reps + 1):  # first run warms up kernels for this shape
            runner.cache = base
            block = torch.randint(0, vocab, (b,), generator=g).tolist()
            sync()
            t0 = time.perf_counter()
            runner.forward_block([(block, list(range(-1, b - 1)))])
            sync()
            times.append(time.perf_counter() - t0)
            base.commit([[]])  # drop the block again: the cache returns to `context` tokens
        seconds.append(min(times[1:]))
    return CostTable.monotone(list(token_counts), seconds)


# A cached table whose 1-token latency is this much slower than a fresh timing was measured
# on a busy machine (or an older build): profile again rather than under-speculate for ever.
STALE_FACTOR = 1.5


def load_or_profile(target: TargetModel, context: int = 128, refresh: bool | None = None) -> CostTable:
    """The cached cost table for this model/device/dtype, profiling it on first use.

    A cached table is re-measured when its 1-token latency is over STALE_FACTOR times a
    fresh timing (it was profiled on a busy machine); DSPARK_REPROFILE=1 forces it."""
    if refresh is None:
        refresh = os.environ.get("DSPARK_REPROFILE", "") not in ("", "0")
    path = Path(cache_root()) / "cost_tables" / f"{_profile_key(target, context)}.json"
    if path.is_file() and not refresh:
        data = json.loads(path.read_text())
        cached = CostTable(tuple(data["tokens"]), tuple(data["seconds"]))
        now = measure_cost_table(target, context, token_counts=(1,), reps=3)
        if cached.latency(1) <= STALE_FACTOR * now.latency(1):
            LOG.info("Cost table from %s", path)
            return cached
        LOG.info("Cost table %s is stale (1 token: %.1f ms cached, %.1f ms now): profiling again",
                 path, 1000 * cached.latency(1), 1000 * now.latency(1))
    else:
        LOG.info("Profiling the cost table (%s; first use for this model, device, dtype and thread count)",
                 "forced" if refresh else path)
    t0 = time.perf_counter()
    table = measure_cost_table(target, context)
    LOG.info("Cost table profiled in %.1f s", time.perf_counter() - t0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "model": target.name,
                "device": _device_name(target.device),
                "dtype": str(target.dtype),
                "context": context,
                "tokens": list(table.tokens),
                "seconds": list(table.seconds),
            },
            indent=1,
        )
    )
    return table
