"""Import strings: how a run names the user's model factory and step function, and the trust policy they pass.

A callable is stored as ``package.module:qualname`` or, for one defined in a script,
``path/to/file.py:qualname``. Replay reaches user code only through these strings, and each one
through ``load_callable``, which applies the trust policy (``check_callable``) before the import and
again to the imported object, before anything calls it. A run directory is untrusted input: its
manifest must not be able to name ``os:system`` with the command in ``model_kwargs``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import re
import site
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import BadInput
from .files import read_input


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


# ---- the trust policy ----------------------------------------------------------------------------------

# What nanforensics itself runs on: its own package, its dependencies and theirs. Their functions are not the
# user's training code, and some run code given the right keyword arguments (torch.load unpickles, torch.hub.load
# imports a repository, sympy.sympify evaluates a string), so no manifest may call one. Their classes are allowed
# where a role takes a class (torch.nn.Linear as a model, torch.optim.Adam as an optimizer). This list is the
# baseline, kept for a source tree that is not installed; ``platform()`` adds what the installed packages bring.
PLATFORM = frozenset({
    "nanforensics", "torch", "functorch", "torchgen", "triton", "nvidia", "numpy", "safetensors", "sympy", "isympy",
    "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "filelock", "typing_extensions", "typer", "click",
    "rich", "pygments", "markdown_it", "mdurl", "shellingham", "annotated_doc", "transformers", "tokenizers",
    "huggingface_hub", "hf_xet", "accelerate", "psutil", "yaml", "_yaml", "regex", "tqdm", "packaging",
    "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torchmetrics", "pydantic",
    "pydantic_core", "typing_inspection", "annotated_types", "aiohttp", "aiohappyeyeballs", "aiosignal", "attr",
    "attrs", "frozenlist", "multidict", "propcache", "yarl", "anyio", "h11", "httpx", "httpcore", "httpx2",
    "httpcore2", "requests", "urllib3", "certifi", "charset_normalizer", "idna", "truststore", "sortedcontainers",
    "setuptools", "pkg_resources", "_distutils_hack", "pip", "pytest", "_pytest", "py", "pluggy", "iniconfig", "xdist",
    "execnet", "hypothesis", "_hypothesis_globals", "_hypothesis_pytestplugin", "_hypothesis_ftz_detector", "dill",
    "cloudpickle", "joblib", "IPython",
})

def top_levels(dist: metadata.Distribution) -> set[str]:
    """The importable top-level names a distribution installs."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return set(listed.split())
    files = [str(f) for f in dist.files or [] if str(f).endswith(".py") and not str(f).startswith("..")]
    return {f.split("/")[0].removesuffix(".py") for f in files if ".dist-info" not in f}


def distribution_name(requirement: str) -> str:
    """The normalised distribution name a requirement string names (``Typing_Extensions>=4; extra == 'x'`` ->
    ``typing-extensions``), or a distribution name normalised."""
    return re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


