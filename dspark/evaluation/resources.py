"""Memory accounting and the soak loop: RSS, CUDA allocator state, drafter footprint."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import psutil
import torch

from dspark.evaluation.quality import linear_slope
from dspark.hardware import cuda_memory


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def _tensors(obj, depth: int, seen: set[int]) -> Iterable[torch.Tensor]:
    """Tensors reachable from obj through modules, attributes, lists and dicts (bounded depth)."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth - 1, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth - 1, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from _tensors(v, depth - 1, seen)


def tensor_bytes(obj, exclude: object = None, depth: int = 4) -> int:
    """Bytes of the distinct tensor storages reachable from obj, minus those also reachable
    from `exclude` (a drafter sharing the target's embedding or LM head adds nothing for it)."""
    skip = {t.untyped_storage().data_ptr() for t in _tensors(exclude, depth, set())} if exclude is not None else set()
    sizes: dict[int, int] = {}
    for t in _tensors(obj, depth, set()):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def measure_drafter(spec: str, target, build: Callable[[str, object], object]) -> dict:
    """Extra memory of one drafter over the target alone: its own tensors' bytes (shared ones
    excluded) and the RSS (and CUDA allocation) growth while building it."""
    dev = torch.device(target.device)
    cuda0 = torch.cuda.memory_allocated(dev) if dev.type == "cuda" and torch.cuda.is_available() else None
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    drafter = build(spec, target)
    load_s = time.perf_counter() - t0
    rss1 = rss_bytes()
    cuda1 = torch.cuda.memory_allocated(dev) if cuda0 is not None else None
    own = tensor_bytes(drafter, exclude=target.model)
    del drafter
    return {
        "drafter": spec,
        "tensor_bytes": own,
        "rss_delta_bytes": rss1 - rss0,
        "cuda_allocated_delta_bytes": (cuda1 - cuda0) if cuda0 is not None else None,
        "load_s": load_s,
    }


@dataclass
class SoakSample:
    minutes: float
    iteration: int
    rss_bytes: int
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None


@dataclass
class SoakResult:
    minutes_requested: float
    minutes_run: float = 0.0
    iterations: int = 0
    requests: int = 0
    output_tokens: int = 0
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)
    changed_outputs: int = 0  # greedy outputs that differ from the first iteration's
    samples: list[SoakSample] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(soak_slopes(self.samples))
        return d


def soak_slopes(samples: list[SoakSample]) -> dict:
    """Least-squares growth in bytes per minute, after the first iteration (allocator and
    cache warm-up); over all samples when later ones are too few."""
    later = [s for s in samples if s.iteration > 0]
    use = later if len(later) >= 2 else samples
    t = [s.minutes for s in use]
    cuda = [s for s in use if s.cuda_allocated_bytes is not None]
    return {
        "rss_slope_bytes_per_min": linear_slope(t, [s.rss_bytes for s in use]),
        "cuda_allocated_slope_bytes_per_min": linear_slope([s.minutes for s in cuda], [s.cuda_allocated_bytes for s in cuda]) if cuda else None,
        "cuda_reserved_slope_bytes_per_min": linear_slope([s.minutes for s in cuda], [s.cuda_reserved_bytes for s in cuda]) if cuda else None,
        "fit_from_iteration": 1 if use is later else 0,
    }


def run_soak(
    minutes: float,
    workload: list[Callable[[], list[list[int]]]],
    device: torch.device,
    on_step: Callable[[SoakResult], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    max_errors_kept: int = 5,
) -> SoakResult:
    """Repeat the workload (a list of calls, each returning the token ids it generated) until
    `minutes` have passed, sampling memory after every call. A failing call is counted and the
    loop goes on: a soak test measures the error rate, it does not stop at the first error."""
    res = SoakResult(minutes_requested=minutes)
    first: dict[int, list[list[int]]] = {}
    t0 = clock()
    while True:
        for k, call in enumerate(workload):
            try:
                ids = call()
                res.requests += len(ids)
                res.output_tokens += sum(len(x) for x in ids)
                if k not in first:
                    first[k] = ids
                else:
                    res.changed_outputs += sum(a != b for a, b in zip(ids, first[k]))
            except Exception as e:  # noqa: BLE001 - counted and reported, the loop continues
                res.errors += 1
                if len(res.error_messages) < max_errors_kept:
                    res.error_messages.append(f"{type(e).__name__}: {e}")
            mem = cuda_memory(device)
            res.samples.append(SoakSample(
                (clock() - t0) / 60.0, res.iterations, rss_bytes(),
                mem["allocated_bytes"] if mem else None, mem["reserved_bytes"] if mem else None,
            ))
            if on_step:
                on_step(res)
        res.iterations += 1
        if clock() - t0 >= minutes * 60.0:
            break
    res.minutes_run = (clock() - t0) / 60.0
    return res
