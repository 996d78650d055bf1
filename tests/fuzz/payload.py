"""The payload planted in every mutant: a module whose import (or any call of what it defines) writes a sentinel file.
If the sentinel exists after a command ran, the command ran code from the examined tree."""

from __future__ import annotations

from pathlib import Path

MODULE = "nf_fuzz_payload"  # planted at the examined tree's root as MODULE.py
SHADOWS = ("typing",)  # and under the names of modules imported at start-up, for a process started inside the tree


def source(sentinel: Path) -> str:
    """The payload module's text: importing it, or calling ``build``/``step``/``Optim``, leaves ``sentinel``."""
    mark = f"__import__('pathlib').Path({str(sentinel)!r}).write_text('ran')"
    return (f"{mark}\n\n\ndef build(*a, **k):\n    {mark}\n\n\ndef step(*a, **k):\n    {mark}\n\n\n"
            f"class Optim:\n    def __init__(self, *a, **k):\n        {mark}\n")


def plant(folder: Path, sentinel: Path) -> None:
    for name in (MODULE, *SHADOWS):
        (folder / f"{name}.py").write_text(source(sentinel))
