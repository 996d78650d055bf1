"""Overhead of monitored replay and of the recorder against a plain training step, and where it goes.

    python bench/bench_replay.py [--rounds 15] [--steps 3] [--threads 2] [--device cpu|cuda] [--clock wall|cpu]

Model: 4 x Linear(1024) MLP (4.2M parameters), batch 64, Adam. Every round runs each variant for
``--steps`` steps in turn (interleaved), each variant on a model and optimizer of its own (the same
initial values): one variant's steps never write another's tensors, which would make a monitor
re-read, at every round, the state and parameters its proof carries from step to step in a replay.
A ratio is the median over rounds of the variant's time over the plain step's in the same round
(benchlib.py says why), with its interquartile range.
- plain again: the plain step as a variant of its own, a control: its ratio is the bench's own noise
  and order effect (1.000 where there is none);
- monitored, monitored again: the replay's StepMonitor in detect mode (batch, every module output,
  loss, gradients, optimizer gradients, and the optimizer state and parameters where their finiteness
  does not follow from the gradients' magnitudes: replay/proof.py), two instances measured in the
  same rounds (issue 25 asks for the figure twice in one run);
- no proof: the same monitor without the proof (``prove=False``), the optimizer state and
  the parameters read every step;
- hooks only: the same hooks installed, doing nothing (the Python cost of the calls themselves);
- read floor: the plain step, then one ``sum`` over every gradient, optimizer-state tensor and
  parameter: the memory any exact check of those stages must read, with no hook at all;
- detect_anomaly: torch.autograd.detect_anomaly(check_nan=True) around the same step;
- recorder: the training loop with Recorder.log after each step, timed until its writer thread has
  written the last batch (checkpoints excluded: checkpoint_every is larger than the run).
Then the profile: each check the monitor makes, timed where it runs (a CPU check has finished when
it returns), summed per stage per step, with the tensors and bytes it reads. On CUDA a check is only
queued (the one sync is in ``end``): there the profile times the launches.
Targets (issue 14): monitored <= 1.10x and below detect_anomaly; (issue 37) recorder <= 1.03x, which
bench_recorder.py measures beside the decoder and breaks down.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from benchlib import CLOCKS, interleaved, ms, paired_ratio, synced, verdict
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


class ProfiledMonitor(StepMonitor):
    """Times every check where it runs and counts what it read, per stage."""

    def __init__(self, *args: Any, clock: Callable[[], float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.tensors: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def check(self, stage: str, name: str, t: Any, state_key: str | None = None) -> None:
        start = self.clock()
        super().check(stage, name, t, state_key)
        self._count(stage, t, start)

    def _max_abs(self, stage: str, name: str, t: Any, state_key: str | None = None) -> float:
        start = self.clock()
        bound = super()._max_abs(stage, name, t, state_key)
        self._count(stage, t, start)
        return bound

    def _count(self, stage: str, t: Any, start: float) -> None:
        self.seconds[stage] += self.clock() - start
        if isinstance(t, torch.Tensor):
            self.tensors[stage] += 1
            self.bytes[stage] += t.numel() * t.element_size()


def monitored_steps(monitor: StepMonitor, model: nn.Module, optimizer: torch.optim.Optimizer,
                    batches: list[dict[str, torch.Tensor]]) -> None:
    with monitor:
        for i, b in enumerate(batches):
            monitor.begin(i, b, locate=False)
            loss = step(model, optimizer, b)
            assert not monitor.end(loss)


def hooks_only(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], list[Any]]:
    """The monitor's hooks (one per module, one per parameter, the optimizer pre-hook), each doing nothing."""
    def install() -> list[Any]:
        handles = [m.register_forward_hook(lambda *_: None) for m in model.modules()]
        handles += [p.register_post_accumulate_grad_hook(lambda _: None) for p in model.parameters()]
        return handles + [optimizer.register_step_pre_hook(lambda *_: None)]
    return install


