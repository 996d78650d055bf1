"""The CLI loads what a command needs when the command runs: help and usage errors load neither torch nor
safetensors (importing torch is most of a short replay's start-up)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from nanforensics.runs.imports import distribution_name

from conftest import ROOT

PACKAGE = Path(__file__).resolve().parent.parent / "nanforensics"

_PROBE = """
import sys
from nanforensics.cli import main
sys.argv = ["nanforensics", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    code = e.code
print("loaded:", sorted(m for m in ("torch", "safetensors", "numpy") if m in sys.modules), "exit:", code)
"""


@pytest.mark.parametrize("args, code", [(["--help"], 0), (["replay", "--help"], 0), (["scan", "--help"], 0),
                                        (["replay"], 2), (["no-such-command"], 2)])
def test_help_and_usage_errors_do_not_load_torch(args, code):
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == f"loaded: [] exit: {code}", out.stdout + out.stderr


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    os.mkfifo(root / "fifo")
    (root / "run").mkdir()
    (root / "fifo_manifest").mkdir()
    os.mkfifo(root / "fifo_manifest" / "manifest.json")
    return {"root": root}


@pytest.mark.parametrize("args, needle", [
    (["replay", "{root}/missing"], "no such run directory"),
    (["replay", "{root}/run"], "manifest.json: file is missing"),
    (["replay", "{root}/fifo_manifest"], "manifest.json: not a regular file (a FIFO)"),
    (["repair", "{root}/missing", "--out", "{root}/out"], "no such run directory"),
    (["scan", "{root}/fifo"], "not a regular file (a FIFO)"),
    (["scan", "{root}/missing.safetensors"], "no such file or directory"),
    (["postmortem", "{root}/missing"], "no such file or directory"),
    (["report", "{root}/fifo"], "not a regular file (a FIFO)"),
    (["replay", "{run}", "--json", "{run}/manifest.json"], "which this command examines and never writes into"),
    (["scan", "{ckpt}", "--json", "{ckpt}"], "an input of this command"),
])
def test_bad_input_that_needs_no_tensor_is_told_before_torch_loads(bad_inputs, args, needle):
    run = ROOT / "sample_runs" / "seed_adam"
    ckpt = next((run / "checkpoints").iterdir()) / "model.safetensors"
    argv = [a.format(root=bad_inputs["root"], run=run, ckpt=ckpt) for a in args]
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "loaded: [] exit: 2", out.stdout + out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("nanforensics: error: ") and needle in line, line


def test_the_package_imports_only_what_it_declares():
    """A fresh ``pip install -e '.[test]'`` holds the declared dependencies and nothing else, while a venv with the
    extras (CI's) holds what they bring too: an undeclared import (``click``, which typer 0.29 stopped requiring)
    works here and fails on the README's first command. Every import in the package must come from the standard
    library, nanforensics, a declared dependency or an extra's (the integrations import theirs inside functions)."""
    declared = {distribution_name(r) for r in metadata.requires("nanforensics") or []}
    owners = metadata.packages_distributions()
    undeclared = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "nanforensics":
                    continue
                if not {distribution_name(d) for d in owners.get(top, [top])} & declared:
                    undeclared.add(f"{path.relative_to(PACKAGE.parent)}: {module}")
    assert not undeclared, sorted(undeclared)
