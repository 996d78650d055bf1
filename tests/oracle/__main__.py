"""The long run by hand: ``python -m tests.oracle --programs 5000 [--first SEED] [--only AXIS=VALUE]
[--large-batches]`` from the checkout's root (``--only optimizers=two``: the first 5000 programs from SEED on that drew
two optimizers; ``--large-batches``: each seed's program with a batch of 34, 48 or 64 samples, above the 32 up to which
every sample is run alone, so attribution probes and halves; its axis ``size``, ``--only size=48``).

Prints the programs tried, agreements by verdict, refusals by reason, disagreements by class (with their seeds), the coverage
table (each axis value: drawn / agree / refused / disagree) and the time taken."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from .check import Outcome, check
from .programs import AXES, LARGE_AXES, draw


def coverage(outcomes: list[Outcome], axes: dict[str, tuple[str, ...]] = AXES) -> list[str]:
    """The coverage table's lines: per value of each of ``axes``, how many programs drew it and how each ended."""
    counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        for axis, value in o.axes.items():
            counts[axis, value][o.kind] += 1
    lines = [f"{'axis':<12}{'value':<18}{'drawn':>6}{'agree':>7}{'refused':>9}{'unrecordable':>14}{'disagree':>10}"]
    for axis, values in axes.items():
        for value in values:
            c = counts.get((axis, value), Counter())
            lines.append(f"{axis:<12}{value:<18}{sum(c.values()):>6}{c['agree']:>7}{c['refused']:>9}"
                         f"{c['unrecordable']:>14}{c['disagree']:>10}")
    return lines


def summary(outcomes: list[Outcome], seconds: float) -> list[str]:
    kinds = Counter(o.kind for o in outcomes)
    lines = [f"programs {len(outcomes)}  agree {kinds['agree']}  refused {kinds['refused']}  unrecordable "
             f"{kinds['unrecordable']}  disagree {kinds['disagree']}  time {seconds:.0f} s"]
    for kind in ("agree", "refused", "unrecordable", "disagree"):
        by = Counter(o.reason for o in outcomes if o.kind == kind)
        for reason, n in by.most_common():
            seeds = [o.seed for o in outcomes if o.kind == kind and o.reason == reason][:8]
            lines.append(f"  {kind:<12} {n:>5}  {reason}" + ("" if kind == "agree" else f"  (seeds {seeds})"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.oracle", description=__doc__)
    parser.add_argument("--programs", type=int, default=100)
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--verbose", action="store_true", help="each disagreement's details as it is found")
    parser.add_argument("--only", action="append", default=[], metavar="AXIS=VALUE",
                        help="only the programs drawn with this value of an axis (repeatable); seeds that draw another "
                             "are passed over, until --programs are checked")
    parser.add_argument("--large-batches", action="store_true",
                        help="each seed's program with a batch of 34, 48 or 64 samples (axis size), above the 32 up to "
                             "which each sample is run alone: samples judged by probes and halving, checked against "
                             "the weaker claim that report makes (tests/oracle/check.py)")
    args = parser.parse_args(argv)
    axes = LARGE_AXES if args.large_batches else AXES
    only = dict(item.partition("=")[::2] for item in args.only)
    if unknown := [f"{a}={v}" for a, v in only.items() if v not in axes.get(a, ())]:
        parser.error(f"--only {unknown[0]}: not an axis and one of its values ({', '.join(axes)})")
    torch.set_num_threads(1)
    outcomes = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nanforensics-oracle-") as folder:
        seed = args.first - 1
        while len(outcomes) < args.programs:
            seed += 1
            if only and any(draw(seed, args.large_batches).axes[a] != v for a, v in only.items()):
                continue
            o = check(seed, Path(folder), args.large_batches)
            outcomes.append(o)
            if args.verbose and o.kind == "disagree":
                print(f"seed {seed} {o.reason}: {o.axes} {o.details}", file=sys.stderr, flush=True)
    print("\n".join(summary(outcomes, time.perf_counter() - start) + coverage(outcomes, axes)))
    return 1 if any(o.kind == "disagree" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
