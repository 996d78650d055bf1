"""The figures of issue 14 on the model users train: a 14M-parameter decoder-only transformer with AdamW.

    python bench/bench_transformer.py [--batch 8] [--rounds 5] [--run-batch 64] [--device cpu|cuda] [--clock wall|cpu]

Model: ``scenarios.Decoder(vocab=8192, seq_len=128, d_model=384, n_head=6, n_layer=6)`` (causal
self-attention, LayerNorm, a tied head; tests/scenarios.py), AdamW, right-padded token batches,
2 threads on CPU. Printed, each with its target:
1. the monitored replay step (StepMonitor, detect mode), ``detect_anomaly(check_nan=True)`` and the
   recorder (``Recorder.log`` after the step, timed until its writer thread is done; checkpoints
   excluded) against a plain training step, interleaved over ``--rounds`` at batch ``--batch``
   (benchlib.py);
2. a run recorded in a child process (batch ``--run-batch``, one sample fully padded at step 18:
   softmax of a fully masked row is NaN, AdamW writes it into every moment), then replayed by the
   real CLI entry point (``cli.main``) in another child: the whole ``nanforensics replay`` wall time
   over its 20-step window against the recording's own time for the same steps, and where the replay's
   time goes, phase by phase (the child times the library's functions it calls, outermost first);
   the peak RSS of each child (``os.wait4``: that child alone);
3. sample attribution on that step: the replay's passes, started from the origin's coordinates; with
   ``--halving``, also without them (probing and halving), in this process through the library, passes
   and seconds against the recording's time for one step at that batch size.
The provenance trace of the responsible step has its own bench (bench/bench_provenance.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()  # before torch is imported: a replay child's start-up

import torch  # noqa: E402
from benchlib import interleaved, paired_ratio, synced, verdict  # noqa: E402
from nanforensics import Recorder  # noqa: E402
from nanforensics.replay.monitor import StepMonitor  # noqa: E402
from nanforensics.runs.batches import map_tensors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import scenarios  # noqa: E402 - the test scenarios, outside the installed package

MODEL = {"vocab": 8192, "seq_len": 128, "d_model": 384, "n_head": 6, "n_layer": 6}
STEPS, DEFECT_STEP = 20, 18  # the replay's window: steps 0-19 (the step after the whole model went NaN)


def batch(step: int, size: int, device: torch.device, defect: str | None = None) -> dict[str, Any]:
    b = scenarios.make_token_batch(step, 0, defect, batch_size=size, seq_len=MODEL["seq_len"], vocab=MODEL["vocab"])
    return map_tensors(b, lambda t: t.to(device))


def step_overhead(device: torch.device, size: int, rounds: int, clock: str) -> None:
    model = scenarios.build_decoder(**MODEL).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = batch(0, size, device)
    monitor = StepMonitor(model, optimizer)

    def plain() -> None:
        scenarios.train_step_lm(model, optimizer, b)

    def monitored() -> None:
        with monitor:
            monitor.begin(0, b, locate=False)
            assert not monitor.end(scenarios.train_step_lm(model, optimizer, b))

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            plain()

    recorder = Recorder(Path(tempfile.mkdtemp(prefix="nf-bench-transformer-")) / "run", model, optimizer,
                        model_factory="scenarios:build_decoder", model_kwargs=MODEL,
                        step_fn="scenarios:train_step_lm", checkpoint_every=10**9)
    logged = [0]

    def recorded() -> None:
        recorder.log(logged[0], b, scenarios.train_step_lm(model, optimizer, b))
        logged[0] += 1
        recorder._writer._queue.join()  # the writer's work is the recorder's cost: none left to the next variant

    variants = {k: synced(device, fn) for k, fn in (("plain", plain), ("monitored", monitored),
                                                    ("detect_anomaly", anomaly), ("recorder", recorded))}
    interleaved(variants, 1)  # warm-up: AdamW's state, the allocator
    times = interleaved(variants, rounds, clock=clock)
    recorder.close()
    shutil.rmtree(recorder.path.parent)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: decoder {MODEL}, {params / 1e6:.1f}M parameters, AdamW, {device}, "
          f"{torch.get_num_threads()} threads")
    print(f"\n1. one training step at batch {size} x {MODEL['seq_len']} tokens, {rounds} rounds interleaved, {clock} clock")
    anomaly_ratio = paired_ratio(times, "detect_anomaly")[0]
    for name in variants:
        r, q1, q3 = paired_ratio(times, name)
        line = f"  {name:<16}{statistics.median(times[name]):8.3f} s {r:7.3f}x  ({q1:.3f}-{q3:.3f})"
        if name == "monitored":
            line += f"  target <= 1.10 and < detect_anomaly: {verdict(r <= 1.10 and r < anomaly_ratio)}"
        elif name == "recorder":
            line += f"  target <= 1.05: {verdict(r <= 1.05)}"
        print(line)


# ---- the recording, in a child process -----------------------------------------------------------------------


def record_child(run_dir: Path, size: int, device_name: str) -> None:
    """Train STEPS steps under the recorder; print the seconds of each step (step and ``Recorder.log``)."""
    torch.set_num_threads(2)
    device = torch.device(device_name)
    model = scenarios.build_decoder(**MODEL).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seconds, cpu = [], []
    with Recorder(run_dir, model, optimizer, model_factory="scenarios:build_decoder", model_kwargs=MODEL,
                  step_fn="scenarios:train_step_lm", checkpoint_every=10**9) as rec:
        for step in range(STEPS):
            b = batch(step, size, device, "fully_padded" if step == DEFECT_STEP else None)
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = scenarios.train_step_lm(model, optimizer, b)
            rec.log(step, b, loss)
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    print(json.dumps({"step_seconds": seconds, "step_cpu": cpu}))


def child(args: list[str], env: dict[str, str]) -> tuple[float, float, str, float]:
    """(wall seconds, peak RSS in MB of that child alone, stdout, its CPU seconds)."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
        assert p.stderr is not None
        err = p.stderr.read()
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - start
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if p.returncode not in (0, 1):  # replay exits 1 when it found the culprit
        raise SystemExit(f"{' '.join(args)} exited {p.returncode}: {err.strip()[-2000:]}")
    return wall, usage.ru_maxrss / 1024, text, usage.ru_utime + usage.ru_stime  # ru_maxrss is in KiB on Linux


