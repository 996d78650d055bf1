"""Mutation testing of the modules that hold the README's promises, by hand (never in CI's suite).

    python -m scripts.mutate [MODULE...]      # e.g. escaping outputs; none: every module in MODULES

Each module is mutated by mutmut 3 (`pip install -e '.[test,mutation]'`) in a scratch copy of the checkout under the
temporary folder (the checkout itself is never written), and its mutants run only the test files mapped to it below,
in one process (`-n 0`): mutmut forks one child per mutant from a process that already imported torch and the tests,
and each child runs only the tests that reached the mutated function. A survivor is either killed by a test or named
in tests/mutation_equivalents.toml with a one-line reason; an entry whose mutant no longer exists, or no longer makes
the change the entry quotes, is stale and reported, so the file cannot drift from the code. The exit code is 1 while a
mutant survives unexplained or an entry is stale, 0 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.toml"

# module -> the test files that exercise it (a mutant runs those of them whose tests reached its function)
MODULES: dict[str, tuple[str, ...]] = {
    "nanforensics/runs/imports.py": ("tests/test_import_strings.py", "tests/test_import_policy.py",
                                     "tests/test_untrusted_code.py", "tests/test_startup.py"),
    "nanforensics/inputs.py": ("tests/test_reader_refusals.py", "tests/test_trust_io.py", "tests/test_faults.py",
                               "tests/test_buffers.py"),
    "nanforensics/outputs.py": ("tests/test_trust_io.py", "tests/test_faults.py"),
    "nanforensics/views/escaping.py": ("tests/test_escaping.py",),
    "nanforensics/runs/guard.py": ("tests/test_guard.py", "tests/test_guard_reasons.py", "tests/test_guard_proof.py"),
    "nanforensics/replay/proof.py": ("tests/test_proof_facts.py", "tests/test_proof.py", "tests/test_guard_proof.py",
                                     "tests/test_mesh.py::test_an_optimizer_over_a_dtensor_is_not_proven"),
    "nanforensics/checkpoints/soundness.py": ("tests/test_soundness_facts.py", "tests/test_soundness.py",
                                              "tests/test_soundness_order.py"),
    "nanforensics/rootcause/findings.py": ("tests/test_findings_facts.py", "tests/test_findings.py", "tests/test_rootcause.py"),
    "nanforensics/replay/engine.py": ("tests/test_engine_verdicts.py", "tests/test_loss_only.py", "tests/test_replay.py",
                                      "tests/test_proof.py"),
    "nanforensics/report.py": ("tests/test_loss_only.py",),  # loss_only: the rule replay and attribution share
}
# the mutants made and nothing run: `mutmut run`'s first steps (mutmut has no command for them alone)
GENERATE = ("import os, mutmut.__main__ as m; os.makedirs('mutants', exist_ok=True); "
            "m.set_mutant_under_test('mutant_generation'); m.copy_src_dir(); m.copy_also_copy_files(); "
            "m.setup_source_paths(); m.store_lines_covered_by_tests(); m.create_mutants(1)")
# tests that cannot pass on mutmut's copy whatever the mutant: one reads the package's own imports (the trampolines
# import mutmut); one trusts an installed distribution, which points at the checkout, not at the copy. (No test hands
# the machine's own /dev/null to the code under test: a writer's mutant, as root, once replaced it with a regular file;
# the device-node cases use a twin made in the temporary folder.)
DESELECTED = ("tests/test_startup.py::test_the_package_imports_only_what_it_declares",
              "tests/test_import_policy.py::test_a_venv_inside_the_project_is_refused_unless_its_package_is_named")
COPIED = ("nanforensics", "tests", "sample_runs", "README.md", "docs", "pyproject.toml")  # tests read the docs
# a mutant the tests noticed. Not mutmut's "timeout": its limit is a multiple of the statistics' time, and on a loaded
# machine a surviving mutant runs past it (8 of 23 timeouts in one engine run survived): a timed-out mutant is run
# again like a survivor, where only a run HANG times as long as the statistics took for the same tests (at least
# HANG_FLOOR seconds; HANG_UNTIMED where they timed none of them) means the tests hang on it (an endless loop)
KILLED = {"killed", "segfault", "caught by type check"}
HANG, HANG_FLOOR, HANG_UNTIMED = 20, 120, 1800
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


@dataclass
class Tally:
    """One module's mutants by outcome; the survivors not named in the equivalents file are listed."""

    module: str
    mutants: int = 0  # made in the module
    run: int = 0  # of them, run (all, or those of the functions --only names)
    killed: int = 0
    killed_again: int = 0  # of the killed, those mutmut let survive and their second run killed
    equivalent: int = 0
    surviving: list[str] = field(default_factory=list)
    seconds: float = 0.0


