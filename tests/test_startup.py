"""The CLI loads what a command needs when the command runs: help and usage errors load neither torch nor
safetensors (importing torch is most of a short replay's start-up)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