# The replay's phases: the library functions the replay calls, timed where they are looked up. Only the outermost
# one running is charged (sample attribution restores snapshots: its own time, not "snapshots").
PHASES = [("nanforensics.replay.engine", "open_session", "open the session (build, load the checkpoint)"),
          ("nanforensics.replay.engine", "_checkpoint_finite", "scan the start checkpoint"),
          ("nanforensics.replay.engine", "check_batches", "check the logged batches"),
          ("nanforensics.replay.amp.AmpLog", "run_step", "monitored steps, detect mode"),
          ("nanforensics.replay.session.Session", "snapshot", "snapshots of the state before each step"),
          ("nanforensics.replay.session.Session", "restore", "restoring a snapshot"),
          ("nanforensics.replay.session.Session", "advance_to", "plain steps up to the origin (a fresh session)"),
          ("nanforensics.replay.session.Session", "run_step", "plain steps (the rewind from an older checkpoint)"),
          ("nanforensics.replay.engine", "trace_step", "the operation trace of the responsible step"),
          ("nanforensics.replay.engine", "attribute_samples", "sample attribution"),
          ("nanforensics.replay.engine", "compare_checkpoint", "comparing with a recorded checkpoint")]


LOCATED = "monitored steps, locate mode (the flagged step again, and those after it)"