def resolve(name: str) -> str:
    """A module of MODULES named by its path or by any unambiguous part of it (`escaping`, `runs/guard`)."""
    hits = [m for m in MODULES if name == m or name in m]
    if len(hits) != 1:
        raise SystemExit(f"mutate: {name!r} names {len(hits)} of the modules {', '.join(MODULES)}; name exactly one")
    return hits[0]


def dotted(module: str) -> str:
    """nanforensics/views/escaping.py -> nanforensics.views.escaping, the prefix of mutmut's mutant names."""
    return module.removesuffix(".py").replace("/", ".")


def selector(module: str, only: str) -> str:
    """mutmut's glob for ``--only``: a function's mutants (``x__checked``: every ``x__checked__mutmut_N``), or the mutants
    a name with its numbers chooses (``x__checked__mutmut_9[0-3]``: 90-93, not 900-939 too)."""
    return f"{dotted(module)}.{only}" + ("" if "__mutmut_" in only else "*")


def scratch_dir(module: str, tests_at: str | None = None) -> Path:
    """Where a module's mutants are made and run (and stay, for `mutmut show` and `mutmut browse` there): one folder
    per checkout, so that two checkouts' runs on one machine (a `--count` here, a run there) never wipe each other's."""
    checkout = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    return (Path(tempfile.gettempdir()) / "nanforensics-mutate" / checkout /
            (dotted(module) + (f"@{tests_at}" if tests_at else "")))


def scratch_copy(module: str, tests_at: str | None = None, tests: Sequence[str] = ()) -> Path:
    """A fresh copy of the checkout's sources and tests with mutmut's configuration for this module alone; the tests
    as the commit ``tests_at`` had them, when given (the same mutants against an earlier suite: a before/after); the
    mutants run ``tests`` when given (files or test ids: the fast ones that should kill them), else the module's."""
    scratch = scratch_dir(module, tests_at)
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for name in COPIED:
        source = ROOT / name
        (shutil.copytree(source, scratch / name, ignore=IGNORED) if source.is_dir() else shutil.copy2(source, scratch / name))
    copy_tests(scratch, tests_at)
    selection = "\n    ".join(tests or MODULES[module])
    deselect = "".join(f"    --deselect\n    {t}\n" for t in DESELECTED)
    (scratch / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = nanforensics\n"
        f"only_mutate = {module}\n"
        f"pytest_add_cli_args_test_selection =\n    {selection}\n"
        # each mutant forked from a server that never ran a test: a child forked from the process that took the statistics
        # (torch's thread pools started, their locks copied as held) waited on a futex forever once past its first
        # tests, so every survivor ran into mutmut's timeout (sixth session: a minute at no CPU, each of them)
        "process_isolation = forkserver\n"
        f"pytest_add_cli_args =\n    -n\n    0\n    -p\n    no:cacheprovider\n{deselect}"
        "also_copy =\n    tests\n    sample_runs\n    README.md\n    docs\n    pyproject.toml\n",
        encoding="utf-8",
    )
    return scratch


def copy_tests(scratch: Path, tests_at: str | None = None) -> None:
    """The scratch copy's tests (and mutmut's copy of them, which the mutants run) as the checkout has them now, or
    as the commit ``tests_at`` had them: a rerun of the survivors after a test was written sees that test."""
    for tests in (scratch / "tests", scratch / "mutants" / "tests"):
        if tests.parent.is_dir():
            shutil.rmtree(tests, ignore_errors=True)
            if tests_at is None:
                shutil.copytree(ROOT / "tests", tests, ignore=IGNORED)
            else:
                archive = subprocess.run(["git", "archive", tests_at, "tests"], cwd=ROOT, capture_output=True,
                                         check=True).stdout
                subprocess.run(["tar", "-x", "-C", str(tests.parent)], input=archive, check=True)


