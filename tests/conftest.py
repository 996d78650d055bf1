"""Shared fixtures: tiny real runs recorded by the project's own recorder, and the CLI through its real entry point."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import pytest
import torch

import scenarios

# Where a run blown up by its learning rate first overflows depends on the summation order, so on the thread
# count: the runs recorded here use one thread on any machine (the replays restore what the manifest records).
# One thread a process also because the suite runs one pytest-xdist worker per core: two workers of two threads
# each (and the CLI and torchrun processes they start) oversubscribe the cores, and the OpenMP threads that wait
# for one spin. On 2 cores that took the suite from 6.8 to 8.7 minutes (README, Tests).
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"  # the processes the tests start (a replay still pins its manifest's count)
# Each process a test starts (a CLI call, a torchrun rank, a recording job) imports the package: compiling it takes
# 0.7 s of CPU where no bytecode is kept (PYTHONDONTWRITEBYTECODE, a fresh checkout), two minutes over the suite. Their
# bytecode is kept under the temporary folder instead, never beside the sources (so never in sample_runs/ either).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), f"nanforensics-tests-bytecode-{os.getuid()}")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository: README, sample_runs/
DEFECT_STEP = 17
STEPS = 24


def cli_command() -> list[str]:
    """The installed console script when there is one (the real entry point), else ``python -m``."""
    script = Path(sys.executable).parent / "nanforensics"
    return [str(script)] if script.exists() else [sys.executable, "-m", "nanforensics"]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def cli_env(columns: int = 160, **extra: str) -> dict[str, str]:
    """The environment a CLI call runs in: this one, with the scenarios the test runs were recorded with
    (``scenarios:build_model``) on the path as a user's installed package would be, no colours, the log's width."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "PYTHONPATH": path, **extra}
    env.pop("NANFORENSICS_DEBUG", None)
    return env


def run_cli(*args: str | Path, cwd: Path | None = None, wrapper: Sequence[str] = (), columns: int = 160,
            process: bool = False) -> Result:
    """The CLI through its real entry point, ``nanforensics.cli.main``, in this process (``cli_inprocess``): what a
    process would write and its exit code. ``process``: the installed console script as a process instead, for tests
    of what only a process has (signals, hangs, sys.path at start-up); ``wrapper`` prefixes its command line
    (``setpriv ...``: the CLI without root's permission override) and implies it; ``columns`` is $COLUMNS, the width
    of the log the output goes to. ``--cli-process`` runs every call as a process. Under torchrun's variables (a test
    that sets RANK and WORLD_SIZE) the CLI ends its process itself (``os._exit``): a process too."""
    if process or wrapper or ALL_PROCESSES or {"RANK", "WORLD_SIZE"} <= os.environ.keys():
        return run_cli_process(*args, cwd=cwd, wrapper=wrapper, columns=columns)
    from cli_inprocess import call

    return Result(*call(cli_command()[0], [str(a) for a in args], cli_env(columns), cwd, timeout=TIMEOUT_S))


def run_cli_process(*args: str | Path, cwd: Path | None = None, wrapper: Sequence[str] = (), columns: int = 160) -> Result:
    """The installed console script (or ``python -m nanforensics``) as a process, as a user runs it."""
    p = subprocess.run([*wrapper, *cli_command(), *map(str, args)], capture_output=True, text=True,
                       env=cli_env(columns), cwd=cwd, timeout=TIMEOUT_S)
    return Result(p.returncode, p.stdout, p.stderr)


ALL_PROCESSES = False  # --cli-process
TIMEOUT_S = 300  # a CLI call that runs longer (a hang) fails its test


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cli-process", action="store_true",
                     help="run every CLI call of the tests as a process of the console script (slower; the "
                          "in-process calls' check)")


def pytest_configure(config: pytest.Config) -> None:
    global ALL_PROCESSES
    ALL_PROCESSES = bool(config.getoption("--cli-process"))


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root with its content hash and mode: equal digests mean an untouched folder."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest() + oct(p.stat().st_mode)
    return out


ANNOUNCEMENT = "nanforensics: run code: "  # the run's import strings, shown before any is imported
PROGRESS = re.compile(r"^nanforensics: \[[a-z -]+\] ")  # progress lines in a log: views/progress.py's prefix()


def error_lines(stderr: str) -> list[str]:
    """stderr without the line that announces the run's code, nor the progress lines."""
    return [line for line in stderr.strip().splitlines() if not line.startswith(ANNOUNCEMENT) and not PROGRESS.match(line)]


def assert_one_line_error(result: Result, *needles: str) -> None:
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


class RecordedRuns(Mapping[str, Path]):
    """One recorded run per scenario, recorded when a test first asks for it, once per test session: pytest-xdist's
    workers share the folder, and a lock per scenario makes the first to ask record it while the others wait."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def __getitem__(self, name: str) -> Path:
        if name not in scenarios.SCENARIOS:
            raise KeyError(name)
        path = self.root / name
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.is_dir():
                building = self.root / f".{name}.{os.getpid()}"
                shutil.rmtree(building, ignore_errors=True)
                _record(building, name)
                building.rename(path)
        return path

    def __iter__(self) -> Iterator[str]:
        return iter(scenarios.SCENARIOS)

    def __len__(self) -> int:
        return len(scenarios.SCENARIOS)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Mapping[str, Path]:
    """One recorded run per scenario, the defect at step 17, checkpoints every 10 steps; see ``RecordedRuns``."""
    base = tmp_path_factory.getbasetemp()  # an xdist worker's lies in the session's, which the workers share
    return RecordedRuns((base.parent if hasattr(request.config, "workerinput") else base) / "recorded-runs")


def _record(path: Path, name: str) -> Path:
    scenarios.record(path, name, steps=STEPS, defect_step=DEFECT_STEP, checkpoint_every=10)
    return path


@pytest.fixture
def copy_run(tmp_path: Path, runs: Mapping[str, Path]):
    """A private copy of a recorded run, for tests that damage it."""
    def make(name: str) -> Path:
        dest = tmp_path / name
        shutil.copytree(runs[name], dest)
        return dest
    return make


FAULT_CASE = "fault_case"  # a user property of tests/test_faults.py's cases: (command, class of fault)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fault suite's cases passed and tried, by command and by class of fault, at the end of the session.

    Counted from the test reports' user properties, so the summary is whole under pytest-xdist too, where a
    worker's own output never reaches the terminal."""
    tried: Counter[str] = Counter()
    passed: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for outcome in ("passed", "failed"):
        for report in terminalreporter.stats.get(outcome, []):
            case = dict(getattr(report, "user_properties", ())).get(FAULT_CASE)
            if case is None or report.when != "call":
                continue
            command, kind = case
            tried[command] += 1
            if outcome == "passed":
                passed[command] += 1
                kinds[kind] += 1
    if not tried:
        return
    write = terminalreporter.write_line
    write("damaged inputs by command (passed/tried):")
    for command in sorted(tried):
        write(f"  {command:<11} {passed[command]}/{tried[command]}")
    write(f"  {'all':<11} {sum(passed.values())}/{sum(tried.values())}")
    write("cases passed by class of fault:")
    for kind, n in sorted(kinds.items()):
        write(f"  {kind:<30} {n}")
