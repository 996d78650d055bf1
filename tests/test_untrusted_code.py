"""User code is reached only through the manifest's import strings, and never from inside the run directory
unless the user says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_one_line_error, run_cli, tree_digest

PAYLOAD = '''
from pathlib import Path
Path({marker!r}).write_text("ran")
from scenarios import train_step
'''


def _plant(run: Path, marker: Path, as_package: bool) -> str:
    """Code inside the run directory that leaves a marker file when it runs; returns its import string."""
    if as_package:
        (run / "shipped").mkdir()
        (run / "shipped" / "__init__.py").write_text(PAYLOAD.format(marker=str(marker)))
        (run / "shipped" / "steps.py").write_text("from scenarios import train_step\n")
        return "shipped.steps:train_step"
    (run / "shipped_steps.py").write_text(PAYLOAD.format(marker=str(marker)))
    return "shipped_steps:train_step"


@pytest.mark.parametrize("as_package", [False, True])
def test_code_inside_the_run_dir_is_refused_unless_trusted(copy_run, tmp_path, as_package):
    run = copy_run("adam_near_zero")
    marker = tmp_path / "payload-ran"
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["step_fn"] = _plant(run, marker, as_package)
    (run / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(run)
    # run from inside the run directory, where a plain import would find the shipped module first
    result = run_cli("replay", ".", "--no-explain", cwd=run)
    assert_one_line_error(result, "manifest.json", "inside the run directory", "--trust-run-dir")
    assert not marker.exists(), "the shipped code ran"
    trusted = run_cli("replay", ".", "--no-explain", "--trust-run-dir", "--json", "-", cwd=run)
    assert trusted.code == 1, trusted.stderr
    assert marker.exists()
    assert manifest["step_fn"] in trusted.json()["setup"]["imported"]
    assert tree_digest(run) == before  # not even a __pycache__ beside the trusted code


def test_script_path_inside_the_run_dir_is_refused(copy_run, tmp_path):
    run = copy_run("adam_near_zero")
    marker = tmp_path / "payload-ran"
    (run / "train.py").write_text(PAYLOAD.format(marker=str(marker)))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["step_fn"] = f"{run / 'train.py'}:train_step"
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(run_cli("replay", run, "--no-explain"), "inside the run directory")
    assert not marker.exists()
