"""Import strings: how a run names the user's model factory and step function, and the trust policy they pass.

A callable is stored as ``package.module:qualname`` or, for one defined in a script,
``path/to/file.py:qualname``. Replay reaches user code only through these strings, and each one
through ``load_callable``, which applies the trust policy (``check_callable``) to the string, to each module on
the way before it runs (``Places``: an allow-list of the places the user chose, decided on the file the module
resolves to), and to the imported object, before anything calls it. A run directory is untrusted input: its
manifest must not be able to name ``os:system`` with the command in ``model_kwargs``, nor
``test.support:run_in_subinterp``, nor leave a module file where a later import would find it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
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
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import BadInput
from ..inputs import read_input
from .paths import MANIFEST


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
        # a program given as text (``python -c``, the REPL, stdin) names its code ``<string>``, ``<stdin>``: no file
        source = inspect.getsourcefile(fn)
        if source is None or not os.path.isfile(source):
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


# ---- the trust policy ----------------------------------------------------------------------------------

# What nanforensics itself builds from a manifest wherever torch is installed, without --trust-package: the
# optimizer the run trained with (every manifest names its class), a scheduler class, a torch.nn layer as a model,
# and the integrations' default step functions. A manifest may import these modules (torch's and nanforensics' own,
# imported already or harmless to import) and take from them only such classes and those functions; every other
# module of an installed package is refused before it is imported.
TOOL_MODULES = ("torch.optim", "torch.nn", "nanforensics.integrations.hf", "nanforensics.integrations.lightning")
TOOL_CLASSES = ("torch.optim", "torch.nn.modules")  # where the classes they give are defined (__module__)
TOOL_STEP_FUNCTIONS = frozenset({("nanforensics.integrations.hf", "training_step"),
                                 ("nanforensics.integrations.lightning", "training_step")})
RUNNING = ("__main__", "__mp_main__")  # the program running (nanforensics), never the run's code
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
    "distributed.wrapping.loss_fn": Role("a function", None, True),  # a pipeline schedule's loss function
    # --code (runs.unrecorded): the callables a training script gives, each by the option that names it
    "--model": Role("an nn.Module subclass or a function", _is_module_class, True),
    "--step": Role("a function", None, True),
    "--batches": Role("a function", None, True),
    "--optimizer": Role("a function", None, True),
    "--scheduler": Role("a scheduler class of torch.optim.lr_scheduler or a function", _is_torch_scheduler, True),
}
# each of a run's several optimizers (manifest "optimizers.members.<i>") stands where a run's one optimizer does, and its
# LR scheduler ("optimizers.members.<i>.scheduler") where a run's one scheduler does
_MEMBER = re.compile(r"^optimizers\.members\.\d+\.(scheduler\.)?")
TRUST_HINT = "--trust-code calls it anyway (docs/security.md)"
PACKAGE_HINT = "name its distribution with --trust-package NAME to allow it"


def _inside(path: Path, folder: Path | None) -> bool:
    return folder is not None and path.is_relative_to(folder)


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


@functools.cache
def _installed_folders() -> tuple[tuple[Path, str], ...]:
    """The standard library's folders and the installed packages', each with what an error calls it; the most
    specific first (the site-packages folder lies inside the standard library's)."""
    found: dict[Path, str] = {}
    for scheme in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme)
        found.update({_real(paths[k]): "Python's standard library" for k in ("stdlib", "platstdlib") if k in paths})
    for scheme in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        paths = sysconfig.get_paths(vars=scheme)
        found.update({_real(paths[k]): "the installed packages" for k in ("purelib", "platlib") if k in paths})
    found.update({_real(p): "the installed packages" for p in [*site.getsitepackages(), site.getusersitepackages()]})
    return tuple(sorted(found.items(), key=lambda item: -len(item[0].parts)))


def _installed(file: Path) -> str | None:
    """What installed code ``file`` (resolved) is part of: the standard library, the installed packages, or a Python
    environment wherever it lies (a ``.venv`` inside the project, a ``site-packages`` folder); None when none."""
    folder = next((f"{what} ({folder})" for folder, what in _installed_folders() if _inside(file, folder)), None)
    if folder is not None:
        return folder
    for parent in file.parents:
        if parent.name in ("site-packages", "dist-packages"):
            return f"the installed packages ({parent})"
        if (parent / "pyvenv.cfg").is_file() or (parent / "conda-meta").is_dir():
            return f"the Python environment {parent}"
    return None