def mutmut(scratch: Path, *args: str) -> str:
    """mutmut's command line in the scratch copy, niced (the machine is shared); its output. A run that could not
    start (the unmutated tests fail, or its statistics could not be collected) is an error, not a result."""
    done = subprocess.run(
        ["nice", sys.executable, "-m", "mutmut", *args], cwd=scratch, text=True, capture_output=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    if done.returncode != 0 or "failed to collect stats" in done.stdout or "Failed to run clean test" in done.stdout:
        raise SystemExit(f"mutate: mutmut {' '.join(args)} failed in {scratch}:\n{done.stdout[-4000:]}{done.stderr[-4000:]}")
    return done.stdout


def statuses(scratch: Path) -> dict[str, str]:
    """mutant name -> mutmut's status, for every mutant of the run."""
    out = mutmut(scratch, "results", "--all", "true")
    return dict(re.findall(r"^\s+(\S+): (.+)$", out, flags=re.MULTILINE))


def added_lines(scratch: Path, name: str) -> list[str]:
    """The lines a mutant puts in the source (its diff's + side), stripped: what an equivalents entry quotes."""
    diff = mutmut(scratch, "show", name)
    return [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]


def load_equivalents() -> dict[str, dict[str, str]]:
    """mutant name -> its entry (name, change: a line the mutant adds, reason) from tests/mutation_equivalents.toml."""
    entries = tomllib.loads(EQUIVALENTS.read_text(encoding="utf-8")).get("equivalent", [])
    return {entry["mutant"]: entry for entry in entries}


def hang_limit(scratch: Path, tests: Sequence[str]) -> float:
    """How long ``tests`` (files or test ids) may run on a mutant before it counts as hanging them: HANG times what the
    unmutated tests took in mutmut's statistics (a survivor on a machine far busier than then stays well under it), at
    least HANG_FLOOR seconds; HANG_UNTIMED where the statistics timed none of them (a whole file beyond ``--tests``)."""
    stats = scratch / "mutants" / "mutmut-stats.json"
    durations = json.loads(stats.read_text(encoding="utf-8"))["duration_by_test"] if stats.is_file() else {}
    timed = [d for test, d in durations.items() if any(test == t or test.startswith(t.rstrip("/") + "::") for t in tests)]
    return max(HANG_FLOOR, HANG * sum(timed)) if timed else HANG_UNTIMED


def killed_by_the_files(scratch: Path, module: str, name: str, first: Sequence[str] = (), files: bool = True) -> bool:
    """Whether the module's whole test files kill the survivor ``name``: mutmut runs a mutant against the tests that
    reached its function while its statistics were taken, and a module fixture that does the work of many tests at
    the first one's setup (test_trust_io's ``results``) credits that one alone, so a survivor is run again, applied
    to the scratch copy's source, against every mapped file (its processes too, through $PYTHONPATH); against the
    tests ``first`` before them, when given (the fast tests written to kill it: a failure there is a kill); against
    those alone without ``files`` (``--quick``: the whole files take minutes a survivor)."""
    source = scratch / module
    original = source.read_bytes()
    mutmut(scratch, "apply", name)
    try:
        deselect = [arg for t in DESELECTED for arg in ("--deselect", t)]
        for tests in ([first] if first else []) + ([MODULES[module]] if files or not first else []):
            try:
                done = subprocess.run(["nice", sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider",
                                       *deselect, *tests], cwd=scratch, capture_output=True,
                                      timeout=hang_limit(scratch, tests),
                                      env={**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"})
            except subprocess.TimeoutExpired:
                return True  # the tests hang on it: noticed
            if done.returncode == 1:
                return True  # tests failed; 0 all passed (it survives), anything else is no verdict
    finally:
        source.write_bytes(original)
    return False


def mutate(module: str, equivalents: dict[str, dict[str, str]], options: argparse.Namespace) -> tuple[Tally, list[str]]:
    """Run one module's mutants (those of the functions ``options.only`` names, when given: mutmut's mangled names,
    such as ``x__checked`` or ``xǁPlacesǁrefusal``, globs allowed; none with ``--count``; the last run's with
    ``--again``, its survivors run again against the tests as they are now); its tally and the stale equivalents
    entries of the module: a mutant no longer made, or no longer making the change quoted, or now killed."""
    started = time.monotonic()
    scratch = scratch_dir(module, options.tests_at)
    if options.again:
        copy_tests(scratch, options.tests_at)
    else:
        scratch = scratch_copy(module, options.tests_at, options.tests)
    if options.count:
        subprocess.run([sys.executable, "-c", GENERATE], cwd=scratch, check=True, capture_output=True)
    elif not options.again:
        mutmut(scratch, "run", "--max-children", str(options.children), *[selector(module, f) for f in options.only])
    tally = Tally(module)
    made = statuses(scratch)
    tally.mutants = len(made)
    found = {name: status for name, status in made.items() if status != "not checked"}
    for name, status in sorted(found.items()):
        tally.run += 1
        if status in KILLED:
            tally.killed += 1
        elif name in equivalents and equivalents[name]["change"].strip() in added_lines(scratch, name):
            tally.equivalent += 1
        elif killed_by_the_files(scratch, module, name, options.tests, files=not options.quick):
            tally.killed += 1
            tally.killed_again += 1
        else:
            tally.surviving.append(f"{name} ({status})")
    stale = []
    for name, entry in equivalents.items():
        if not name.startswith(dotted(module) + "."):
            continue
        if name not in made:
            stale.append(f"{name}: no such mutant ({entry['reason']})")
        elif entry["change"].strip() not in added_lines(scratch, name):
            stale.append(f"{name}: the mutant no longer makes the change {entry['change']!r}")
        elif found.get(name) in KILLED:
            stale.append(f"{name}: now killed ({entry['reason']})")
    tally.seconds = time.monotonic() - started
    return tally, stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.mutate", description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="modules to mutate (a path or part of one); default: all")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument("--tests-at", metavar="COMMIT", help="run the tests as COMMIT had them (the 'before' of a table)")
    parser.add_argument("--children", type=int, default=1, help="mutants run at once (default 1: a shared machine)")
    parser.add_argument("--again", action="store_true",
                        help="tally the last run's results (an interrupted run's too), its survivors run again against "
                             "the tests as they are now (after a test was written for them)")
    parser.add_argument("--count", action="store_true",
                        help="make the mutants and count them, run none; check that each equivalents entry still "
                             "names a mutant making its change")
    parser.add_argument("--tests", action="append", default=[], metavar="TESTS",
                        help="run the mutants against these tests (a file or test id, repeatable) instead of the "
                             "module's files, which still judge each survivor after them (with --again: the survivors "
                             "run these first)")
    parser.add_argument("--quick", action="store_true",
                        help="with --tests: a survivor's second run is against those tests alone, not the whole files "
                             "(what survives is then unjudged by them; the table says so)")
    parser.add_argument("--only", action="append", default=[], metavar="FUNCTION",
                        help="only the mutants of this function (mutmut's name: x_NAME, xǁCLASSǁMETHOD; a glob), repeatable")
    options = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a run stopped by kill restores the survivor's source
    modules = [resolve(name) for name in options.modules] or list(MODULES)
    equivalents = load_equivalents()
    failed = False
    print(f"{'module':<40} {'mutants':>7} {'run':>5} {'killed':>7} {'equiv':>6} {'surviving':>9} {'seconds':>8}")
    for module in modules:
        tally, stale = mutate(module, equivalents, options)
        if options.count:
            print(f"{module:<40} {tally.mutants:>7}", flush=True)
            for line in stale:
                print(f"    stale equivalent: {line}")
            failed |= bool(stale)
            continue
        print(f"{module:<40} {tally.mutants:>7} {tally.run:>5} {tally.killed:>7} {tally.equivalent:>6} {len(tally.surviving):>9} "
              f"{tally.seconds:>8.0f}", flush=True)
        if tally.killed_again:
            print(f"    killed: {tally.killed_again} of them on their second run (--tests, then the whole test files), not by "
                  "the tests mutmut chose")
        for line in tally.surviving:
            print(f"    survived: {line}")
            if options.show:
                print(mutmut(scratch_dir(module, options.tests_at), "show", line.split()[0]))
        for line in stale:
            print(f"    stale equivalent: {line}")
        failed |= bool(tally.surviving or stale)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
