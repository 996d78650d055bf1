"""The GPU check of issue 14, in one command: record on CUDA, replay there bit-exactly, replay on CPU, benches.

    python bench/gpu_check.py                 # on a machine with a CUDA device; under 8 minutes on an H200
    python bench/gpu_check.py --cpu-dry-run   # every step on the CPU instead: the script's own logic, anywhere

1. Records three small runs on CUDA with the project's recorder, deterministic algorithms on
   (``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``): the seed
   scenario in fp32, the same under bf16 autocast, and the decoder-only transformer whose fully
   padded sequence makes attention NaN (tests/scenarios.py).
2. Replays each on CUDA with the same settings and reports whether it is bit-exact: every replayed
   loss equal to the logged one (the replay's own tolerance is 0 on the recording's device type),
   and the origin the scenario expects.
3. Replays each on the CPU and reports whether the answer is the same (responsible step, stage,
   tensor, coordinate) and the losses agree within the cross-device tolerance (1e-3 relative).
   These replays skip the root-cause passes; one more replay on CUDA runs them (samples, operation).
4. Issue 37's GPU path of the recorder (``check_batch_copy``): a CUDA batch copied into pinned host memory on a side
   stream, the writer thread waiting for it. Checks that the recorded batch files hold the values the batch had
   at ``log`` even though the loop overwrites the batch in place right after, and times ``log``'s copy on the
   training thread against a blocking ``.cpu()`` copy behind the same queued kernels.
5. Runs bench_replay.py and bench_transformer.py with ``--device cuda``.
Without a CUDA device it says so and exits 0 (skipped). Exit 1 when a check fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before torch touches CUDA

import argparse  # noqa: E402 - after the environment cuBLAS reads
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from nanforensics import Recorder  # noqa: E402
from nanforensics.replay.engine import ReplayOptions, replay_run  # noqa: E402
from nanforensics.report import ReplayReport  # noqa: E402
from nanforensics.runs.batches import map_tensors, read_batch, snapshot  # noqa: E402
from nanforensics.runs.run import batch_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import scenarios  # noqa: E402 - the test scenarios, outside the installed package

CASES = {"fp32 MLP": "adam_near_zero", "bf16 autocast MLP": "bf16_near_zero", "fp32 transformer": "decoder_fully_padded"}
STEPS, DEFECT_STEP, CHECKPOINT_EVERY = 24, 17, 10


@dataclass
class Outcome:
    name: str
    ok: bool
    detail: str


def record_on(device: torch.device, run_dir: Path, name: str) -> None:
    """``scenarios.record``, with the model and every batch on ``device``."""
    sc = scenarios.SCENARIOS[name]
    model = sc.factory(**sc.model_kwargs).to(device)
    optimizer = sc.optimizer(model)
    with Recorder(run_dir, model, optimizer, model_factory=sc.factory, model_kwargs=sc.model_kwargs,
                  step_fn=sc.step_fn, checkpoint_every=CHECKPOINT_EVERY) as rec:
        for step in range(STEPS):
            batch = map_tensors(sc.batches(step, 0, sc.defect if step == DEFECT_STEP else None), lambda t: t.to(device))
            rec.log(step, batch, sc.step_fn(model, optimizer, batch))


def answer(report: ReplayReport) -> tuple[Any, ...]:
    o = report.origin
    return (report.responsible_step, o.stage, o.tensor, o.index, o.value) if o else (report.verdict,)


def check_case(label: str, name: str, device: torch.device, folder: Path) -> list[Outcome]:
    run = folder / name
    started = time.perf_counter()
    record_on(device, run, name)
    recorded = time.perf_counter() - started
    same = replay_run(run, ReplayOptions(device=str(device), explain=False))
    other = replay_run(run, ReplayOptions(device="cpu", explain=False))
    expected = scenarios.SCENARIOS[name].expected_stage
    exact = same.reproduced and same.diverged_at_step is None
    found = same.origin is not None and same.origin.stage == expected
    agree = answer(same) == answer(other) and other.reproduced
    outcomes = [
        Outcome(f"{label}: replay on {device} bit-exact", exact,
                f"recorded in {recorded:.1f} s; losses of steps {same.setup.first_step}-{same.setup.last_step} "
                + ("equal to the logged ones" if exact else f"differ from step {same.diverged_at_step}")),
        Outcome(f"{label}: origin on {device}", found, f"{answer(same)}, expected stage {expected}"),
        Outcome(f"{label}: replay on cpu gives the same answer", agree,
                f"cpu {answer(other)}; losses within 1e-3: {other.reproduced}"),
    ]
    try:  # the root-cause passes (samples, operation trace) on the device, apart: a failure there hides nothing above
        explained = replay_run(run, ReplayOptions(device=str(device)))
        op, samples = explained.operation, explained.samples
        outcomes.append(Outcome(f"{label}: root cause on {device}", op is not None and samples is not None,
                                f"operation {op.site.op if op else None} in {op.site.module if op else None}, "
                                f"samples {samples.status if samples else None} {samples.samples if samples else ''}"))
    except Exception as e:  # noqa: BLE001 - reported as a failed check
        outcomes.append(Outcome(f"{label}: root cause on {device}", False, f"{e.__class__.__name__}: {e}"))
    return outcomes


def check_batch_copy(device: torch.device, folder: Path, steps: int = 20) -> list[Outcome]:
    """The recorder's copy of a batch on ``device`` (runs/batches.py, ``_arriving``): right, and off the training
    thread's critical path. Each step queues a matrix product chain first (the step's kernels, not yet run when
    ``log`` is called); on the CPU dry run the copy is the plain one."""
    model = scenarios.build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    n = 2048 if device.type == "cuda" else 128  # the dry run's kernels are the CPU's, run before log is called
    work = torch.randn(n, n, device=device)
    expected = []
    with Recorder(folder / "batch_copy", model, optimizer, model_factory=scenarios.build_model,
                  step_fn=scenarios.train_step, checkpoint_every=10**6) as rec:
        for step in range(steps):
            batch = {"x": torch.randn(64, 1024, device=device), "ids": torch.arange(64, device=device) + step}
            expected.append(map_tensors(batch, lambda t: t.to("cpu", copy=True)))
            for _ in range(10):
                work = work @ work / n
            rec.log(step, batch, 0.0)
            batch["x"].fill_(float("nan"))  # the loop reuses its batch tensors: the recorded ones must not change
    exact = all(torch.equal(read_batch(batch_path(folder / "batch_copy", s))[k], expected[s][k])
                for s in range(steps) for k in ("x", "ids"))
    blocking = "blocking .to('cpu')"

    def copied(b: dict[str, torch.Tensor]) -> object:
        return map_tensors(b, lambda t: t.to("cpu", copy=True))
    timings: dict[str, list[float]] = {"log's copy (snapshot)": [], blocking: []}
    big = {"x": torch.randn(1024, 4096, device=device)}  # 16 MB: a copy long enough to time
    for _ in range(steps):
        for name, copy in (("log's copy (snapshot)", snapshot), (blocking, copied)):
            for _ in range(10):
                work = work @ work / n
            started = time.perf_counter()
            copy(big)
            timings[name].append(time.perf_counter() - started)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    median = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in timings.items()}
    return [Outcome("recorder: CUDA batch copied exactly, the loop overwriting it right after log", exact,
                    f"{steps} batch files {'equal to' if exact else 'DIFFER from'} the batches as logged"),
            Outcome("recorder: the batch copy's time on the training thread", True,
                    ", ".join(f"{k} {v:.2f} ms" for k, v in median.items()) + " (median; 16 MB behind queued kernels)")]


def bench(script: str, args: list[str], timeout: int) -> Outcome:
    started = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return Outcome(f"{script} {' '.join(args)}", False, f"timed out after {timeout} s")
    print(f"\n$ python bench/{script} {' '.join(args)}   ({time.perf_counter() - started:.0f} s)\n{p.stdout.rstrip()}")
    return Outcome(f"{script} {' '.join(args)}", p.returncode == 0,
                   "ran" if p.returncode == 0 else f"exit {p.returncode}: {p.stderr.strip()[-500:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="run every part on the CPU (no GPU needed)")
    args = ap.parse_args()
    if args.cpu_dry_run:
        device = torch.device("cpu")
        benches = [("bench_replay.py", ["--device", "cpu", "--rounds", "2", "--steps", "1"], 300),
                   ("bench_transformer.py", ["--device", "cpu", "--batch", "1", "--rounds", "1", "--skip-run"], 300)]
    elif not torch.cuda.is_available():
        print(f"gpu_check: skipped: torch {torch.__version__} sees no CUDA device "
              f"(built with CUDA {torch.version.cuda or 'none'}); --cpu-dry-run runs the same steps on the CPU")
        return 0
    else:
        device = torch.device("cuda")
        benches = [("bench_replay.py", ["--device", "cuda", "--rounds", "15", "--steps", "5"], 150),
                   ("bench_transformer.py", ["--device", "cuda", "--batch", "64", "--rounds", "5"], 240)]
    started = time.perf_counter()
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    print(f"gpu_check on {where}: torch {torch.__version__}, CUDA {torch.version.cuda}, deterministic algorithms, "
          f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}")
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="nf-gpu-check-") as tmp:
        for label, name in CASES.items():
            try:
                outcomes += check_case(label, name, device, Path(tmp))
            except Exception as e:  # noqa: BLE001 - one case failing must not hide the others
                outcomes.append(Outcome(f"{label}: record and replay", False, f"{e.__class__.__name__}: {e}"))
    with tempfile.TemporaryDirectory(prefix="nf-gpu-check-copy-") as tmp:
        try:
            outcomes += check_batch_copy(device, Path(tmp))
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            outcomes.append(Outcome("recorder: CUDA batch copy", False, f"{e.__class__.__name__}: {e}"))
    for script, bench_args, timeout in benches:
        outcomes.append(bench(script, bench_args, timeout))
    print(f"\nsummary ({time.perf_counter() - started:.0f} s in all)")
    for o in outcomes:
        print(f"  {'ok  ' if o.ok else 'FAIL'}  {o.name}: {o.detail}")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
