"""The one way out: every report and output folder is written here, checked before any work and again on writing.

A path is written only when it is absent or a regular file this process may write, reached by resolving symlinks,
and it is none of: an input of a command (the run directory, the checkpoints, the saved report, the training
script, a ``--code-path`` folder) nor anything inside one, a tree being examined (``inputs.examine``), a source
file this process imported (the run's own ``model.py`` once the replay imported it). A device node, a FIFO, a
socket or a folder in its place is refused, never replaced, and so is a symlink to one: an atomic rename goes
only over a regular file. ``-`` is stdout. A missing parent folder is refused unless the command was asked to
create it (``--create-dirs``). ``check_outputs`` applies these checks before a command starts, so a long replay
is not wasted; ``write_output`` applies them again when writing, when the run's code has been imported.
"""

from __future__ import annotations

import contextlib
import glob
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Collection, Iterable, Iterator, Mapping

from .errors import BadInput
from .inputs import examined, not_regular
from .runs.files import write_bytes_atomic

_lock = threading.Lock()
_inputs: list[tuple[Path, Path]] = []  # (as given, resolved): every command input named in this process
_may_create: set[Path] = set()  # outputs whose missing folders a command was asked to create


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
                  folders: Collection[str] = (), create_dirs: bool = False) -> None:
    """Refuse, as a ``BadInput`` naming the option and the path, an output that would write over or into an input,
    or that cannot be written. ``outputs`` maps each option to its path (None: not given; ``-``: stdout, for one of them at most);
    ``folders`` names the options whose path is a folder the command creates or replaces (repair's ``--out``);
    ``create_dirs``: an output's missing parent folders may be created."""
    to_stdout = [option for option, d in outputs.items() if d is not None and str(d) == "-"]
    if len(to_stdout) > 1:
        raise BadInput(" and ".join(to_stdout), "only one report can go to stdout (-); write the others to files")
    sources = [(Path(i), _real(i)) for i in inputs]
    with _lock:
        _inputs.extend(s for s in sources if s not in _inputs)
    given = {option: Path(d) for option, d in outputs.items() if d is not None and str(d) != "-"}
    replaced = {option: _real(given[option]) for option in folders if option in given}
    for option, path in given.items():
        real = _real(path)
        for source, source_real in sources:
            if option in folders and source_real.is_relative_to(real):
                raise BadInput(option, f"{path} holds {source}, which this command examines: replacing it would "
                                       "delete it")
        for folder, folder_real in replaced.items():
            if folder != option and real.is_relative_to(folder_real):
                raise BadInput(option, f"{path} lies inside {folder} {given[folder]}, which is replaced as a whole")
        if create_dirs:
            with _lock:
                _may_create.add(Path(os.path.abspath(path)))
        _checked(path, option, folder=option in folders)


def write_output(destination: str | Path, data: bytes | str, option: str | None = None,
                 create_dirs: bool = False) -> None:
    """Write a report to ``destination`` (``-``: stdout) atomically, after the checks above; ``option`` names it in
    an error (``--json``), ``create_dirs`` lets it create missing parent folders."""
    text = data if isinstance(data, str) else None
    if str(destination) == "-":
        sys.stdout.write(text if text is not None else bytes(data).decode())
        sys.stdout.flush()
        return
    target = _checked(Path(destination), option, create=create_dirs)
    try:
        write_bytes_atomic(target, text.encode() if text is not None else bytes(data), durable=False)
    except OSError as e:
        raise BadInput(option or destination, f"cannot write {destination} ({e.strerror or e})") from None


@contextlib.contextmanager
def writing(option: str, destination: str | Path) -> Iterator[None]:
    """Writes into an output folder (repair's ``--out``), built under a temporary name and renamed into place: an
    error names the option and the path the user gave, never the temporary one (which is gone by then)."""
    try:
        yield
    except OSError as e:
        raise BadInput(option, f"cannot write {destination} ({e.strerror or e})") from None


def append_output(destination: str | Path, text: str, option: str | None = None) -> None:
    """Append to ``destination`` (GitHub's ``$GITHUB_STEP_SUMMARY``) after the same checks: a FIFO there is refused,
    never opened."""
    target = _checked(Path(destination), option)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise BadInput(option or destination, f"cannot append to {destination} ({e.strerror or e})") from None
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        problem = not_regular(os.fstat(fd).st_mode)  # replaced since the check
        if problem is not None:
            raise BadInput(option or destination, f"{destination} {_is(problem)}")
        f.write(text)


def _checked(path: Path, option: str | None, folder: bool = False, create: bool = False) -> Path:
    """The resolved path to write ``path`` at, or a ``BadInput`` saying why it is not written."""
    where = option or path
    named = f"{path} " if option else ""
    real = _real(path)
    with _lock:
        sources = list(_inputs)
        create = create or Path(os.path.abspath(path)) in _may_create
    for source, source_real in sources:
        if real == source_real or _same_file(real, source_real):
            raise BadInput(where, f"{named}is {source}, an input of this command, which it never writes over")
        if real.is_relative_to(source_real) and source_real.is_dir():
            raise BadInput(where, f"{named}lies inside {source}, which this command examines and never writes into")
    for tree in examined():
        if real == tree or (real.is_relative_to(tree) and tree.is_dir()):
            raise BadInput(where, f"{named}lies inside {tree}, which this command examines and never writes into")
    module = _imported(real)
    if module is not None:
        raise BadInput(where, f"{named}is the source of {module}, which this process imported: never written over")
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise BadInput(where, f"{named}cannot be checked ({e.strerror or e})") from None
    if mode is None and os.path.lexists(path) and path.is_symlink():
        raise BadInput(where, f"{named}is a symlink to {real}, which does not exist: not followed")
    if folder:
        if mode is not None and not stat.S_ISDIR(mode):
            raise BadInput(where, f"{named}exists and is not a directory")
    elif mode is not None:
        problem = not_regular(mode)
        if problem is not None:
            raise BadInput(where, f"{named}{_is(problem)}: reports replace only regular files")
        if not mode & 0o222 or not os.access(real, os.W_OK):  # no write bit: read-only even to root
            raise BadInput(where, f"{named}is read-only: not replaced")
    parent = real.parent
    if not parent.exists():
        if not create:
            raise BadInput(where, f"{named}cannot be written: the folder {path.parent} does not exist (--create-dirs "
                                  "creates it)")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadInput(where, f"{named}cannot be written: cannot create {path.parent} ({e.strerror or e})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(where, f"{named}cannot be written: {path.parent} is not writable")
    return real


def _is(problem: str) -> str:
    """``not_regular``'s words as the writer's refusals say them: "is a FIFO, not a regular file"."""
    return f"is {problem.removeprefix('not a regular file (').removesuffix(')')}, not a regular file"


def _same_file(a: Path, b: Path) -> bool:
    """A hard link to an input is the input: an append to it would change the input."""
    try:
        return a.is_file() and b.is_file() and os.path.samefile(a, b)
    except OSError:
        return False


_sources: dict[str, str] = {}  # resolved source (or bytecode) file -> the module imported from it
_seen: dict[str, object] = {}  # the modules _sources was built from


def _imported(real: Path) -> str | None:
    """The module this process imported from ``real`` (its source or its cached bytecode), if any."""
    with _lock:
        for name, module in list(sys.modules.items()):
            if _seen.get(name) is not module:  # resolved once per module, not once per output
                _seen[name] = module
                for attr in ("__file__", "__cached__"):
                    file = getattr(module, attr, None)
                    if isinstance(file, str):
                        _sources[os.path.realpath(file)] = name
        return _sources.get(str(real))
