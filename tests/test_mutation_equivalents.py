"""tests/mutation_equivalents.toml, the mutants named equivalent instead of killed: each entry one mutant of a module
that ``python -m scripts.mutate`` mutates, the line it adds, and a one-line reason. Whether the mutant still exists
and survives is for the mutation command (it runs the mutants); this keeps the file readable by it."""

from __future__ import annotations

import importlib.util
import sys

import tomllib

from conftest import ROOT


def test_each_equivalent_names_a_mutant_of_a_mutated_module_its_change_and_one_reason():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    assert spec is not None and spec.loader is not None
    mutate = sys.modules["mutate"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up there
    try:
        spec.loader.exec_module(mutate)
    finally:
        del sys.modules["mutate"]
    entries = tomllib.loads(mutate.EQUIVALENTS.read_text(encoding="utf-8"))["equivalent"]
    prefixes = tuple(mutate.dotted(m) + "." for m in mutate.MODULES)
    assert entries and len({e["mutant"] for e in entries}) == len(entries)  # one entry per mutant
    for e in entries:
        assert set(e) == {"mutant", "change", "reason"}, e
        assert e["mutant"].startswith(prefixes) and "__mutmut_" in e["mutant"], e["mutant"]
        assert all(isinstance(v, str) and v.strip() and "\n" not in v for v in e.values()), e
