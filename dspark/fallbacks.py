"""Per-row results from a batched engine call that may fail: the policy every caller of
`DSparkGenerator.generate_each` gets.

  - any error but out-of-memory: the rows are split in halves and each half retried, down to
    single rows; a row that still fails alone gets its error as its result, so one bad row
    costs O(log n) extra calls and the other rows complete;
  - out of accelerator memory: the allocator cache is emptied and the same rows are retried
    with half as many rows decoding together (16 -> 8 -> ... -> 1), then, still out of memory
    at one row, without speculation (no draft tokens to hold or verify); rows that run out of
    memory even then are isolated by halving and get the out-of-memory error.

Greedy outputs are the same whichever attempt produced them (decoding is lossless), and a
sampled row draws with its own seed wherever it lands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def is_out_of_memory(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def free_accelerator_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # cleanup must never hide the original error
        pass


def checked_call(call: Callable[[list[T]], Sequence[R]], items: list[T]) -> list[R]:
    results = list(call(items))
    if len(results) != len(items):
        raise RuntimeError(f"engine returned {len(results)} results for {len(items)} prompts")
    return results


@dataclass(frozen=True)
class Attempt:
    """How one engine call runs: rows decoding together, and whether to speculate."""

    batch_size: int
    speculate: bool = True


def after_out_of_memory(attempt: Attempt) -> Attempt | None:
    """The next, smaller attempt after running out of memory: half the rows decoding together,
    then (at one row) no speculation; None when nothing smaller is left."""
    if attempt.speculate and attempt.batch_size > 1:
        return Attempt(attempt.batch_size // 2, True)
    if attempt.speculate:
        return Attempt(1, False)
    return None


# on_retry(kind, rows, next attempt, error): kind is "split", "halve_batch" or "no_speculation"
RetryHook = Callable[[str, int, Attempt, BaseException], None]


def call_with_fallbacks(
    call: Callable[[list[T], Attempt], Sequence[R]],
    items: list[T],
    attempt: Attempt,
    on_retry: RetryHook | None = None,
) -> list[R | Exception]:
    """`call(items, attempt)` with the module docstring's fallbacks. Returns one result per item,
    in order; an item that fails on its own gets its exception instead of a result."""
    if not items:
        return []
    # the rows decoding together can never exceed the rows in the call: halving must bite
    attempt = Attempt(min(attempt.batch_size, len(items)), attempt.speculate)
    try:
        return checked_call(lambda part: call(part, attempt), items)
    except Exception as exc:
        if is_out_of_memory(exc):
            free_accelerator_cache()
            smaller = after_out_of_memory(attempt)
            if smaller is not None:
                if on_retry is not None:
                    on_retry("halve_batch" if smaller.speculate else "no_speculation", len(items), smaller, exc)
                return call_with_fallbacks(call, items, smaller, on_retry)
        if len(items) == 1:
            return [exc]
        if on_retry is not None:
            on_retry("split", len(items), attempt, exc)
        middle = len(items) // 2
        return call_with_fallbacks(call, items[:middle], attempt, on_retry) + call_with_fallbacks(
            call, items[middle:], attempt, on_retry
        )


@contextmanager
def decode_batch_size(generator: Any, batch_size: int) -> Iterator[None]:
    """Let at most `batch_size` rows decode together in this call (the generator's continuous
    batching width, restored afterwards; callers hold the generator's lock)."""
    before = generator.max_batch_size
    generator.max_batch_size = min(before, batch_size)
    try:
        yield
    finally:
        generator.max_batch_size = before
