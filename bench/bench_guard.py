"""The cost of ``Recorder(guard=True, batches="memory")`` (issue 24), side by side with a plain step in one run.

    python bench/bench_guard.py [--batch 8] [--rounds 5] [--device cpu|cuda] [--clock wall|cpu] [--threads 2]

Printed, each against a plain training step interleaved round by round (benchlib.py):
1. the 14M decoder of bench_transformer.py (AdamW) and a 4 x Linear(1024) MLP (Adam): the recorder without a guard
   (every batch to disk, as a reference for what the recorder itself costs), the guarded step (the guard's
   wrapped ``optimizer.step`` and ``Recorder.log``: the loss read, the batch copied into the ring, its step line
   written; checkpoints excluded, ``state_check_every=10``), the same with the state checked after every step, and,
   for the decoder, fused AdamW guarded against fused AdamW plain (the verdict handed to the optimizer on the device);
2. what a skipped step costs: the guarded step of a bad batch (a fully padded document: NaN gradients) with its
   incident and the checkpoint after it, against the guarded step of a good one; and on the MLP, a step skipped for
   its update (finite gradients, Adam's g^2 overflowing), decided by the real step on a copy;
3. the ring's memory against the batch size: bytes per step, and for a ring of ``checkpoint_every`` = 50 steps;
4. the guard's own work in a decoder step, each part alone against AdamW's step (``--parts``: only this).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from benchlib import CLOCKS, interleaved, paired_ratio, synced, verdict
from nanforensics import Recorder
from nanforensics.replay.proof import UpdateCheck, max_abs
from nanforensics.runs.batches import map_tensors, snapshot
from nanforensics.runs.guard import GuardPolicy, nonfinite_flag, ring_nbytes
from nanforensics.words import count
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import scenarios  # noqa: E402 - the test scenarios, outside the installed package
from guard_training import mlp_step  # noqa: E402 - the MLP's step (named by the recorder as this file's)

DECODER = {"vocab": 8192, "seq_len": 128, "d_model": 384, "n_head": 6, "n_layer": 6}


def token_batch(step: int, size: int, device: torch.device, defect: str | None = None) -> dict[str, Any]:
    b = scenarios.make_token_batch(step, 0, defect, batch_size=size, seq_len=DECODER["seq_len"], vocab=DECODER["vocab"])
    return map_tensors(b, lambda t: t.to(device))


def build_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())])


class Case:
    """A model, its step function and batch, built again for each variant (each variant trains its own copy)."""

    def __init__(self, name: str, build: Callable[[], nn.Module], kwargs: dict[str, Any], step_fn: Callable[..., Any],
                 step_name: str, batch: dict[str, Any], optimizer: Callable[..., torch.optim.Optimizer]) -> None:
        self.name, self.build, self.kwargs, self.step_fn, self.step_name = name, build, kwargs, step_fn, step_name
        self.batch, self.optimizer = batch, optimizer

    def plain(self, device: torch.device, **opt: Any) -> Callable[[], None]:
        model = self.build(**self.kwargs).to(device)
        optimizer = self.optimizer(model.parameters(), **opt)
        return lambda: self.step_fn(model, optimizer, self.batch).item()  # a loop reads its loss: so does each variant

    def guarded(self, device: torch.device, folder: Path, policy: GuardPolicy | bool, **opt: Any
                ) -> tuple[Callable[[], None], Recorder]:
        model = self.build(**self.kwargs).to(device)
        optimizer = self.optimizer(model.parameters(), **opt)
        rec = Recorder(Path(tempfile.mkdtemp(dir=folder)) / "run", model, optimizer,
                       model_factory=f"bench/bench_guard.py:{self.build.__name__}" if self.name == "mlp" else
                       "scenarios:build_decoder", model_kwargs=self.kwargs, step_fn=self.step_name,
                       checkpoint_every=10**9, guard=policy)
        step = [0]

        def run() -> None:
            rec.log(step[0], self.batch, self.step_fn(model, optimizer, self.batch))
            step[0] += 1
            rec._writer._queue.join()  # the step line's write is the recorder's cost: none left to the next variant
        return run, rec


def overhead(case: Case, device: torch.device, rounds: int, clock: str, folder: Path, fused: bool) -> None:
    recs = []
    variants: dict[str, Callable[[], None]] = {"plain": synced(device, case.plain(device))}
    for label, policy in (("recorder, disk, no guard", False), ("guarded", GuardPolicy()),
                          ("guarded, state every step", GuardPolicy(state_check_every=1))):
        run, rec = case.guarded(device, folder, policy)
        variants[label], recs = synced(device, run), recs + [rec]
    if fused:
        variants["plain fused"] = synced(device, case.plain(device, fused=True))
        run, rec = case.guarded(device, folder, GuardPolicy(), fused=True)
        variants["guarded fused"], recs = synced(device, run), recs + [rec]
    interleaved(variants, 1)  # warm-up: the optimizer's state, the allocator
    times = interleaved(variants, rounds, clock=clock)
    for rec in recs:
        rec.close()
    params = sum(p.numel() for p in case.build(**case.kwargs).parameters())
    print(f"\n{case.name}: {params / 1e6:.1f}M parameters, {device}, {torch.get_num_threads()} threads, "
          f"{rounds} rounds interleaved, {clock} clock")
    for name, t in times.items():
        base = "plain fused" if name == "guarded fused" else "plain"
        r, q1, q3 = paired_ratio(times, name, base)
        line = f"  {name:<28}{statistics.median(t):8.4f} s {r:7.3f}x  ({q1:.3f}-{q3:.3f}) vs {base}"
        if case.name == "decoder" and name in ("guarded", "guarded fused"):
            line += f"  target <= 1.02: {verdict(r <= 1.02)}"
        print(line)


def skipped_step(device: torch.device, size: int, folder: Path, clock: str) -> None:
    """One guarded step whose batch makes the gradients NaN: the skip, its incident and the checkpoint after it."""
    model = scenarios.build_decoder(**DECODER).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = Recorder(Path(tempfile.mkdtemp(dir=folder)) / "run", model, optimizer, model_factory="scenarios:build_decoder",
                   model_kwargs=DECODER, step_fn="scenarios:train_step_lm", checkpoint_every=50, guard=True)
    good, bad = token_batch(0, size, device), token_batch(1, size, device, "fully_padded")
    rec.log(0, good, scenarios.train_step_lm(model, optimizer, good))
    now = CLOCKS[clock]
    start = now()
    rec.log(1, good, scenarios.train_step_lm(model, optimizer, good))
    plain = now() - start
    start = now()
    rec.log(2, bad, scenarios.train_step_lm(model, optimizer, bad))
    skipped = now() - start
    rec.close()
    assert rec.guard is not None and rec.guard.skipped == [2], rec.guard.skipped if rec.guard else None
    print(f"\n2. a skipped step on the decoder (batch {size}): {skipped:.3f} s with its incident and checkpoint, "
          f"{skipped / plain:.2f}x a guarded step that was not skipped ({plain:.3f} s), {clock} clock, one sample")


def skipped_update(folder: Path, clock: str) -> None:
    """One guarded MLP step whose gradients are finite but whose update is not (one sample of 1e16: Adam's g^2
    overflows): the proof cannot bound it, the step on a copy of each unproven parameter decides, then the incident."""
    model = build_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = Recorder(Path(tempfile.mkdtemp(dir=folder)) / "run", model, optimizer, model_factory="bench/bench_guard.py:"
                   "build_mlp", step_fn="bench/bench_guard.py:mlp_step", checkpoint_every=50, guard=True)
    g = torch.Generator().manual_seed(1)
    good = {"x": torch.randn(64, 1024, generator=g), "y": torch.randn(64, 1024, generator=g)}
    bad = {"x": good["x"].clone(), "y": good["y"]}
    bad["x"][3] = 1e16
    rec.log(0, good, mlp_step(model, optimizer, good))
    now = CLOCKS[clock]
    start = now()
    rec.log(1, good, mlp_step(model, optimizer, good))
    plain = now() - start
    start = now()
    rec.log(2, bad, mlp_step(model, optimizer, bad))
    skipped = now() - start
    rec.close()
    assert rec.guard is not None and rec.guard.skipped == [2], rec.guard.skipped if rec.guard else None
    trials = rec.guard.update_check.trials if rec.guard.update_check else 0
    print(f"   a skipped update on the MLP (finite gradients, Adam's g^2 overflowing; {count(trials, 'step')} on a copy): "
          f"{skipped:.3f} s with its incident and checkpoint, {skipped / plain:.2f}x a guarded step that was not "
          f"skipped ({plain:.3f} s), {clock} clock, one sample")


def guard_parts(rounds: int, batch_size: int) -> None:
    """The guard's own work in a step of the decoder (AdamW, one thread, process clock), each part timed alone and
    against the optimizer's step: steadier on a loaded machine than the whole step's ratio."""
    torch.set_num_threads(1)
    model = scenarios.build_decoder(**DECODER)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    grads = [p.grad for p in params]
    check = UpdateCheck(optimizer)
    maxima = dict(zip(params, max_abs(grads)))

    def proof() -> None:
        check.hazard(maxima)
        check.after_step()

    batch = token_batch(0, batch_size, torch.device("cpu"))
    parts = {"the gradient check (GradScaler's, no proof)": lambda: float(nonfinite_flag(grads, torch.device("cpu"))),
             "the proof's read (aminmax per gradient)": lambda: max_abs(grads),
             "the proof's arithmetic (bounds carried)": proof,
             "AdamW's step": optimizer.step,
             f"a plain training step (batch {batch_size})": lambda: scenarios.train_step_lm(model, optimizer, batch)}
    times = {}
    for name, f in parts.items():
        f()
        n = rounds if "training" not in name else max(1, rounds // 5)
        start = time.process_time()
        for _ in range(n):
            f()
        times[name] = (time.process_time() - start) / n
    print(f"\n4. the guard's own work in a decoder step ({len(params)} parameters, 1 thread, process clock, "
          f"{rounds} rounds; {check.trials} steps on a copy)")
    step, whole = times["AdamW's step"], times[f"a plain training step (batch {batch_size})"]
    for name, t in times.items():
        print(f"  {name:<46}{t * 1e3:9.2f} ms  {t / step:6.3f}x AdamW's step  {t / whole:6.4f}x the training step")


def ring_memory(sizes: list[int]) -> None:
    print("\n3. the ring (host memory): bytes per step, and for checkpoint_every = 50 steps")
    for size in sizes:
        per_step = ring_nbytes(snapshot(token_batch(0, size, torch.device("cpu"))))
        print(f"  decoder batch {size:>4} x {DECODER['seq_len']} tokens: {per_step / 2**10:9.1f} KiB/step, "
              f"{per_step * 50 / 2**20:8.2f} MiB for 50 steps")
    for size in (64, 256):
        per_step = ring_nbytes(snapshot({"x": torch.zeros(size, 1024), "y": torch.zeros(size, 1024)}))
        print(f"  mlp batch {size:>4} x 1024 floats (x and y): {per_step / 2**10:9.1f} KiB/step, "
              f"{per_step * 50 / 2**20:8.2f} MiB for 50 steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", action="store_true", help="only section 4, the guard's own work per step")
    args = parser.parse_args()
    if args.parts:
        guard_parts(20, args.batch)
        return
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    mlp_batch = {"x": torch.randn(64, 1024, generator=g).to(device), "y": torch.randn(64, 1024, generator=g).to(device)}
    cases = [Case("decoder", scenarios.build_decoder, DECODER, scenarios.train_step_lm, "scenarios:train_step_lm",
                  token_batch(0, args.batch, device), lambda ps, **o: torch.optim.AdamW(ps, lr=1e-3, **o)),
             Case("mlp", build_mlp, {}, mlp_step, "bench/bench_guard.py:mlp_step", mlp_batch,
                  lambda ps, **o: torch.optim.Adam(ps, lr=1e-3, **o))]
    with tempfile.TemporaryDirectory(prefix="nf-bench-guard-") as tmp:
        print("1. one training step, guarded against plain")
        for case in cases:
            overhead(case, device, args.rounds, args.clock, Path(tmp), fused=case.name == "decoder")
        skipped_step(device, args.batch, Path(tmp), args.clock)
        skipped_update(Path(tmp), args.clock)
    ring_memory([8, 32, 128, 512])
    guard_parts(20, args.batch)


if __name__ == "__main__":
    main()
