"""Counts in words for findings and views: "1 tensor", "3 tensors", "step 12", "steps 12, 14" — never "(s)"."""

from __future__ import annotations

from typing import Sequence


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` with its noun agreeing: ``count(1, "tensor")`` is "1 tensor", ``count(3, "tensor")`` "3 tensors"."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def every(n: int, noun: str, plural: str | None = None) -> str:
    """``every(2, "rank")`` is "both ranks", ``every(4, "rank")`` "all 4 ranks", ``every(1, "rank")`` "the one rank"."""
    many = plural or noun + "s"
    return f"the one {noun}" if n == 1 else f"both {many}" if n == 2 else f"all {n:,} {many}"


def numbered(noun: str, numbers: Sequence[int], plural: str | None = None) -> str:
    """``numbered("step", [12])`` is "step 12", ``numbered("step", [12, 14])`` "steps 12, 14"."""
    return f"{noun if len(numbers) == 1 else plural or noun + 's'} {', '.join(map(str, numbers))}"


def span(first: int, last: int, noun: str = "step") -> str:
    """``span(4, 6)`` is "steps 4-6", ``span(4, 4)`` "step 4": a range of one is not written as "steps 4-4"."""
    return f"{noun} {first}" if first == last else f"{noun}s {first}-{last}"


def sample_positions(samples: list[int], located: list[list[int]]) -> str:
    """``5, 9``; in a step of several micro-batches ``21 (micro-batch 1, sample 5)``."""
    if not located:
        return ", ".join(map(str, samples))
    return ", ".join(f"{k} (micro-batch {j}, sample {i})" for k, (j, i) in zip(samples, located))