@functools.cache
def platform() -> frozenset[str]:
    """``PLATFORM``, and the top-level modules of every distribution installed here that nanforensics requires,
    with any of its extras, and that those require in turn (every requirement followed, whatever its markers:
    refusing too much is safe). A release that brings a new dependency (transformers 5.25 brought ``kernels``)
    brings it into the platform, without waiting for the list above."""
    tops, seen, todo = set(PLATFORM), set(), ["nanforensics"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        tops |= top_levels(dist)
        todo += [distribution_name(r) for r in dist.requires or []]
    return frozenset(t for t in tops if t.isidentifier())


# The functions of nanforensics that a manifest may name: the integrations' default step functions.
TOOL_STEP_FUNCTIONS = frozenset({("nanforensics.integrations.hf", "training_step"),
                                 ("nanforensics.integrations.lightning", "training_step")})
NOT_IMPORTED = object()  # check_callable's object before the import


def _is_module_class(cls: type) -> bool:
    return issubclass(cls, torch.nn.Module)


def _is_optimizer_class(cls: type) -> bool:
    return issubclass(cls, torch.optim.Optimizer)


def _is_torch_optimizer(cls: type) -> bool:
    return _is_optimizer_class(cls) and cls.__module__.startswith("torch.optim.")


def _is_torch_scheduler(cls: type) -> bool:
    return cls.__module__ == "torch.optim.lr_scheduler"


@dataclass(frozen=True)
class Role:
    """What may stand in one place of a run: a class passing ``classes``, and a user function where ``functions``."""

    wants: str  # for the error line
    classes: Callable[[type], bool] | None
    functions: bool
    tool_functions: frozenset[tuple[str, str]] = frozenset()


# Role names are the manifest's fields. A callable the project adds (distributed, integrations, a --code file)
# gets a line here and goes through check_callable like these.
ROLES: dict[str, Role] = {
    "model_factory": Role("an nn.Module subclass or a function", _is_module_class, True),
    "step_fn": Role("a function", None, True, TOOL_STEP_FUNCTIONS),
    "optimizer.class": Role("a torch.optim.Optimizer subclass", _is_optimizer_class, False),
    "optimizer.factory": Role("an optimizer class of torch.optim or a function", _is_torch_optimizer, True),
    "scheduler.factory": Role("a scheduler class of torch.optim.lr_scheduler or a function", _is_torch_scheduler,
                              True),
    # --code (runs.unrecorded): the callables a training script gives, each by the option that names it
    "--model": Role("an nn.Module subclass or a function", _is_module_class, True),
    "--step": Role("a function", None, True),
    "--batches": Role("a function", None, True),
    "--optimizer": Role("a function", None, True),
    "--scheduler": Role("a scheduler class of torch.optim.lr_scheduler or a function", _is_torch_scheduler, True),
}
TRUST_HINT = "--trust-code calls it anyway (README, Security)"


def _top(module: object) -> str:
    return module.partition(".")[0] if isinstance(module, str) else ""


def _standard(module: str) -> bool:
    return module in sys.stdlib_module_names or module in ("__main__", "__mp_main__")


def _refusal(role: Role, spec: str, obj: Any) -> str | None:
    """Why ``obj``, imported from ``spec``, may not stand in ``role``; None when it may."""
    target = spec.rpartition(":")[0]
    if not target.endswith(".py") and _standard(_top(target)):
        return f"{_top(target)} is part of Python's standard library, which a run may not call"
    if obj is NOT_IMPORTED:
        return None
    module = getattr(obj, "__module__", None)
    if inspect.isclass(obj):
        if _standard(_top(module)):
            return f"it is {module}.{obj.__qualname__}, of Python's standard library"
        if role.classes is not None and role.classes(obj):
            return None
        return f"it is the class {module}.{obj.__qualname__}, and {role.wants} is wanted"
    if inspect.isfunction(obj):
        if (module, obj.__qualname__) in role.tool_functions:
            return None
        if _standard(_top(module)):
            return f"it is {module}.{obj.__qualname__}, of Python's standard library"
        if _top(module) in platform():
            return f"it is {module}.{obj.__qualname__}, a function of {_top(module)}, not of the run's own code"
        if role.functions:
            return None
        return f"it is a function, and {role.wants} is wanted"
    kind = "a built-in function" if inspect.isbuiltin(obj) else "a module" if inspect.ismodule(obj) else \
        "a bound method" if inspect.ismethod(obj) else f"a {type(obj).__name__} object"
    if isinstance(module, str) and not inspect.ismodule(obj):
        kind += f" of Python's standard library ({module})" if _standard(_top(module)) else f" of {module}"
    return f"it is {kind}, not a function or class defined in a module"


def check_callable(role: str, spec: str, obj: Any = NOT_IMPORTED, *, where: Path, trust_code: bool = False) -> None:
    """The trust policy, the one gate for every callable a run names; a ``BadInput`` naming the file, the field and
    the reason when ``obj`` may not stand in ``role`` (a key of ``ROLES``).

    Called with the import string alone before anything is imported (a standard-library module is never even
    imported), then with the imported object before anything calls it. The policy: nothing of Python's standard
    library or builtins, whatever the string says (the object's own module is checked, so a re-export such as
    ``torch.serialization:os.system`` is caught); only a Python function or class defined in a module; a function
    only where the role takes one and never one of the tool's own platform (``platform()``); a class only of the
    kind the role names. ``trust_code`` (``--trust-code``) lets anything through.
    """
    if trust_code:
        return
    problem = _refusal(ROLES[role], spec, obj)
    if problem is not None:
        raise BadInput(where, f"{role} {spec!r} is refused: {problem}; {TRUST_HINT}")


def load_callable(role: str, spec: str, *, where: Path, search_paths: Sequence[Path] = (),
                  forbidden: Path | None = None, trust_code: bool = False) -> Any:
    """The callable ``spec`` names, imported and admitted by ``check_callable`` for ``role``; not yet called."""
    check_callable(role, spec, where=where, trust_code=trust_code)
    obj = resolve(spec, where=where, search_paths=search_paths, forbidden=forbidden, trust_code=trust_code)
    check_callable(role, spec, obj, where=where, trust_code=trust_code)
    return obj


def _installed_code() -> list[Path]:
    """The folders of the standard library and installed packages: a script there is not the user's training code."""
    paths = sysconfig.get_paths()
    found = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    found.update(getattr(site, "getsitepackages", lambda: [])())
    found.add(site.getusersitepackages())
    return [Path(p).resolve() for p in found if p]


# ---- importing ---------------------------------------------------------------------------------------------


def resolve(spec: str, *, where: Path, search_paths: Sequence[Path] = (), forbidden: Path | None = None,
            trust_code: bool = False) -> Any:
    """Import ``spec``; ``where`` names the file that recorded it, for the error message.

    ``forbidden`` is a folder that code may not be loaded from (the run directory being examined). A script in the
    standard library's or the installed packages' folders is refused unless ``trust_code``: loaded under a name of
    its own, its functions would pass for the user's.
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
            module = _load_file(target, where, search_paths, forbidden, trust_code)
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


def _load_file(target: str, where: Path, search_paths: Sequence[Path], forbidden: Path | None,
               trust_code: bool) -> Any:
    path = Path(target)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path]
    candidates += [Path(p) / path.name for p in search_paths]
    for candidate in candidates:
        if os.path.lexists(candidate):  # a FIFO or a folder in its place is refused on reading, not passed over
            break
    else:
        raise BadInput(where, f"script {target} does not exist here; pass --code-path DIR, "
                              f"DIR the folder that holds {path.name} itself")
    if _inside(candidate, forbidden):
        raise BadInput(where, f"script {candidate} lies inside the run directory; "
                              "pass --trust-run-dir to allow code shipped with the run")
    installed = next((p for p in _installed_code() if _inside(candidate, p)), None)
    if installed is not None and not trust_code:
        raise BadInput(where, f"script {candidate} lies among the installed packages ({installed}), not the "
                              f"user's code; {TRUST_HINT}")
    name = f"_nanforensics_user_{abs(hash(str(candidate.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    source = read_input(candidate)  # read as every input is: a FIFO or a device is refused, never waited on
    spec = importlib.util.spec_from_file_location(name, candidate)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(compile(source, str(candidate), "exec", dont_inherit=True), module.__dict__)  # as the loader would
    except Exception as e:
        del sys.modules[name]
        raise BadInput(where, f"running script {candidate} for its definitions raised "
                              f"{e.__class__.__name__}: {e}") from None
    return module
