"""Overhead of monitored replay and of the recorder, as ratios measured side by side in one run.

    python bench/bench_replay.py [--rounds 7] [--steps 10]

Model: 4 x Linear(1024) MLP (4.2M parameters), batch 64, Adam, 2 threads. Each round times
every variant on the same steps in turn (interleaved, so machine noise hits all alike);
the figure is the median over rounds of the per-step time, and the ratios are to the plain step.
- monitored: the replay's StepMonitor in detect mode (batch, every module output, loss,
  gradients, optimizer gradients, optimizer state, parameters; one host sync per step);
- detect_anomaly: torch.autograd.detect_anomaly(check_nan=True) around the same step;
- recorder: the training loop with Recorder.log after each step (checkpoints excluded:
  checkpoint_every is larger than the run).
Targets (issue 2): monitored <= 1.2x and below detect_anomaly; recorder <= 1.05x.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from nanforensics import Recorder
from nanforensics.replay.monitor import StepMonitor
from torch import nn


def build(width: int = 1024, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, width))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", message=".*Anomaly Detection has been enabled.*")
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(64, 1024, generator=g), "y": torch.randn(64, 1024, generator=g)}
               for _ in range(args.steps)]
    tmp = Path(tempfile.mkdtemp(prefix="nf-bench-"))
    monitor = StepMonitor(model, optimizer)
    recorder = Recorder(tmp / "run", model, optimizer, model_factory=build, step_fn=step,
                        checkpoint_every=10**9)
    logged = [0]

    def plain() -> None:
        for b in batches:
            step(model, optimizer, b)

    def monitored() -> None:
        with monitor:
            for i, b in enumerate(batches):
                monitor.begin(i, b, locate=False)
                loss = step(model, optimizer, b)
                assert not monitor.end(loss)

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            for b in batches:
                step(model, optimizer, b)

    def recorded() -> None:
        for b in batches:
            loss = step(model, optimizer, b)
            recorder.log(logged[0], b, loss)
            logged[0] += 1

    variants: dict[str, Callable[[], None]] = {"plain": plain, "monitored": monitored,
                                               "detect_anomaly": anomaly, "recorder": recorded}
    plain()  # warm-up: allocator, optimizer state
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / args.steps)
    recorder.close()
    base = statistics.median(times["plain"])
    params = sum(p.numel() for p in model.parameters())
    print(f"model: 4 x Linear(1024), {params / 1e6:.1f}M parameters, batch 64, Adam, {torch.get_num_threads()} threads; "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<16}{'ms/step':>10}{'ratio':>8}  target")
    targets = {"plain": "", "monitored": "<= 1.20 and < detect_anomaly", "detect_anomaly": "", "recorder": "<= 1.05"}
    for name in variants:
        t = statistics.median(times[name])
        print(f"{name:<16}{t * 1e3:>10.2f}{t / base:>8.3f}  {targets[name]}")


if __name__ == "__main__":
    main()
