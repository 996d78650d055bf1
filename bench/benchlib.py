"""Timing shared by the benches: variants interleaved round by round, ratios paired within a round.

Shared 2-core machines swing several-fold within a minute. A ratio of two medians taken minutes apart
measures the swing; a ratio of two timings taken back to back in the same round mostly cancels it.
So every variant runs once per round, in turn, and a ratio is the median over rounds of the
per-round ratio, printed with its interquartile range so the noise is visible beside it.

``--clock cpu`` (with ``--threads 1``) times the process's CPU time instead of the wall clock: a
process that waits for a core is not charged for the wait, so the figure holds on a machine other
jobs are loading. Memory bandwidth they take is still charged.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, per_call: int = 1,
                clock: str = "wall", settle: dict[str, Callable[[], object]] | None = None) -> dict[str, list[float]]:
    """Seconds per unit (a call does ``per_call`` units: steps) of each variant, one entry per round.

    ``settle``: for a variant that leaves work behind (a background thread's), what waits for it after each timing,
    untimed, so that it does not land in the next variant's.

    Each round starts one variant later than the one before: the variant that runs first in a round runs after the
    previous round's last, on caches and an allocator another variant left, and measured 5% slower than the same
    variant run second (a fixed order made that bias every ratio's)."""
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = variants[name]
            start = now()
            fn()
            times[name].append((now() - start) / per_call)
            if settle and name in settle:
                settle[name]()
    return times


def synced(device: torch.device, fn: Callable[[], object]) -> Callable[[], None]:
    """On an accelerator a timing ends when the device has finished, not when the launches have."""
    def run() -> None:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


def paired_ratio(times: dict[str, list[float]], name: str, base: str = "plain") -> tuple[float, float, float]:
    """Median, first and third quartile over rounds of ``name``'s time over ``base``'s in the same round."""
    ratios = sorted(a / b for a, b in zip(times[name], times[base]))
    if len(ratios) < 4:
        return statistics.median(ratios), ratios[0], ratios[-1]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return median, q1, q3


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
