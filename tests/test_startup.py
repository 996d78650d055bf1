"""The CLI loads what a command needs when the command runs: help and usage errors load neither torch nor
safetensors (importing torch is most of a short replay's start-up)."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from nanforensics.runs.imports import distribution_name

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
