"""The recorder against a plain training step, on the MLP and the decoder side by side, and where its time goes.

    python bench/bench_recorder.py [--rounds 21] [--steps 3] [--threads 2] [--clock wall|cpu] [--only mlp|decoder]
                                   [--calls 50] [--checkpoint-rounds 11]

Two models, measured in the same run, their variants interleaved round by round (benchlib.py):
- MLP: bench_replay.py's 4 x Linear(1024) (4.2M parameters), batch 64 (two 64 x 1024 float32 tensors, 512 KB), Adam:
  a step that moves little data, the recorder's worst case;
- decoder: bench_transformer.py's 14M-parameter decoder, AdamW, batch 8 x 128 tokens (int64 ids and mask, 16 KB).
Each model's variants, each on a model and optimizer of its own (the same initial values):
- plain, plain again: the step alone; the second is the control (its ratio is the bench's own noise);
- copy only: the step, then ``snapshot`` of the batch (the private copy ``Recorder.log`` takes on the training
  thread): the floor of any recorder that may let the loop reuse its batch tensors;
- recorder: the step, then ``Recorder.log``, timed until its writer thread has written the last batch (no work is
  left to the next variant); checkpoints excluded (``checkpoint_every`` is larger than the run).
Then a checkpoint's cost on the training thread, its variants interleaved round by round with a plain step
(``--checkpoint-rounds``), each a ratio to the plain step of its round, per step at ``checkpoint_every`` 50 and 10:
- before: the checkpoint written on the training thread (the writer drained, then ``save_checkpoint``), as the
  recorder did until issue 37;
- after: ``Recorder``'s checkpoint as it is now: the state copied on the training thread, written on the writer
  thread (waited for after the timing, untimed: the write is charged to no variant);
- after, until written: the same, timed until the writer has written it (the copy's price on top of the write).
Then the recorder's parts, each timed alone with the thread CPU clock (median of 7 timings of ``--calls`` calls): on the
training thread the batch copy, the loss read (``.item()``: a host sync on an accelerator), the queue and a
checkpoint's state copy (its tensors' copy into the buffers kept from the checkpoint before, and for comparison
the tensors cloned instead); on the writer thread the serialisation
(safetensors), the file written under a temporary name and renamed, the step line, and a checkpoint written; the
checkpoint's per step at ``checkpoint_every`` 50.
Targets (issue 37): recorder <= 1.03x a plain step on the MLP, <= 1.01x on the decoder.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from bench_replay import build, step
from benchlib import interleaved, paired_ratio, verdict
from nanforensics import Recorder
from nanforensics.runs.batches import encoded, snapshot
from nanforensics.runs.checkpoint import checkpoint_state, save_checkpoint
from nanforensics.runs.files import write_bytes_atomic
from nanforensics.runs.steplog import step_line
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import scenarios  # noqa: E402 - the test scenarios, outside the installed package

DECODER = {"vocab": 8192, "seq_len": 128, "d_model": 384, "n_head": 6, "n_layer": 6}
TARGETS = {"mlp": 1.03, "decoder": 1.01}
EVERY = (50, 10)  # checkpoint_every: the default, and a frequent one


class Model:
    """One model's training step and batches, and a fresh model and optimizer of the same initial values."""

    def __init__(self, name: str, steps: int) -> None:
        self.name = name
        g = torch.Generator().manual_seed(0)
        if name == "mlp":
            self.batches = [{"x": torch.randn(64, 1024, generator=g), "y": torch.randn(64, 1024, generator=g)}
                            for _ in range(steps)]
            self.step: Callable[..., torch.Tensor] = step
            self.factory: dict[str, Any] = {"model_factory": build, "step_fn": step}
        else:
            self.batches = [scenarios.make_token_batch(i, 0, None, batch_size=8, seq_len=DECODER["seq_len"],
                                                       vocab=DECODER["vocab"]) for i in range(steps)]
            self.step = scenarios.train_step_lm
            self.factory = {"model_factory": "scenarios:build_decoder", "model_kwargs": DECODER,
                            "step_fn": "scenarios:train_step_lm"}

    def own(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.name == "mlp":
            model = build()
            return model, torch.optim.Adam(model.parameters(), lr=1e-4)
        torch.manual_seed(0)
        model = scenarios.build_decoder(**DECODER)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def variants(self, folder: Path) -> tuple[dict[str, Callable[[], None]], Recorder]:
        def plain() -> Callable[[], None]:
            model, optimizer = self.own()
            return lambda: [self.step(model, optimizer, b) for b in self.batches] and None

        def copy_only() -> Callable[[], None]:
            model, optimizer = self.own()

            def run() -> None:
                for b in self.batches:
                    self.step(model, optimizer, b)
                    snapshot(b)
            return run

        model, optimizer = self.own()
        recorder = Recorder(folder / self.name, model, optimizer, checkpoint_every=10**9, **self.factory)
        logged = [0]

        def recorded() -> None:
            for b in self.batches:
                recorder.log(logged[0], b, self.step(model, optimizer, b))
                logged[0] += 1
            recorder._writer._queue.join()  # the writer's work is the recorder's cost: none left to the next variant
        return {"plain": plain(), "plain again": plain(), "copy only": copy_only(), "recorder": recorded}, recorder


def cpu_us(fn: Callable[[], object], calls: int = 50, repeats: int = 7) -> float:
    """Median over ``repeats`` of the thread CPU time of one call, in microseconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - start) / calls)
    return statistics.median(times) * 1e6


def parts(m: Model, folder: Path, plain_step: float, calls: int) -> None:
    """Each part of Recorder.log and of its writer, timed alone on this model's batch (``calls`` calls a timing)."""
    model, optimizer = m.own()
    b = m.batches[0]
    loss = m.step(model, optimizer, b)
    tensors, tree = snapshot(b)
    data = encoded(0, tensors, tree)
    counter = iter(range(10**9))
    rows = {
        "training thread: batch copy (snapshot)": cpu_us(lambda: snapshot(b), calls),
        "training thread: loss read (.item())": cpu_us(lambda: loss.detach().float().item(), calls),
        "writer: serialise (safetensors)": cpu_us(lambda: encoded(0, tensors, tree), calls),
        "writer: write, rename": cpu_us(lambda: write_bytes_atomic(folder / f"b{next(counter) % 64}", data,
                                                                  durable=False), calls),
        "writer: step line": cpu_us(lambda: step_line(0, 1.0), calls),
    }
    recorder = Recorder(folder / "run", model, optimizer, checkpoint_every=10**9, keep_checkpoints=1, **m.factory)
    steps = iter(range(1, 10**9))
    rows["training thread: checkpoint's state copy, per step at 50"] = cpu_us(  # the wait for the write is not CPU
        lambda: (recorder._checkpoint(next(steps)), recorder._writer._queue.join()), 1) / 50
    recorder.close()
    state = checkpoint_state(0, model, optimizer)
    live = [t for part in (state.model, state.optimizer) for t in part.values()]
    kept = [torch.empty_like(t) for t in live]
    rows["  of which its tensors copied into kept buffers"] = cpu_us(
        lambda: [b.copy_(t) for b, t in zip(kept, live)], 1) / 50
    rows["  or instead cloned (allocated each time)"] = cpu_us(lambda: [t.clone() for t in live], 1) / 50
    start, wall = time.thread_time(), time.perf_counter()
    save_checkpoint(folder / "checkpoints", 0, model, optimizer)
    checkpoint, wall = (time.thread_time() - start) * 1e6, time.perf_counter() - wall
    rows["writer: checkpoint written, per step at 50"] = checkpoint / 50
    size = sum(memoryview(part).nbytes for part in data) if isinstance(data, list) else len(data)  # before: bytes
    nbytes = sum(t.nbytes for t in live)
    print(f"\n{m.name}: the recorder's parts, thread CPU time, per step ({size / 1e3:.0f} KB batch file; "
          f"a checkpoint {nbytes / 1e6:.0f} MB, written in {checkpoint / 1e3:.0f} ms of CPU, {wall * 1e3:.0f} ms wall "
          "with its fsyncs)")
    for name, us in rows.items():
        print(f"  {name:<58}{us:9.1f} us  {us / 1e6 / plain_step:6.2%} of a plain step")


def checkpoints(m: Model, folder: Path, rounds: int, clock: str) -> None:
    """A checkpoint's cost on the training thread, before and after, against a plain step of the same round."""
    model, optimizer = m.own()
    b = m.batches[0]
    recorder = Recorder(folder / f"{m.name}-after", model, optimizer, checkpoint_every=10**9, keep_checkpoints=1,
                        **m.factory)
    steps = iter(range(1, 10**9))

    def before() -> None:  # the recorder's checkpoint until issue 37; one name, replaced: one kept, as after
        recorder._writer.drain()
        save_checkpoint(folder / f"{m.name}-before", 1, model, optimizer)

    def until_written() -> None:
        recorder._checkpoint(next(steps))
        recorder._writer.drain()
    variants = {"plain step": lambda: m.step(model, optimizer, b), "before": before,
                "after": lambda: recorder._checkpoint(next(steps)), "after, until written": until_written}
    settle = {"after": recorder._writer.drain}
    interleaved(variants, 1, clock=clock, settle=settle)  # warm-up: the copies' buffers, the page cache
    times = interleaved(variants, rounds, clock=clock, settle=settle)
    recorder.close()
    print(f"\n{m.name}: a checkpoint on the training thread, {rounds} rounds interleaved with a plain step "
          f"({statistics.median(times['plain step']) * 1e3:.1f} ms), {clock} clock; per step at checkpoint_every "
          + ", ".join(map(str, EVERY)) + ", of a plain step (IQR)")
    for name in ("before", "after", "after, until written"):
        r, q1, q3 = paired_ratio(times, name, "plain step")
        print(f"  {name:<22}{statistics.median(times[name]) * 1e3:8.1f} ms  "
              + "  ".join(f"{r / k:7.2%} ({q1 / k:.2%}-{q3 / k:.2%})" for k in EVERY))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (benchlib.py)")
    ap.add_argument("--only", choices=list(TARGETS), help="one model instead of both")
    ap.add_argument("--calls", type=int, default=50, help="calls per timing of each part")
    ap.add_argument("--checkpoint-rounds", type=int, default=11, help="rounds of the checkpoint's variants")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="nf-bench-recorder-"))
    models = [Model(name, args.steps) for name in TARGETS if args.only in (None, name)]
    variants: dict[str, Callable[[], None]] = {}
    recorders = []
    for m in models:
        own, recorder = m.variants(folder)
        variants |= {f"{m.name} {k}": fn for k, fn in own.items()}
        recorders.append(recorder)
    interleaved(variants, 2, args.steps)  # warm-up: allocator, optimizer state, page cache
    times = interleaved(variants, args.rounds, args.steps, args.clock)
    for recorder in recorders:
        recorder.close()
    print(f"{len(models)} models, {args.rounds} rounds x {args.steps} steps per variant, all interleaved, "
          f"{torch.get_num_threads()} threads, {args.clock} clock")
    print(f"{'variant':<20}{'ms/step':>10}{'ratio':>8}  (IQR)")
    for m in models:
        for name in (k for k in variants if k.startswith(f"{m.name} ")):
            r, q1, q3 = paired_ratio(times, name, f"{m.name} plain")
            line = f"{name:<20}{statistics.median(times[name]) * 1e3:>10.2f}{r:>8.3f}  ({q1:.3f}-{q3:.3f})"
            if name.endswith(" recorder"):
                line += f"  target <= {TARGETS[m.name]}: {verdict(r <= TARGETS[m.name])}"
            print(line)
    for m in models:
        checkpoints(m, folder, args.checkpoint_rounds, args.clock)
    for m in models:
        parts(m, folder / f"{m.name}-parts", statistics.median(times[f"{m.name} plain"]), args.calls)
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
