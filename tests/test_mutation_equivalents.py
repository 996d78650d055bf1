"""tests/mutation_equivalents.toml, the mutants named equivalent instead of killed: each entry one mutant of a module
that ``python -m scripts.mutate`` mutates, the line it adds, and a one-line reason. Whether the mutant still exists
and survives is for the mutation command (it runs the mutants); this keeps the file readable by it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import tomllib

from conftest import ROOT


def _mutate() -> ModuleType:
    """scripts/mutate.py, loaded as a file (scripts/ is no package the tests import)."""
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    mutate = sys.modules["mutate"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
    try:
        spec.loader.exec_module(mutate)
    finally:
        del sys.modules["mutate"]
    return mutate


def test_each_equivalent_names_a_mutant_of_a_mutated_module_its_change_and_one_reason():
    mutate = _mutate()
    entries = tomllib.loads(mutate.EQUIVALENTS.read_text(encoding="utf-8"))["equivalent"]
    prefixes = tuple(mutate.dotted(m) + "." for m in mutate.MODULES)
    assert entries and len({e["mutant"] for e in entries}) == len(entries)  # one entry per mutant
    for e in entries:
        assert set(e) == {"mutant", "change", "reason"}, e
        assert e["mutant"].startswith(prefixes) and "__mutmut_" in e["mutant"], e["mutant"]
        assert all(isinstance(v, str) and v.strip() and "\n" not in v for v in e.values()), e


def test_only_chooses_a_functions_mutants_or_the_numbered_ones_alone():
    """``--only x__skip`` is every mutant of the function; ``--only x__skip__mutmut_9`` is mutant 9 alone, not 90-99."""
    mutate = _mutate()
    assert mutate.selector("nanforensics/runs/guard.py", "x__skip") == "nanforensics.runs.guard.x__skip*"
    assert mutate.selector("nanforensics/runs/guard.py", "x__skip__mutmut_9") == "nanforensics.runs.guard.x__skip__mutmut_9"
    assert mutate.selector("nanforensics/report.py", "x_to_json__mutmut_1[0-3]") == "nanforensics.report.x_to_json__mutmut_1[0-3]"


def test_a_survivor_hangs_past_twenty_times_what_its_tests_took(tmp_path: Path):
    """The second run's limit: 20 times the statistics' time of the tests it runs (a file's tests, or one test's), at
    least 120 s; half an hour where the statistics timed none of them."""
    mutate = _mutate()
    stats = tmp_path / "mutants" / "mutmut-stats.json"
    stats.parent.mkdir()
    stats.write_text(json.dumps({"duration_by_test": {"tests/a.py::t1": 6.0, "tests/a.py::t2": 5.0, "tests/ab.py::t": 1.0}}))
    assert mutate.hang_limit(tmp_path, ["tests/a.py"]) == 220.0  # not tests/ab.py's
    assert mutate.hang_limit(tmp_path, ["tests/a.py::t2", "tests/ab.py"]) == 120.0  # 20 * (5 + 1) s
    assert mutate.hang_limit(tmp_path, ["tests/ab.py::t"]) == 120.0  # 20 * 1 s, under the floor
    assert mutate.hang_limit(tmp_path, ["tests/c.py"]) == mutate.HANG_UNTIMED == 1800
    assert mutate.hang_limit(tmp_path / "elsewhere", ["tests/a.py"]) == 1800  # no statistics at all
