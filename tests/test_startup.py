"""The CLI loads what a command needs when the command runs: help and usage errors load neither torch nor
safetensors (importing torch is most of a short replay's start-up)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from nanforensics.runs.imports import distribution_name

from conftest import ROOT

PACKAGE = Path(__file__).resolve().parent.parent / "nanforensics"

_PROBE = """
import contextlib, io, json, os, sys, traceback
from nanforensics.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    read, write = os.pipe()
    if os.fork() == 0:  # each call in a child: the process just as it was when the CLI was imported, nothing after
        sys.argv = ["nanforensics", *argv]
        stdout, stderr, code = io.StringIO(), io.StringIO(), None
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                main()
            except SystemExit as e:
                code = e.code
            except BaseException:
                code = traceback.format_exc()
        loaded = sorted(m for m in ("torch", "safetensors", "numpy") if m in sys.modules)
        with os.fdopen(write, "w") as pipe:
            json.dump({"loaded": loaded, "exit": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}, pipe)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        results.append(json.load(pipe))
    os.wait()
print(json.dumps(results))
"""

USAGE = [(["--help"], 0), (["replay", "--help"], 0), (["scan", "--help"], 0), (["replay"], 2), (["no-such-command"], 2)]
BAD_INPUT = [
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
]


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    os.mkfifo(root / "fifo")
    (root / "run").mkdir()
    (root / "fifo_manifest").mkdir()
    os.mkfifo(root / "fifo_manifest" / "manifest.json")
    run = ROOT / "sample_runs" / "seed_adam"
    return {"root": root, "run": run, "ckpt": next((run / "checkpoints").iterdir()) / "model.safetensors"}


def _argv(args: list[str], bad_inputs: dict[str, Path]) -> tuple[str, ...]:
    return tuple(a.format(**bad_inputs) for a in args)


@pytest.fixture(scope="module")
def calls(bad_inputs) -> dict[tuple[str, ...], dict[str, Any]]:
    """Every case's CLI call in a child forked from one fresh process that imported the CLI (a process each took a
    second apiece): what it printed, its exit code, and the libraries loaded by its end."""
    argvs = [tuple(args) for args, _ in USAGE] + [_argv(args, bad_inputs) for args, _ in BAD_INPUT]
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(zip(argvs, json.loads(out.stdout.splitlines()[-1])))


@pytest.mark.parametrize("args, code", USAGE)
def test_help_and_usage_errors_do_not_load_torch(calls, args, code):
    call = calls[tuple(args)]
    assert (call["loaded"], call["exit"]) == ([], code), call


@pytest.mark.parametrize("args, needle", BAD_INPUT)
def test_bad_input_that_needs_no_tensor_is_told_before_torch_loads(calls, bad_inputs, args, needle):
    call = calls[_argv(args, bad_inputs)]
    assert (call["loaded"], call["exit"]) == ([], 2), call
    [line] = call["stderr"].strip().splitlines()
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
