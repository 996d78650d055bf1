"""Cost of the provenance trace of the responsible step, as ratios measured side by side in one run.

    python bench/bench_provenance.py [--rounds 5] [--old 092baac]

Model: the test scenarios' nanoGPT-shaped decoder at Decoder(vocab=8192, seq_len=128, d_model=384, n_head=6,
n_layer=6), about 14M parameters, AdamW, batch 8 x 128 tokens, 2 threads. The step is the responsible one:
its batch holds a fully padded sequence, so softmax makes NaN in the forward and AdamW writes it into every
moment. Before each run the model and optimizer are restored to the same state, outside the timing. Each
round times every variant in turn (interleaved, so machine noise hits all alike); the figure is the median
over rounds, and the ratios are to the plain step.
- plain: the user's step function, nothing else;
- provenance: ``trace_step`` of ``nanforensics.rootcause.operations``, following the origin value back;
- old op trace: the first-op-in-time trace it replaced (the module as of commit ``--old``, read with git);
- detect_anomaly: torch.autograd.detect_anomaly(check_nan=True) around the same step. It raises at the
  first backward node returning NaN (here SoftmaxBackward0), so its time is up to that point.
Target (issue 10): provenance <= 2x a plain step.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from nanforensics.replay.monitor import StepMonitor
from nanforensics.rootcause.operations import trace_step

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import scenarios  # noqa: E402 - the test scenarios, outside the installed package

SHAPE = dict(vocab=8192, seq_len=128, d_model=384, n_head=6, n_layer=6)
TARGET = 2.0


def old_trace(commit: str) -> ModuleType:
    """The old ``operations`` module, from git, imported inside the package so its relative imports resolve."""
    source = subprocess.run(["git", "show", f"{commit}:nanforensics/rootcause/operations.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("nanforensics.rootcause._old_operations", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "nanforensics.rootcause"
    module.__file__ = f"{commit}:operations.py"  # it skips its own frames when naming the user's source line
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--old", default="092baac", help="commit holding the old first-op-in-time trace")
    args = ap.parse_args()
    torch.set_num_threads(2)
    warnings.simplefilter("ignore")  # anomaly mode warns with the forward traceback of the node it stops at
    old = old_trace(args.old)
    model = scenarios.build_decoder(**SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = dict(batch_size=8, seq_len=SHAPE["seq_len"], vocab=SHAPE["vocab"])
    scenarios.train_step_lm(model, optimizer, scenarios.make_token_batch(0, **tokens))  # optimizer state exists
    batch = scenarios.make_token_batch(1, defect="fully_padded", **tokens)
    state = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))

    def restore() -> None:
        model.load_state_dict(state[0])
        optimizer.load_state_dict(copy.deepcopy(state[1]))

    def step() -> Any:
        return scenarios.train_step_lm(model, optimizer, batch)

    restore()
    with StepMonitor(model, optimizer) as monitor:  # the origin, as replay's locate mode finds it
        monitor.begin(1, batch, locate=True)
        origin = monitor.end(step())[0]

    found: dict[str, str] = {}

    def provenance() -> None:
        op = trace_step(model, optimizer, step, origin)
        found["provenance"] = f"{op.site.phase} {op.site.op} in {op.site.module}" if op else "nothing"

    def old_op_trace() -> None:
        op = old.trace_step(model, optimizer, step)
        found["old op trace"] = f"{op.site.phase} {op.site.op} in {op.site.module}" if op else "nothing"

    def anomaly() -> None:
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                step()
            found["detect_anomaly"] = "nothing"
        except RuntimeError as e:
            found["detect_anomaly"] = f"raised: {str(e).splitlines()[0][:70]}"

    variants: dict[str, Callable[[], Any]] = {"plain": step, "provenance": provenance, "old op trace": old_op_trace,
                                              "detect_anomaly": anomaly}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for name, fn in variants.items():  # warm-up
        restore()
        fn()
    for _ in range(args.rounds):
        for name, fn in variants.items():
            restore()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["plain"])
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Decoder({', '.join(f'{k}={v}' for k, v in SHAPE.items())}), {params / 1e6:.1f}M parameters, "
          f"AdamW, batch 8 x {SHAPE['seq_len']} tokens, {torch.get_num_threads()} threads; median of {args.rounds} "
          f"rounds; origin: {origin.stage} {origin.tensor}{origin.index} = {origin.value}")
    print(f"{'variant':<16}{'ms/step':>10}{'ratio':>8}  {'range':<13}  names")
    for name in variants:
        t = statistics.median(times[name])
        lo, hi = min(times[name]) / base, max(times[name]) / base
        print(f"{name:<16}{t * 1e3:>10.1f}{t / base:>8.2f}  {lo:.2f}-{hi:.2f}{'':<4}  {found.get(name, '')}")
    ratio = statistics.median(times["provenance"]) / base
    print(f"target: provenance <= {TARGET:.1f}x a plain step: {'met' if ratio <= TARGET else 'NOT met'} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
