"""Time to a one-line error on bad input, against ``nanforensics --version``: every check that needs no tensor runs
before torch is imported (issue 25, target: under 0.5 s).

    python bench/bench_startup.py [--rounds 7]

Each case runs the real console script (``python -m nanforensics`` where none is installed) in a child process,
interleaved with the others over ``--rounds``; printed: the median wall time and the median CPU time (user + system,
``os.wait4``: that child alone; on a machine other jobs load, wall time waits for a core and CPU time does not), and
whether the child imported torch (``-X importtime``, a separate run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli() -> list[str]:
    script = Path(sys.executable).parent / "nanforensics"
    return [str(script)] if script.exists() else [sys.executable, "-m", "nanforensics"]


def timed(args: list[str]) -> tuple[float, float, int, str]:
    """(wall seconds, CPU seconds, exit code, stderr) of one child."""
    start = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stderr is not None
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status), err


def imports_torch(args: list[str]) -> bool:
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "nanforensics", *args[len(cli()):]],
                       capture_output=True, text=True, cwd=ROOT)
    return any(line.rstrip().endswith("| torch") for line in p.stderr.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="nf-bench-startup-") as tmp:
        fifo, empty = Path(tmp) / "fifo", Path(tmp) / "run"
        os.mkfifo(fifo)
        empty.mkdir()
        run = ROOT / "sample_runs" / "seed_adam"
        cases = {"--version": [*cli(), "--version"],
                 "replay: no such run directory": [*cli(), "replay", str(Path(tmp) / "missing")],
                 "replay: no manifest": [*cli(), "replay", str(empty)],
                 "scan: a FIFO": [*cli(), "scan", str(fifo)],
                 "replay: --json over an input": [*cli(), "replay", str(run), "--json", str(run / "manifest.json")]}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for name, command in cases.items():
                wall, cpu, code, err = timed(command)
                if name != "--version":
                    lines = err.strip().splitlines()
                    assert code == 2 and len(lines) == 1, (name, code, err)
                times[name].append((wall, cpu))
        torch_loaded = {name: imports_torch(command) for name, command in cases.items()}
    base_wall = statistics.median(w for w, _ in times["--version"])
    base_cpu = statistics.median(c for _, c in times["--version"])
    print(f"{'':<34}{'wall':>8}{'CPU':>8}   vs --version (wall, CPU)   torch imported   target < 0.5 s")
    for name, pairs in times.items():
        wall, cpu = statistics.median(w for w, _ in pairs), statistics.median(c for _, c in pairs)
        target = "" if name == "--version" else ("met" if wall < 0.5 else f"not met (CPU {'<' if cpu < 0.5 else '>='}"
                                                                           " 0.5 s)")
        print(f"{name:<34}{wall:7.2f}s{cpu:7.2f}s   {wall / base_wall:5.2f}x {cpu / base_cpu:5.2f}x"
              f"{'yes' if torch_loaded[name] else 'no':>20}   {target}")
    print(f"rounds: {args.rounds}, medians; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
