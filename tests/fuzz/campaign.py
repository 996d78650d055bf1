"""The fuzz loop: mutants of every layout, every command of the layout on each, the invariants checked, each crash
classed, minimised and (by hand) kept in ``corpus.json``; figures per layout and command."""

from __future__ import annotations

import json
import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from . import oracle, seeds
from .mutate import Mutation, generate, shrink
from .oracle import Outcome, Workspace

CORPUS = Path(__file__).resolve().parent / "corpus.json"

# Classes being closed on another branch: a regression case of one is kept, expected to fail (strict xfail) until the
# fix is merged, then its row is deleted here and the case and every mutant of the class must pass. class -> (owner,
# what it is); pending_class names the classes. Empty: the eight the fuzzer met in issue 32 are closed on main.
KNOWN_PENDING: dict[str, tuple[str, str]] = {}  # every class the fuzzer met is fixed on main (issue 32)


def pending_class(violation: str, layout: str, mutation: Mutation, mode: str) -> str | None:
    """Which of KNOWN_PENDING's classes a violation belongs to, from its symptom and the mutation that made it."""
    deep = isinstance(mutation.arg, dict) and ("deep" in json.dumps(mutation.arg) or '"nest"' in json.dumps(mutation.arg))
    if violation.startswith("signal: SIGSEGV") or (deep and "RecursionError" in violation):
        return "deep-nested pickle"
    if violation.startswith("hang") and mutation.mutator == "dcp":
        return "quadratic DCP metadata"
    if "UnicodeEncodeError" in violation or violation == "output unbounded":
        return "text in output"
    if "MemoryError" in violation or "allocate" in violation:
        return "memory error unnamed"
    if mode == "module" and violation in ("payload ran", "input changed"):
        return "python -m imports from cwd"
    if violation == "payload ran" and layout == "incident":
        return "code from an enclosing run"
    if violation == "error names a temporary path":
        return "temporary path in an error"
    if violation.startswith("catch-all: OverflowError") or "math domain" in violation:
        return "number out of domain"
    return None


@dataclass
class Crash:
    layout: str
    command: str
    mode: str  # fork (the entry point in a forked child), fork-ascii (its streams ASCII-only), spawn (the console
    # script, LANG=C, PYTHONIOENCODING=ascii), module (python -m nanforensics started in the tree)
    mutation: Mutation
    violation: str  # the first invariant it broke: its class

    def to_json(self) -> dict:
        return {**asdict(self), "mutation": asdict(self.mutation)}

    @classmethod
    def from_json(cls, d: dict) -> Crash:
        return cls(d["layout"], d["command"], d["mode"], Mutation(**d["mutation"]), d["violation"])

    @property
    def pending(self) -> str | None:
        """The KNOWN_PENDING class this crash belongs to; None once its row is deleted (its fix merged)."""
        found = pending_class(self.violation, self.layout, self.mutation, self.mode)
        return found if found in KNOWN_PENDING else None


def _args(layout: seeds.Layout, command: str, ws: Workspace) -> tuple[list[str], list[Path]]:
    """The command line on the workspace, and the outputs it names."""
    args = [a.replace("{in}", str(ws.tree)).replace("{out}", str(ws.out)) for a in layout.commands[command]]
    return [*args, "--quiet"] if command != "report" else args, [Path(a) for a in args if a.startswith(str(ws.out))]


def run_one(layout: seeds.Layout, command: str, mode: str, ws: Workspace, before: dict[str, str],
            target: str, time_limit: float = oracle.TIME_LIMIT_S) -> tuple[Outcome, list[str]]:
    """One command on the prepared workspace: its outcome and the invariants it broke. The outputs, cwd and $TMPDIR
    are emptied first."""
    for d in (ws.out, ws.cwd, ws.tmp):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    ws.sentinel.unlink(missing_ok=True)
    args, outputs = _args(layout, command, ws)
    if mode in ("fork", "fork-ascii"):
        outcome = oracle.run_fork(args, ws, ascii_streams=mode == "fork-ascii", time_limit=time_limit)
    else:
        outcome = oracle.run_spawn(args, ws, module_in_tree=mode == "module", time_limit=time_limit)
    return outcome, oracle.violations(command, outcome, ws, before, outputs, target)


def warm(seed_trees: dict[str, Path], scratch: Path, layouts: list[seeds.Layout]) -> list[str]:
    """Every command once on every unmutated seed, in this process: the imports a command does lazily are done
    here once, not again in every forked child; and a seed must itself keep every invariant (returned if not)."""
    from cli_inprocess import call
    from conftest import cli_command, cli_env

    broken = []
    for layout in layouts:
        ws = Workspace(scratch / "warm")
        ws.make(seed_trees[layout.name])
        before = oracle.digest(ws.tree)
        for command in layout.commands:
            args, outputs = _args(layout, command, ws)
            code, out, err = call(cli_command()[0], args, cli_env(), ws.cwd, timeout=300)
            found = oracle.violations(command, Outcome(code, out, err), ws, before, outputs, "")
            broken += [f"seed {layout.name} {command}: {v}" for v in found]
            for d in (ws.out, ws.cwd, ws.tmp):
                shutil.rmtree(d)
                d.mkdir()
        ws.remove()
    return broken


