"""What a command's input paths must be, checked before anything heavy is imported.

Torch-free, so that a wrong path, a run directory without its manifest, or a FIFO or device where a file belongs is
told in a fraction of a second, not after torch has loaded. The readers check the same again when they read
(``inputs.open_input``, ``Run``), in these words: this module is where both get them.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BadInput
from ..inputs import check_regular

MANIFEST = "manifest.json"


def run_directory(path: Path) -> Path:
    """A run directory that exists and holds a manifest that is a regular file."""
    if not path.exists():
        raise BadInput(path, "no such run directory")
    if not path.is_dir():
        raise BadInput(path, "not a directory")
    check_regular(path / MANIFEST)
    return path


def existing(path: Path) -> Path:
    """An input that exists: a folder, or a regular file (never a FIFO, socket or device, whose read may hang)."""
    if not path.exists():
        raise BadInput(path, "no such file or directory")
    if not path.is_dir():
        check_regular(path)
    return path