def replay_child(run_dir: Path, report_path: Path, device: str, started: float) -> None:
    """The whole ``nanforensics replay`` through the CLI's entry point, each phase timed; prints the phases'
    seconds as JSON (``started``: when this process began, before torch was imported)."""
    import importlib

    from nanforensics import cli

    spent: dict[str, float] = {name: 0.0 for *_, name in PHASES} | {LOCATED: 0.0}
    running: list[str] = []

    def timed(fn: Any, phase: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if running:
                return fn(*args, **kwargs)
            # AmpLog.run_step(session, monitor, locate): a step re-run to read each first non-finite value apart
            name = LOCATED if phase == "monitored steps, detect mode" and args[-1] is True else phase
            running.append(name)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
                running.pop()
        return wrapper

    for where, attr, name in PHASES:
        path, _, owner = where.rpartition(".") if where.rsplit(".", 1)[-1][:1].isupper() else (where, "", "")
        holder = getattr(importlib.import_module(path), owner) if owner else importlib.import_module(path)
        setattr(holder, attr, timed(getattr(holder, attr), name))
    imported = time.perf_counter()
    sys.argv = ["nanforensics", "replay", str(run_dir), "--device", device, "--json", str(report_path)]
    try:
        cli.main()
    except SystemExit as e:
        if e.code not in (0, 1, None):
            raise
    done = time.perf_counter()
    spent["start-up (python, torch, nanforensics imported)"] = imported - started
    spent["the rest (report, findings, writing)"] = done - imported - sum(v for k, v in spent.items()
                                                                         if not k.startswith("start-up"))
    print(json.dumps(spent))


def replay_and_attribution(device: torch.device, size: int, halving: bool) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="nf-bench-transformer-") as tmp:
        run, report_path = Path(tmp) / "run", Path(tmp) / "replay.json"
        rec_wall, rec_rss, out, _ = child([sys.executable, __file__, "--record-child", str(run), "--run-batch",
                                           str(size), "--device", str(device)], env)
        recording = json.loads(out.strip().splitlines()[-1])
        replay_wall, replay_rss, out, replay_cpu = child([sys.executable, __file__, "--replay-child", str(run),
                                                          str(report_path), "--device", device.type], env)
        phases = json.loads(out.strip().splitlines()[-1])
        report = json.loads(report_path.read_text())
        first, last = report["setup"]["first_step"], report["setup"]["last_step"]
        recorded = sum(recording["step_seconds"][first:last + 1])
        recorded_cpu = sum(recording["step_cpu"][first:last + 1])
        halved = attribution(run, report["responsible_step"], device) if halving else None

    ratio, cpu_ratio = replay_wall / recorded, replay_cpu / recorded_cpu
    plain = statistics.median(recording["step_seconds"])
    print(f"\n2. a run of {STEPS} steps at batch {size} (sample {scenarios.DEFECT_SAMPLE} fully padded at step "
          f"{DEFECT_STEP}), recorded and replayed through the CLI's entry point in child processes")
    print(f"  verdict {report['verdict']}, responsible step {report['responsible_step']} "
          f"({report['origin']['stage']} {report['origin']['tensor']}), steps {first}-{last} replayed")
    print(f"  recording, steps {first}-{last}    {recorded:8.1f} s wall {recorded_cpu:8.1f} s CPU  ({plain:.2f} s a step, "
          f"Recorder.log included; the child ran {rec_wall:.1f} s in all)")
    print(f"  nanforensics replay, whole  {replay_wall:8.1f} s wall {replay_cpu:8.1f} s CPU  = {ratio:.2f}x the recording "
          f"(wall), {cpu_ratio:.2f}x (CPU); target <= 1.5: {verdict(max(ratio, cpu_ratio) <= 1.5)}")
    print("  where the replay's wall time goes:")
    for name, t in sorted(phases.items(), key=lambda kv: -kv[1]):
        if t >= 0.05:
            print(f"    {name:<52}{t:8.1f} s  {t / plain:6.2f} recorded steps")
    s = report["samples"]
    print(f"  peak RSS: training loop {rec_rss:.0f} MB, replay {replay_rss:.0f} MB = {replay_rss / rec_rss:.2f}x; "
          f"target (proposed) <= 1.5: {verdict(replay_rss <= 1.5 * rec_rss)}")
    print(f"\n3. sample attribution at batch {size}, started from the origin's coordinates: {s['status']}, samples "
          f"{s['samples']}, {s['passes']} passes; target <= 3: {verdict(s['passes'] <= 3)}")
    if halved is not None:
        seconds, passes, found = halved
        bound = 1 + 2 * math.ceil(math.log2(size))  # 1 + 2k log2(B), k = 1 bad sample (bench_samples.py)
        print(f"  without them (probing and halving): {passes} passes (bound 1 + 2 log2 {size} = {bound} and one probe), "
              f"{seconds:.1f} s = {seconds / plain:.2f} recorded steps; found samples {found}")


def attribution(run_dir: Path, step: int, device: torch.device) -> tuple[float, int, list[int]]:
    """Seconds, passes and samples of ``attribute_samples`` on the responsible step, as replay runs it."""
    from nanforensics.replay.session import Session, pinned_threads
    from nanforensics.rootcause.samples import attribute_samples
    from nanforensics.runs.run import Run, UserCode

    run = Run(run_dir)
    with pinned_threads(run.manifest.num_threads if device.type == "cpu" else None):
        session = Session(run, UserCode.load(run), run.checkpoints()[0], device)
        session.advance_to(step)
        start = time.perf_counter()
        result = attribute_samples(session)
        return time.perf_counter() - start, result.passes, result.samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="batch size of the step-overhead part")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--run-batch", type=int, default=64, help="batch size of the recorded run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time, part 1 (benchlib.py)")
    ap.add_argument("--skip-run", action="store_true", help="only the step overhead (part 1)")
    ap.add_argument("--only-run", action="store_true", help="only the recorded run and its replay (parts 2 and 3)")
    ap.add_argument("--halving", action="store_true", help="part 3 also attributes samples without the coordinates")
    ap.add_argument("--record-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--replay-child", type=Path, nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replay_child:
        replay_child(*args.replay_child, args.device, STARTED)
        return
    if args.record_child:
        record_child(args.record_child, args.run_batch, args.device)
        return
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*Anomaly Detection has been enabled.*")
    device = torch.device(args.device)
    if not args.only_run:
        step_overhead(device, args.batch, args.rounds, args.clock)
    if not args.skip_run:
        replay_and_attribution(device, args.run_batch, args.halving)
    print("\nthe provenance trace of the responsible step against detect_anomaly: bench/bench_provenance.py")


if __name__ == "__main__":
    main()