def reproduce(crash: Crash, seed_trees: dict[str, Path], scratch: Path,
              time_limit: float = oracle.TIME_LIMIT_S) -> list[str]:
    """The invariants a kept case breaks now (empty: it holds)."""
    ws = Workspace(scratch / "case")
    ws.make(seed_trees[crash.layout])
    try:
        crash.mutation.apply(ws.tree)
        before = oracle.digest(ws.tree)
        _, found = run_one(seeds.BY_NAME[crash.layout], crash.command, crash.mode, ws, before, crash.mutation.target,
                           time_limit)
        return found
    finally:
        ws.remove()


def minimise(crash: Crash, seed_trees: dict[str, Path], scratch: Path, tries: int = 12) -> Crash:
    """The smallest variant of the crash's mutation (sizes, depths, counts lowered) that still breaks the same
    invariant."""
    for _ in range(tries):
        for smaller in shrink(crash.mutation):
            candidate = Crash(crash.layout, crash.command, crash.mode, smaller, crash.violation)
            if crash.violation in reproduce(candidate, seed_trees, scratch):
                crash = candidate
                break
        else:
            break
    return crash


@dataclass
class Figures:
    mutants: Counter = field(default_factory=Counter)  # (layout, command) -> mutants run
    exits: Counter = field(default_factory=Counter)  # (command, exit code) -> calls
    crashes: list[Crash] = field(default_factory=list)
    skipped: int = 0  # mutations the mutator could not apply (a seed it does not fit)
    seconds: float = 0.0
    calls: Counter = field(default_factory=Counter)  # mode -> calls
    time: Counter = field(default_factory=Counter)  # (layout, command) -> seconds its calls took

    def by_class(self) -> Counter:
        """(violation, the pending class it belongs to or None) -> crashes."""
        return Counter((c.violation, c.pending) for c in self.crashes)

    def lines(self) -> list[str]:
        out = [f"{sum(self.mutants.values())} command runs on mutants in {self.seconds:.1f} s "
               f"({', '.join(f'{n} {m}' for m, n in sorted(self.calls.items()))}); {self.skipped} draws refitted",
               "runs by layout and command:"]
        out += [f"  {layout:<12} {command:<11} {n:>6}  {self.time[layout, command]:8.1f} s"
                for (layout, command), n in sorted(self.mutants.items())]
        out.append("exit codes by command: " + ", ".join(f"{c} {code}: {n}" for (c, code), n in sorted(self.exits.items(),
                                                                                                   key=str)))
        out.append(f"crashes: {len(self.crashes)}")
        for (violation, pending), n in self.by_class().most_common():
            tag = f" [pending: {KNOWN_PENDING[pending][0]}, {pending}]" if pending else ""
            out.append(f"  {n:>4}  {violation}{tag}")
        return out


def fuzz(seed_trees: dict[str, Path], scratch: Path, *, mutants: int, seed: int = 0, spawn_every: int = 0,
         layouts: list[str] | None = None, time_limit: float = oracle.TIME_LIMIT_S,
         progress: Callable[[str], None] | None = None) -> Figures:
    """``mutants`` mutants, the layouts taken in turn, every command of a layout on each; every 4th call's output
    streams ASCII-only. ``spawn_every``: every n-th call runs the console script as a fresh process (LANG=C, ascii
    streams) instead of the forked entry point, and every 2n-th ``python -m nanforensics`` from inside the tree."""
    figures = Figures()
    start = time.monotonic()
    chosen = [seeds.BY_NAME[n] for n in (layouts or [lay.name for lay in seeds.LAYOUTS])]
    for line in warm(seed_trees, scratch, chosen):
        raise AssertionError(line)
    calls = 0
    for i in range(mutants):
        layout = chosen[i % len(chosen)]
        rng = random.Random(f"{seed}:{i}")
        ws = Workspace(scratch / f"m{i % 2}")
        for _ in range(5):  # a mutator that does not fit its draw (a path into a tensor) draws again
            ws.make(seed_trees[layout.name])
            try:
                mutation = generate(rng, ws.tree)
                break
            except Exception:
                figures.skipped += 1
        else:
            ws.remove()
            continue
        before = oracle.digest(ws.tree)
        for command in layout.commands:
            calls += 1
            mode = "fork-ascii" if calls % 4 == 0 else "fork"
            if spawn_every and calls % spawn_every == 0:
                mode = "module" if calls % (2 * spawn_every) == 0 else "spawn"
            outcome, found = run_one(layout, command, mode, ws, before, mutation.target, time_limit)
            figures.mutants[layout.name, command] += 1
            figures.time[layout.name, command] += outcome.seconds
            figures.calls[mode] += 1
            figures.exits[command, outcome.code if outcome.signal is None else f"sig{outcome.signal}"] += 1
            if found:
                crash = Crash(layout.name, command, mode, mutation, found[0])
                figures.crashes.append(crash)
                if progress:
                    progress(f"crash #{len(figures.crashes)} {layout.name} {command} {mode}: {found[0]} <- "
                             f"{mutation.describe()}")
                if "input changed" in found:
                    ws.make(seed_trees[layout.name])
                    mutation.apply(ws.tree)
                    before = oracle.digest(ws.tree)
        ws.remove()
        if progress and (i + 1) % 50 == 0:
            progress(f"{i + 1} mutants, {time.monotonic() - start:.0f} s, {len(figures.crashes)} crashes")
    figures.seconds = time.monotonic() - start
    return figures


def load_corpus() -> list[Crash]:
    return [Crash.from_json(d) for d in json.loads(CORPUS.read_text())] if CORPUS.exists() else []


def save_corpus(cases: list[Crash]) -> None:
    CORPUS.write_text(json.dumps([c.to_json() for c in cases], indent=1, ensure_ascii=True) + "\n")