def profile(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[dict[str, torch.Tensor]],
            rounds: int, plain_step: float, clock: str) -> None:
    monitor = ProfiledMonitor(model, optimizer, clock=CLOCKS[clock])
    for _ in range(rounds):
        monitored_steps(monitor, model, optimizer, batches)
    steps = rounds * len(batches)
    modules = sum(1 for _ in model.modules())
    params = sum(1 for _ in model.parameters())
    print(f"\nwhere the monitored step's extra time goes: each check timed where it runs ({clock} clock), per step, "
          f"{steps} steps ({modules} forward hooks, {params} gradient hooks, 1 optimizer pre-hook)")
    total = 0.0
    for stage, seconds in monitor.seconds.items():
        per_step = seconds / steps
        total += per_step
        mb = monitor.bytes[stage] / steps / 1e6
        print(f"  {stage:<16}{ms(per_step):>10}  {per_step / plain_step:6.1%} of a plain step   "
              f"{monitor.tensors[stage] / steps:5.0f} tensors {mb:7.1f} MB  ({mb / 1e3 / per_step:5.1f} GB/s)")
    print(f"  {'all checks':<16}{ms(total):>10}  {total / plain_step:6.1%} of a plain step "
          f"(the rest of the gap is the hook calls themselves: 'hooks only' above)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (benchlib.py)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*Anomaly Detection has been enabled.*")
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(64, 1024, generator=g).to(device), "y": torch.randn(64, 1024, generator=g).to(device)}
               for _ in range(args.steps)]
    tmp = Path(tempfile.mkdtemp(prefix="nf-bench-"))

    def own() -> tuple[nn.Module, torch.optim.Optimizer]:
        """A variant's own model and optimizer (the same initial values for all): no variant's steps write another's
        tensors, so a monitor's proof carries from one round to its next as it does from step to step in a replay."""
        model = build().to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    def plain_steps(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            for b in batches:
                step(model, optimizer, b)
        return run

    def monitored(prove: bool) -> Callable[[], None]:
        model, optimizer = own()
        monitor = StepMonitor(model, optimizer, prove=prove)
        return lambda: monitored_steps(monitor, model, optimizer, batches)

    def hooks() -> Callable[[], None]:
        model, optimizer = own()
        install, run = hooks_only(model, optimizer), plain_steps(model, optimizer)

        def hooked() -> None:
            handles = install()
            run()
            for h in handles:
                h.remove()
        return hooked

    def floor() -> Callable[[], None]:
        model, optimizer = own()

        def run() -> None:
            for b in batches:
                step(model, optimizer, b)
                for p in model.parameters():
                    p.sum()
                    p.grad.sum()
                    for value in optimizer.state[p].values():
                        value.sum()
        return run

    def anomaly() -> Callable[[], None]:
        run = plain_steps(*own())

        def checked() -> None:
            with torch.autograd.detect_anomaly(check_nan=True):
                run()
        return checked

    model, optimizer = own()
    recorder = Recorder(tmp / "run", model, optimizer, model_factory=build, step_fn=step, checkpoint_every=10**9)
    logged = [0]

    def recorded() -> None:
        for b in batches:
            loss = step(model, optimizer, b)
            recorder.log(logged[0], b, loss)
            logged[0] += 1
        recorder._writer._queue.join()  # the writer's work is the recorder's cost: none left to the next variant

    variants: dict[str, Callable[[], None]] = {k: synced(device, fn) for k, fn in {
        "plain": plain_steps(*own()), "plain again": plain_steps(*own()), "monitored": monitored(True),
        "monitored again": monitored(True), "no proof": monitored(False), "hooks only": hooks(),
        "read floor": floor(), "detect_anomaly": anomaly(), "recorder": recorded}.items()}
    interleaved(variants, 2, args.steps)  # warm-up: allocator, optimizer state, page cache
    times = interleaved(variants, args.rounds, args.steps, args.clock)
    recorder.close()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: 4 x Linear(1024), {params / 1e6:.1f}M parameters, batch 64, Adam, {device}, "
          f"{torch.get_num_threads()} threads; "
          f"{args.rounds} rounds x {args.steps} steps per variant, interleaved, {args.clock} clock")
    print(f"{'variant':<16}{'ms/step':>10}{'ratio':>8}  {'(IQR)':<13} target")
    anomaly_ratio = paired_ratio(times, "detect_anomaly")[0]
    below = lambda r: (f"<= 1.10 and < detect_anomaly ({anomaly_ratio:.2f})", r <= 1.10 and r < anomaly_ratio)  # noqa: E731
    targets = {"monitored": below, "monitored again": below,
               "recorder": lambda r: ("<= 1.03", r <= 1.03)}
    for name in variants:
        r, q1, q3 = paired_ratio(times, name)
        line = f"{name:<16}{statistics.median(times[name]) * 1e3:>10.2f}{r:>8.3f}  ({q1:.3f}-{q3:.3f})"
        if name in targets:
            text, met = targets[name](r)
            line += f" {text}: {verdict(met)}"
        print(line)
    profile(*own(), batches, max(3, args.rounds // 3), statistics.median(times["plain"]), args.clock)


if __name__ == "__main__":
    main()
