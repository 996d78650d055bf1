"""Import strings: how a run names the user's model factory and step function.

A callable is stored as ``package.module:qualname`` or, for one defined in a script,
``path/to/file.py:qualname``. Replay reaches user code only through these strings.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import BadInput


class MissingName(BadInput):
    """The module or script was imported, but defines no such name."""


def import_string_of(fn: Callable[..., Any] | str, what: str) -> str:
    """The string that imports ``fn`` again in another process, or a clear refusal.

    A string is taken as that import string itself, for code replay will find under another name than training
    did (a script run from a checkout, named by its path relative to the checkout's root).
    """
    if isinstance(fn, str):
        target, sep, name = fn.rpartition(":")
        if not (sep and target and name):
            raise ValueError(f"{what} {fn!r} is not an import string of the form module:name or file.py:name")
        return fn
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if qualname is None or module is None:
        raise ValueError(f"{what} must be a module-level function or class, got {fn!r}")
    if "<lambda>" in qualname:
        raise ValueError(f"{what} is a lambda; replay needs a named module-level function")
    if "<locals>" in qualname:
        raise ValueError(f"{what} {qualname!r} is defined inside a function; move it to module level")
    if module == "__main__":
        source = inspect.getsourcefile(fn)
        if source is None:
            raise ValueError(f"{what} {qualname!r} was defined interactively; put it in a file")
        return f"{Path(source).resolve()}:{qualname}"
    return f"{module}:{qualname}"


def resolve(spec: str, *, where: Path, search_paths: Sequence[Path] = (), forbidden: Path | None = None) -> Any:
    """Import ``spec``; ``where`` names the file that recorded it, for the error message.

    ``forbidden`` is a folder that code may not be loaded from (the run directory being examined).
    """
    target, sep, qualname = spec.rpartition(":")
    if not sep or not target or not qualname:
        raise BadInput(where, f"import string {spec!r} is not of the form module:name or file.py:name")
    added = [str(p) for p in search_paths if str(p) not in sys.path]
    sys.path[:0] = added
    # No __pycache__ beside the user's code: it may be the very run directory under examination.
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        if target.endswith(".py"):
            module = _load_file(target, where, search_paths, forbidden)
        else:
            module = _load_module(target, spec, where, forbidden)
    finally:
        sys.dont_write_bytecode = bytecode
        for p in added:
            sys.path.remove(p)
    obj: Any = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise MissingName(where, f"{spec!r}: {target} has no attribute {qualname!r}") from None
    return obj


def _inside(path: Path, folder: Path | None) -> bool:
    return folder is not None and path.resolve().is_relative_to(folder.resolve())


def _load_module(name: str, spec: str, where: Path, forbidden: Path | None) -> Any:
    # Locate the top-level package without importing anything: find_spec("pkg.mod") would run
    # pkg/__init__.py before we could refuse it.
    top = None
    try:
        top = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError):
        pass
    locations = [top.origin] if top is not None and top.origin else []
    locations += list(top.submodule_search_locations or []) if top is not None else []
    inside = next((p for p in locations if _inside(Path(p), forbidden)), None)
    if inside is not None:
        raise BadInput(where, f"{spec!r} resolves inside the run directory ({inside}); "
                              "pass --trust-run-dir to allow code shipped with the run")
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise BadInput(where, f"{spec!r} is not importable here ({e}); pass --code-path DIR "
                              "to name where the user's code lives") from None
    except Exception as e:  # user code failed at import time
        raise BadInput(where, f"importing {name} for {spec!r} raised {e.__class__.__name__}: {e}") from None


def _load_file(target: str, where: Path, search_paths: Sequence[Path], forbidden: Path | None) -> Any:
    path = Path(target)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path]
    candidates += [Path(p) / path.name for p in search_paths]
    for candidate in candidates:
        if candidate.is_file():
            break
    else:
        raise BadInput(where, f"script {target} does not exist here; pass --code-path DIR with its folder")
    if _inside(candidate, forbidden):
        raise BadInput(where, f"script {candidate} lies inside the run directory; "
                              "pass --trust-run-dir to allow code shipped with the run")
    name = f"_nanforensics_user_{abs(hash(str(candidate.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, candidate)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise BadInput(where, f"running script {candidate} for its definitions raised "
                              f"{e.__class__.__name__}: {e}") from None
    return module
