"""What the optimizer-state soundness checks add to a scan: ``scan_checkpoint`` with them (the default) against the
finiteness scan alone (``soundness=False``), interleaved round by round on one Adam (and one amsgrad) checkpoint of a
large linear layer, each a ratio of the two times in the same round.

    python bench/bench_soundness.py [--params 16000000] [--rounds 7] [--threads 1] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from benchlib import interleaved, paired_ratio
from nanforensics.checkpoints.scan import scan_checkpoint
from nanforensics.formats import open_checkpoint
from nanforensics.runs.checkpoint import save_checkpoint

TARGET = 2.5  # the soundness scan at most this many times the finiteness scan (it reads the optimizer state again)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=16_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    side = int(args.params ** 0.5)
    with tempfile.TemporaryDirectory() as root:
        for amsgrad in (False, True):
            model = torch.nn.Linear(side, side)
            opt = torch.optim.Adam(model.parameters(), amsgrad=amsgrad)
            model(torch.randn(2, side)).sum().backward()
            opt.step()
            source = open_checkpoint(save_checkpoint(Path(root) / str(amsgrad), 1, model, opt))
            assert scan_checkpoint(source).unsound == []
            times = interleaved({"plain": lambda: scan_checkpoint(source, soundness=False),
                                 "sound": lambda: scan_checkpoint(source)}, args.rounds, clock=args.clock)
            median, q1, q3 = paired_ratio(times, "sound")
            label = "Adam, amsgrad" if amsgrad else "Adam"
            print(f"{label:14s} {side * side + side:,} parameters: scan with soundness / finiteness only "
                  f"{median:.2f}x (IQR {q1:.2f}-{q3:.2f}); target <= {TARGET:g}x: "
                  f"{'met' if median <= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
