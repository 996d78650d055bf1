"""Forward/backward passes spent by sample attribution, against the batch size.

    python bench/bench_samples.py

For each batch size B and number k of bad samples (spread over the batch), the seed scenario's
model runs real forward and backward passes on the subsets sample attribution asks for (every sample
alone up to ALONE_UP_TO samples; above it single samples probed, then halving); a subset fails when a
gradient is non-finite. Printed: passes used, the bound 1 + 2·k·log2(B) of halving, and B (what
testing each sample alone costs), how the samples were judged, with the verdict checked: the
spoiled samples named for k <= B/2, batch-wide for k = B.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from nanforensics import finite
from nanforensics.rootcause.samples import select, split_batch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import scenarios  # noqa: E402 - the test scenarios, outside the installed package


def main() -> None:
    torch.set_num_threads(2)
    model = scenarios.build_model()
    print(f"{'B':>6}{'k':>5}{'passes':>8}{'1+2k*log2(B)':>14}{'B (one by one)':>16}  {'judged':<14}verdict")
    for size in (16, 64, 256, 1024):
        for k in (1, 2, 4, size // 2, size):
            batch = scenarios.make_batch(0, batch_size=size)
            spoiled = sorted({(i * 7919 + 5) % size for i in range(k)}) if k < size // 2 else list(range(0, size, size // k))
            batch["x"][spoiled, scenarios.DEFECT_FEATURE] = 3e-45
            passes = 0

            def fails(indices: list[int]) -> bool:
                nonlocal passes
                passes += 1
                sub = select(batch, indices, size)
                model.zero_grad(set_to_none=True)
                F.mse_loss(model(sub["x"]), sub["y"], reduction="sum").backward()  # a mean would dilute with B
                return not all(finite.all_finite_flags([p.grad for p in model.parameters()]))

            assert fails(list(range(size)))
            found = split_batch(size, fails)
            bound = 1 + 2 * k * math.ceil(math.log2(size))
            named = found.status == "attributed" and found.samples == spoiled
            ok = "ok" if (found.status == "batch_wide" if k == size else named) else f"MISMATCH {found.samples}"
            print(f"{size:>6}{k:>5}{passes:>8}{bound:>14}{size:>16}  {found.judged:<14}{found.status} {ok}")


if __name__ == "__main__":
    main()