@functools.cache
def _distribution(name: str) -> tuple[frozenset[str], frozenset[Path], tuple[Path, ...]]:
    """A distribution the user trusts: its top-level module names, the files it installed, and the folders of its
    top-level modules that it installed no file of (an editable install points at its source)."""
    try:
        dist = metadata.distribution(name)
    except (metadata.PackageNotFoundError, ValueError):
        raise BadInput("--trust-package", f"{name!r} is not a distribution installed here") from None
    files = {_real(dist.locate_file(f)) for f in dist.files or [] if not str(f).startswith("..")}
    tops = {t for t in top_levels(dist) if t.isidentifier()}
    covered = {Path(str(f)).parts[0].removesuffix(".py") for f in dist.files or []}
    folders: list[Path] = []
    for top in tops - covered:
        try:
            spec = importlib.util.find_spec(top)  # of a distribution the user names: its finder may be asked
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            folders += [_real(p) for p in spec.submodule_search_locations]
        elif spec is not None and spec.has_location and spec.origin:
            files.add(_real(spec.origin))
    return frozenset(tops), frozenset(files), tuple(folders)


@dataclass(frozen=True)
class Places:
    """Where the code a run names may lie: only in places the user chose. The one place for that decision.

    Those places are the folders and scripts named on the command line (``--code-path``, ``--code``), the working
    directory (the user's project), the folders of ``$PYTHONPATH`` (the user's environment saying where their code
    is, as CI jobs do with ``PYTHONPATH=src``), and the files of the distributions named with ``--trust-package``.
    Never the run directory (``forbidden``, unless ``--trust-run-dir``) nor any run directory around it (``runs``:
    an incident folder ``RUN/incidents/step_N`` is examined inside ``RUN``, whose files are as untrusted), and never
    the standard library, a built-in or frozen module, or an installed package not named, wherever it lies (a
    ``.venv`` inside the project too).
    ``trust_code`` (``--trust-code``) lifts all but the run directory.
    """

    roots: tuple[Path, ...] = ()  # resolved: the --code-path folders, a --code script, $PYTHONPATH, the working dir
    folders: tuple[Path, ...] = ()  # resolved: the --code-path folders, searched for a script named by its name
    cwd: Path | None = None  # resolved: the working directory
    forbidden: Path | None = None
    package_tops: frozenset[str] = frozenset()
    package_files: frozenset[Path] = frozenset()
    package_folders: tuple[Path, ...] = ()
    trust_code: bool = False

    @classmethod
    def chosen(cls, code_paths: Sequence[Path] = (), forbidden: Path | None = None, packages: Sequence[str] = (),
               trust_code: bool = False) -> "Places":
        """The places the command line, the working directory and $PYTHONPATH name; a named distribution must be
        installed."""
        tops: set[str] = set()
        files: set[Path] = set()
        folders: list[Path] = []
        for name in packages:
            t, f, d = _distribution(distribution_name(name))
            tops |= t
            files |= f
            folders += d
        cwd = _real(Path.cwd())
        chosen = [_real(p) for p in code_paths]
        environment = [_real(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return cls((*chosen, *environment, cwd), tuple(p for p in chosen if p.is_dir()), cwd,
                   None if forbidden is None else _real(forbidden), frozenset(tops), frozenset(files), tuple(folders),
                   trust_code)

    @functools.cached_property
    def runs(self) -> tuple[Path, ...]:
        """The run directory and every folder above it that holds a run manifest (``manifest.json``, whatever it
        holds: a folder dressed as something else is refused too), outermost first: each is the untrusted input."""
        if self.forbidden is None:
            return ()
        return (*(p for p in reversed(self.forbidden.parents) if os.path.lexists(p / MANIFEST)), self.forbidden)

    def run_around(self, path: Path) -> Path | None:
        """The outermost run directory (``runs``) that the resolved ``path`` lies in, if any."""
        return next((run for run in self.runs if _inside(path, run)), None)

    def withheld(self) -> list[str]:
        """The --code-path folders and the working directory that lie inside a run directory: never on sys.path,
        only looked into to say why a module there is refused."""
        return [str(f) for f in (*self.folders, self.cwd) if f is not None and self.run_around(f) is not None]

    def refusal(self, file: str | Path, what: str) -> str | None:
        """Why the code of ``what``, in ``file``, may not run; None when ``file`` lies in a place the user chose."""
        real = _real(file)
        run = self.run_around(real)
        if run is not None:
            where = "" if run == self.forbidden else f" {run}, around the one examined"
            return (f"{what} ({file}) lies inside the run directory{where}; pass --trust-run-dir to allow code "
                    "shipped with the run")
        if self.trust_code or real in self.package_files or any(_inside(real, f) for f in self.package_folders):
            return None
        installed = _installed(real)
        if installed is not None:
            hint = "" if installed.startswith("Python's") else f"; {PACKAGE_HINT}"
            return f"{what} ({file}) is part of {installed}, which a run may not call{hint}"
        if any(real == r or _inside(real, r) for r in self.roots):
            return None
        return (f"{what} ({file}) lies outside the working directory, the --code-path folders, $PYTHONPATH and the "
                "--trust-package distributions")

    def spec_refusal(self, spec: importlib.machinery.ModuleSpec) -> str | None:
        """Why the module ``spec`` locates may not run, decided before it is imported. A namespace package runs
        nothing of its own: it may be imported where one of its folders lies in a place the user chose, and its
        modules are decided one by one."""
        if spec.origin in ("built-in", "frozen"):
            if self.trust_code:
                return None
            how = "built into" if spec.origin == "built-in" else "frozen into"
            return f"{spec.name} is part of Python's standard library ({how} the interpreter), which a run may not call"
        if spec.origin and spec.has_location:
            return self.refusal(spec.origin, spec.name)
        if spec.submodule_search_locations is not None:  # a namespace package: refused when no folder of it may be
            problems = [self.refusal(folder, spec.name) for folder in spec.submodule_search_locations]
            return None if None in problems or not problems else problems[0]
        return None if self.trust_code else f"{spec.name} has no file to decide by"


def _top(module: str) -> str:
    return module.partition(".")[0]


def _under(module: str, prefixes: Sequence[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _module_of(obj: Any) -> str | None:
    """The name of the module that defines ``obj`` (its ``__module__``, as a decorated function keeps it); None where
    it names none: an object may set ``__module__`` to anything, a list or a dict too."""
    module = getattr(obj, "__module__", None)
    return module if isinstance(module, str) else None


def _file_of(module: str | None) -> str | None:
    return getattr(sys.modules.get(module), "__file__", None)  # type: ignore[arg-type]  # None names no module


def _refusal(role: Role, spec: str, obj: Any, places: Places) -> str | None:
    """Why ``obj``, imported from ``spec``, may not stand in ``role``; None when it may."""
    target = spec.rpartition(":")[0]
    if obj is NOT_IMPORTED:
        return f"{target} is the program running, not the run's code" if _under(target, RUNNING) else None
    module = _module_of(obj)
    name = f"{module}.{getattr(obj, '__qualname__', '?')}"
    where = _file_of(module)
    located = f"it is {name}, defined in no file" if where is None else places.refusal(where, f"it is {name}, whose file")
    if inspect.isclass(obj):
        if module is not None and _under(module, TOOL_CLASSES) and role.classes is not None and role.classes(obj):
            return None
        if located is not None:
            return located
        if role.classes is not None and role.classes(obj):
            return None
        return f"it is the class {name}, and {role.wants} is wanted"
    if inspect.isfunction(obj):
        if (module, obj.__qualname__) in role.tool_functions:
            return None
        if located is not None:
            return located
        if _top(module) in platform() and _top(module) not in places.package_tops:
            return f"it is {name}, a function of {_top(module)}, not of the run's own code"
        if role.functions:
            return None
        return f"it is a function, and {role.wants} is wanted"
    kind = "a built-in function" if inspect.isbuiltin(obj) else "a module" if inspect.ismodule(obj) else \
        "a bound method" if inspect.ismethod(obj) else f"a {type(obj).__name__} object"
    if module is not None and not inspect.ismodule(obj):
        standard = _top(module) in sys.stdlib_module_names or _top(module) in sys.builtin_module_names
        kind += f" of Python's standard library ({module})" if standard else f" of {module}"
    return f"it is {kind}, not a function or class defined in a module"


def check_callable(role: str, spec: str, obj: Any = NOT_IMPORTED, *, where: Path | str,
                   places: Places = Places()) -> None:
    """The trust policy, the one gate for every callable a run names; a ``BadInput`` naming the file, the field and
    the reason when ``obj`` may not stand in ``role`` (a key of ``ROLES``).

    Called with the import string alone before anything is imported and with the imported object before anything
    calls it; in between, ``resolve`` admits each module on the way through ``Places`` before it runs.
    The policy: a module only from a place the user chose (``Places``), decided on the file it resolves to;
    the object defined in such a place too (its own module's file, so a re-export such as ``mymodule:system`` after
    ``from os import system`` is caught); only a Python function or class defined in a module; a function only where
    the role takes one and never one of the tool's own platform (``platform()``) unless its distribution is
    trusted; a class only of the kind the role names; of torch and nanforensics only what ``TOOL_MODULES`` gives.
    ``places.trust_code`` (``--trust-code``) lets anything through that does not lie inside the run directory.
    """
    kind = ROLES[_MEMBER.sub(lambda m: m[1] or "optimizer.", role)]
    problem = None if places.trust_code else _refusal(kind, spec, obj, places)
    if problem is not None:
        _refuse(role, spec, where, problem)


def _refuse(role: str, spec: str, where: Path | str, problem: str) -> None:
    raise BadInput(where, f"{role} {spec!r} is refused: {problem}; {TRUST_HINT}")


def load_callable(role: str, spec: str, *, where: Path | str, search_paths: Sequence[Path] = (),
                  forbidden: Path | None = None, trust_code: bool = False, trust_packages: Sequence[str] = ()) -> Any:
    """The callable ``spec`` names, imported and admitted by the trust policy for ``role``; not yet called.

    ``search_paths``: the ``--code-path`` folders (and a ``--code`` script); ``forbidden``: the run directory (None
    under ``--trust-run-dir``); ``trust_packages``: the distributions ``--trust-package`` names.
    """
    places = Places.chosen(search_paths, forbidden, trust_packages, trust_code)
    check_callable(role, spec, where=where, places=places)
    obj = resolve(spec, role=role, where=where, places=places)
    check_callable(role, spec, obj, where=where, places=places)
    return obj


# ---- importing ---------------------------------------------------------------------------------------------


def parse(spec: str, where: Path | str) -> tuple[str, str]:
    """(target, qualname) of an import string: a dotted module name or a ``.py`` path, a dotted attribute path."""
    target, sep, qualname = spec.rpartition(":")
    dotted = target.endswith(".py") or all(part.isidentifier() for part in target.split("."))
    if not (sep and target and dotted and all(part.isidentifier() for part in qualname.split("."))):
        raise BadInput(where, f"import string {spec!r} is not of the form module:name or file.py:name")
    return target, qualname


@contextlib.contextmanager
def _importing(places: Places) -> Iterator[None]:
    """sys.path with the --code-path folders first and the working directory last, for one import only, so no later
    import finds a file there; never a folder inside the run directory. No __pycache__ is written beside the user's
    code (it may lie in the examined tree)."""
    def new(folders: Sequence[Path]) -> list[str]:
        return [str(f) for f in folders if str(f) not in sys.path and places.run_around(f) is None]

    first = new(places.folders)
    last = new([places.cwd]) if places.cwd is not None and "" not in sys.path else []
    sys.path[:0] = first
    sys.path.extend(last)
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        yield
    finally:
        sys.dont_write_bytecode = bytecode
        for folder in first + last:
            if folder in sys.path:
                sys.path.remove(folder)


def resolve(spec: str, *, role: str, where: Path | str, places: Places = Places()) -> Any:
    """Import what ``spec`` names, each module admitted by ``places`` before it runs; ``where`` names the file that
    recorded it, for the error message."""
    target, qualname = parse(spec, where)
    if _under(target, TOOL_MODULES):  # torch's and nanforensics' own, imported without the user's folders
        module = _import(target, spec, where)
    else:
        with _importing(places):
            if target.endswith(".py"):
                module = _load_file(target, role, spec, where, places)
            else:
                module = _load_module(target, role, spec, where, places)
    obj: Any = module
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise MissingName(where, f"{spec!r}: {target} has no attribute {qualname!r}") from None
    return obj


def _find(name: str, locations: Sequence[str] | None, places: Places) -> importlib.machinery.ModuleSpec | None:
    """The spec of ``name`` through the finders that run nothing to answer: built-in, frozen, then the path (sys.path
    for a top-level module, its package's folders for one below). The other finders on ``sys.meta_path`` are not
    asked, since they may run code to answer (setuptools' distutils shim imports a package); a module only they find
    is not importable here but with --trust-code. A top-level module found nowhere else is looked for in the folders
    kept off sys.path, to say why it is refused."""
    machinery = importlib.machinery
    if locations is not None:
        return machinery.PathFinder.find_spec(name, list(locations))
    return (machinery.BuiltinImporter.find_spec(name) or machinery.FrozenImporter.find_spec(name)
            or machinery.PathFinder.find_spec(name) or machinery.PathFinder.find_spec(name, places.withheld()))


def _load_module(name: str, role: str, spec: str, where: Path | str, places: Places) -> Any:
    """The module ``name``, each package on the way to it decided on the file it resolves to before it runs, and
    run from that very spec: what was decided is what runs."""
    parts = name.split(".")
    module: Any = None
    for i in range(1, len(parts) + 1):
        full = ".".join(parts[:i])
        loaded = sys.modules.get(full)
        if loaded is not None:
            found = getattr(loaded, "__spec__", None)
            if found is None and not places.trust_code:
                _refuse(role, spec, where, f"{full} has no file to decide by")
        else:
            locations = getattr(module, "__path__", None)  # None for a top-level module (module None)
            if module is not None and locations is None:
                raise BadInput(where, f"{spec!r} is not importable here ({'.'.join(parts[:i - 1])} is not a package)")
            try:
                found = _find(full, locations, places)
            except (ImportError, ValueError) as e:
                raise BadInput(where, f"{spec!r} is not importable here ({e})") from None
            if found is None and places.trust_code:
                return _import(name, spec, where)
            if found is None:
                raise BadInput(where, f"{spec!r} is not importable here (no module named {full!r}); pass "
                                      "--code-path DIR to name where the user's code lives")
        problem = None if found is None else places.spec_refusal(found)
        if problem is not None:
            _refuse(role, spec, where, problem)
        module = loaded if loaded is not None else _run(found, spec, where)
    return module


def _run(found: importlib.machinery.ModuleSpec, spec: str, where: Path | str) -> Any:
    """Import the module ``found`` locates, from that spec (as the import system's own loading does)."""
    try:
        module = importlib.util.module_from_spec(found)
        sys.modules[found.name] = module
        try:
            if found.loader is not None:
                found.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(found.name, None)
            raise
    except ImportError as e:
        raise BadInput(where, f"{spec!r} is not importable here ({e}); pass --code-path DIR "
                              "to name where the user's code lives") from None
    except Exception as e:  # user code failed at import time
        raise BadInput(where, f"importing {found.name} for {spec!r} raised {e.__class__.__name__}: {e}") from None
    module = sys.modules[found.name]  # a module may put another in its place
    parent, _, child = found.name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _import(name: str, spec: str, where: Path | str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise BadInput(where, f"{spec!r} is not importable here ({e}); pass --code-path DIR "
                              "to name where the user's code lives") from None
    except Exception as e:  # user code failed at import time
        raise BadInput(where, f"importing {name} for {spec!r} raised {e.__class__.__name__}: {e}") from None


def _load_file(target: str, role: str, spec: str, where: Path | str, places: Places) -> Any:
    path = Path(target)
    candidates = [Path.cwd() / path] + [folder / path.name for folder in places.folders]  # an absolute path as it is
    # a FIFO or a folder in its place is refused on reading, not passed over
    existing = [c for c in candidates if os.path.lexists(c)]
    if not existing:
        raise BadInput(where, f"script {target} does not exist here; pass --code-path DIR, "
                              f"DIR the folder that holds {path.name} itself")
    refusals = [places.refusal(c, f"script {target}") for c in existing]
    candidate = next((c for c, problem in zip(existing, refusals) if problem is None), None)
    if candidate is None:
        _refuse(role, spec, where, refusals[0] or "")
    assert candidate is not None
    name = f"_nanforensics_user_{abs(hash(str(_real(candidate))))}"
    if name in sys.modules:
        return sys.modules[name]
    source = read_input(candidate)  # read as every input is: a FIFO or a device is refused, never waited on
    module_spec = importlib.util.spec_from_file_location(name, candidate)
    assert module_spec is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        exec(compile(source, str(candidate), "exec", dont_inherit=True), module.__dict__)  # as the loader would
    except Exception as e:
        del sys.modules[name]
        raise BadInput(where, f"running script {candidate} for its definitions raised "
                              f"{e.__class__.__name__}: {e}") from None
    return module
