"""Where reports go, checked before any work: a command never writes over, or into, what it examines.

Every command names its inputs (the run directory, the checkpoints, the saved report) and its outputs
(``--json``, ``--markdown``, ``--junit``, ``--html``, repair's ``--out``, ``$GITHUB_STEP_SUMMARY``);
``check_outputs`` compares their resolved paths, so a symlink or a ``..`` does not get around it, and
refuses an output that is an input file, lies inside an input folder, or (a folder the command
replaces) holds one. It also refuses an output that cannot be written, so a long replay is not wasted.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Collection, Iterable, Mapping

from .errors import BadInput


def _real(path: str | Path) -> Path:
    """Symlinks (dangling ones too) and ``..`` resolved, as far as the path exists."""
    return Path(os.path.realpath(path))


def expand(targets: Iterable[str | Path]) -> list[Path]:
    """Targets as the paths they name: a glob (bisect's ``'runs/*/checkpoints'``) as the paths it matches."""
    out: list[Path] = []
    for t in map(str, targets):
        out += [Path(p) for p in glob.glob(t)] if glob.escape(t) != t else [Path(t)]
    return out


def check_outputs(inputs: Iterable[str | Path], outputs: Mapping[str, str | Path | None],
                  folders: Collection[str] = ()) -> None:
    """Refuse, as a ``BadInput`` naming the option and the path, an output that would write over or into an input,
    or that cannot be written. ``outputs`` maps each option to its path (None: not given; ``-``: stdout, for one of them at most);
    ``folders`` names the options whose path is a folder the command creates or replaces (repair's ``--out``)."""
    to_stdout = [option for option, d in outputs.items() if d is not None and str(d) == "-"]
    if len(to_stdout) > 1:
        raise BadInput(" and ".join(to_stdout), "only one report can go to stdout (-); write the others to files")
    sources = [(Path(i), _real(i)) for i in inputs]
    given = {option: Path(d) for option, d in outputs.items() if d is not None and str(d) != "-"}
    replaced = {option: _real(given[option]) for option in folders if option in given}
    for option, path in given.items():
        real = _real(path)
        for source, source_real in sources:
            if real == source_real or _same_file(path, source):
                raise BadInput(option, f"{path} is {source}, an input of this command, which it never writes over")
            if real.is_relative_to(source_real) and not source_real.is_file():
                raise BadInput(option, f"{path} lies inside {source}, which this command examines and never "
                                       "writes into")
            if option in folders and source_real.is_relative_to(real):
                raise BadInput(option, f"{path} holds {source}, which this command examines: replacing it would "
                                       "delete it")
        for folder, folder_real in replaced.items():
            if folder != option and real.is_relative_to(folder_real):
                raise BadInput(option, f"{path} lies inside {folder} {given[folder]}, which is replaced as a whole")
        _check_writable(option, path, folder=option in folders)


def _same_file(a: Path, b: Path) -> bool:
    """A hard link to an input is the input: an append to it would change the input."""
    try:
        return a.is_file() and b.is_file() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_writable(option: str, path: Path, folder: bool) -> None:
    if folder:
        if path.exists() and not path.is_dir():
            raise BadInput(path, "exists and is not a directory")
    elif path.is_dir():
        raise BadInput(path, "is a directory; reports are written to files")
    # Missing folders are created on writing; the nearest one that exists must be a writable folder.
    existing = next(p for p in path.absolute().parents if p.exists())
    if not existing.is_dir():
        raise BadInput(path, f"cannot write there: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(path, f"cannot write there: {existing} is not writable")
