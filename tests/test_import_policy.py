"""The trust policy is an allow-list of places: a run's import strings resolve only to files under the working
directory, a --code-path folder, a --code script or a --trust-package distribution, decided before anything is
imported. Generated over the whole standard library (CPython's ``test`` package with it), the frozen and built-in
modules, every installed package and odd spellings; and the reported cases through the real command line."""

from __future__ import annotations

import _imp
import functools
import importlib
import importlib.machinery
import importlib.metadata
import inspect
import itertools
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from nanforensics.errors import BadInput
from nanforensics.runs.imports import ROLES, TOOL_MODULES, TRUST_HINT, Places, check_callable, load_callable

# the command line's cases run in-process (run_cli: sys.path as the console script's process has it, from a probe of
# one), but the one about start-up, a process: what a fresh interpreter imports as torch loads (sympy's gmpy2, flint);
# and those naming --trust-package, processes: a process looks a distribution up once (functools.cache)
from conftest import ROOT, assert_one_line_error, run_cli, tree_digest

# CPython's own tests, which some distributions package apart (found without importing anything)
HAS_TEST_PACKAGE = (Path(sysconfig.get_paths()["stdlib"]) / "test" / "support" / "__init__.py").exists()
# Cheap checks (nothing is imported): enough examples to sweep each class, a fraction of a second each.
CHEAP = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _dotted(relative: Path) -> str | None:
    """The module name of a source or extension file, relative to the folder it is importable from."""
    parts = list(relative.with_suffix("").parts)
    parts[-1] = parts[-1].partition(".")[0]  # _json.cpython-311-x86_64-linux-gnu -> _json
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) if parts and all(p.isidentifier() for p in parts) else None


@functools.cache
def standard_library() -> list[str]:
    """Every module of the standard library by its files (CPython's ``test`` package, ``idlelib``, ``lib-dynload``'s
    extensions), with ``sys.stdlib_module_names``."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    names = set(sys.stdlib_module_names)
    for path in folder.rglob("*"):
        if path.suffix not in (".py", ".so") or "site-packages" in path.parts or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(folder)
        if relative.parts[0] == "lib-dynload":
            relative = relative.relative_to("lib-dynload")
        if (name := _dotted(relative)) is not None:
            names.add(name)
    return sorted(names)


def frozen_and_builtin() -> list[str]:
    frozen = getattr(_imp, "_frozen_module_names", lambda: [])()  # 3.11+
    return sorted({*sys.builtin_module_names, *frozen, "__hello__", "__phello__", "__phello__.spam", "builtins"})


@functools.cache
def installed() -> list[str]:
    """Every module of every installed distribution, by the files it installed (torch, transformers, pytest, ...),
    but the few modules of torch and nanforensics the tool itself builds from (``TOOL_MODULES``)."""
    names = set()
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"] == "nanforensics":  # installed editable here: its files lie in the checkout
            continue
        for f in dist.files or []:
            if f.suffix in (".py", ".so") and not str(f).startswith(".."):
                name = _dotted(Path(str(f)))
                if name and not any(name == t or name.startswith(t + ".") for t in TOOL_MODULES):
                    names.add(name)
    return sorted(names)


def test_the_classes_are_the_whole_of_them():
    """The generated inputs cover what the old deny-list missed, not only what it held."""
    assert {"test.support", "test.support.os_helper"} <= set(standard_library()) or not HAS_TEST_PACKAGE
    assert {"json.decoder", "_json", "email.mime.text"} <= set(standard_library())
    assert {"__hello__", "__phello__.spam", "_imp", "sys", "builtins"} <= set(frozen_and_builtin())
    assert {"torch.serialization", "torch.hub", "sympy", "_pytest.main"} <= set(installed())
    assert len(standard_library()) > 1000 and len(installed()) > 1000


@contextmanager
def nowhere_chosen(tmp: Path) -> Iterator[None]:
    """An empty working directory, no --code-path and no $PYTHONPATH: the only place the user chose holds nothing."""
    before, environment = os.getcwd(), os.environ.pop("PYTHONPATH", None)
    os.chdir(tmp)
    try:
        yield
    finally:
        os.chdir(before)
        if environment is not None:
            os.environ["PYTHONPATH"] = environment


def assert_refused_before_import(role: str, spec: str, tmp: Path, *why: str) -> None:
    """Refused, for one of the reasons ``why`` when given (or not importable here at all: a module of another
    platform, such as ``winreg``), with nothing imported and sys.path as it was."""
    modules, path = set(sys.modules), list(sys.path)
    with nowhere_chosen(tmp), pytest.raises(BadInput) as refused:
        load_callable(role, spec, where=tmp / "manifest.json")
    message = str(refused.value)
    assert "\n" not in message and "manifest.json" in message, message
    assert not why or any(reason in message for reason in (*why, "is not importable here")), message
    assert set(sys.modules) == modules, sorted(set(sys.modules) - modules)  # nothing was imported, so nothing ran
    assert sys.path == path  # and no folder was left behind


@pytest.fixture(scope="module")
def empty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("empty")


ATTRIBUTES = ["main", "system", "run_in_subinterp", "rmtree", "Path.unlink", "join", "eval", "x.y.z"]
ROLE = st.sampled_from(sorted(ROLES))
ATTRIBUTE = st.sampled_from(ATTRIBUTES)


@CHEAP
@given(role=ROLE, module=st.sampled_from(standard_library()), attribute=ATTRIBUTE)
def test_the_standard_library_is_refused_before_import(empty, role, module, attribute):
    assert_refused_before_import(role, f"{module}:{attribute}", empty, "standard library")


def test_frozen_and_builtin_modules_are_refused_before_import(empty):
    """Each of them (about 60: listed, not sampled), the roles and attributes taken in turn."""
    for module, role, attribute in zip(frozen_and_builtin(), itertools.cycle(sorted(ROLES)), itertools.cycle(ATTRIBUTES)):
        assert_refused_before_import(role, f"{module}:{attribute}", empty, "standard library")


@CHEAP
@given(role=ROLE, module=st.sampled_from(installed()), attribute=ATTRIBUTE)
def test_installed_packages_not_named_are_refused_before_import(empty, role, module, attribute):
    assert_refused_before_import(role, f"{module}:{attribute}", empty, "installed packages")


SPELLINGS = st.sampled_from(["", ".", "..", " ", "\t", "\u200b", "\x00", "/", ":", "-", "\\", "..."])
LOOKALIKES = str.maketrans("osiet", "ｏѕіеｔ")  # fullwidth and Cyrillic letters


@CHEAP
@given(role=ROLE, module=st.sampled_from(["os", "subprocess", "builtins", "test.support", "os.path", "pathlib",
                                          "shutil", "torch", "sympy", "__hello__"]),
       before=SPELLINGS, inside=SPELLINGS, after=SPELLINGS, attribute=ATTRIBUTE, lookalike=st.booleans(),
       noise=st.text(alphabet="ab._:/ \x00\u200bｏ", max_size=12))
def test_odd_spellings_are_refused_before_import(empty, role, module, before, inside, after, attribute,
                                                 lookalike, noise):
    """Leading, trailing and doubled dots, relative names, blanks, NUL, lookalike letters, extra colons, paths."""
    head, dot, tail = module.partition(".")
    name = f"{before}{head}{dot}{inside if dot else ''}{tail}{after}"
    spec = f"{name.translate(LOOKALIKES) if lookalike else name}:{attribute}{noise}"
    assert_refused_before_import(role, spec, empty)


@pytest.mark.parametrize("spec", ["builtins:eval", "os.path:join", "pathlib:Path.unlink", "os:path.join",
                                  "test.support:run_in_subinterp", "test.support.os_helper:rmtree", "__hello__:main",
                                  "__phello__.spam:main", "torch:load", "torch.hub:load", "sympy:sympify",
                                  "transformers:GPT2LMHeadModel", "numpy:load", "__main__:main"])
def test_what_the_old_deny_list_let_through_or_held_is_refused(spec, tmp_path):
    assert_refused_before_import("model_factory", spec, tmp_path, "standard library", "installed packages",
                                 "the program running")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(package=st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), module=st.sampled_from(["", "sub", "a.b"]),
       role=st.sampled_from(["model_factory", "step_fn", "--step", "--batches"]))
def test_the_users_own_code_is_admitted_and_leaves_sys_path_as_it_was(tmp_path_factory, package, module, role):
    """The other side: any module of the project (the working directory), however nested, is imported and its
    function admitted, and sys.path is as it was after. A name the import system finds elsewhere first (an
    installed or built-in module) is not the project's."""
    found = importlib.machinery.BuiltinImporter.find_spec(package) or importlib.machinery.FrozenImporter.find_spec(
        package) or importlib.machinery.PathFinder.find_spec(package)
    assume(found is None and package not in sys.modules)
    project = tmp_path_factory.mktemp("project")
    name = ".".join(filter(None, [package, module]))
    *packages, last = name.split(".")
    folder = project
    for part in packages:
        folder = folder / part
        folder.mkdir()
        (folder / "__init__.py").touch()
    (folder / f"{last}.py").write_text("def step(*args, **kwargs):\n    return 0\n")
    path = list(sys.path)
    with nowhere_chosen(project):
        try:
            assert load_callable(role, f"{name}:step", where=project / "manifest.json")() == 0
        finally:
            for loaded in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
                del sys.modules[loaded]
    assert sys.path == path


# objects of the project's own module that are neither a function nor a class, and what the refusal calls each
NOT_CALLABLE_KINDS = {
    "instance": "a Thing object of kinds_here", "bound": "a bound method of kinds_here",
    "partial": "a partial object of Python's standard library (functools)", "module": "a module",
    "builtin": "a built-in function of Python's standard library (math)", "number": "a int object",
}


def test_each_object_of_the_projects_own_module_in_each_role(tmp_path):
    """The verdicts after import on the project's own module (a place the user chose), each object x every role
    (110), enumerated: its function where the role takes one, else refused; its class (no Module, optimizer or
    scheduler) refused, named; a function or class it re-exports from the standard library refused by the file that
    defines it; and what is neither a function nor a class (an instance, a bound method, a partial, a
    module, a built-in, a number) refused by the allow-list's closing line, named by kind. (That line returning None
    let every such object through, and only test_untrusted_code's processes noticed, 144 s in.)"""
    (tmp_path / "kinds_here.py").write_text(
        "import functools, json, math\n\nclass Thing:\n    def method(self):\n        return 0\n\n"
        "def step(*args, **kwargs):\n    return 0\n\ninstance = Thing()\nbound = instance.method\n"
        "partial = functools.partial(step, 1)\nmodule = json\nbuiltin = math.sqrt\nnumber = 3\n"
        "from os.path import join\nfrom collections import OrderedDict\n")
    where = tmp_path / "manifest.json"
    with nowhere_chosen(tmp_path):
        try:
            for role, (name, real) in itertools.product(sorted(ROLES), [("join", "posixpath.join"),
                                                                         ("OrderedDict", "collections.OrderedDict")]):
                with pytest.raises(BadInput) as refused:  # re-exported: judged by the file that defines it
                    load_callable(role, f"kinds_here:{name}", where=where)
                message = str(refused.value)
                assert message.startswith(f"{where}: {role} 'kinds_here:{name}' is refused: it is {real}, whose file ("), message
                assert "is part of Python's standard library" in message, message
            for role in sorted(ROLES):
                refusals = {f"kinds_here:{name}": f"it is {kind}, not a function or class defined in a module"
                            for name, kind in NOT_CALLABLE_KINDS.items()}
                refusals["kinds_here:Thing"] = f"it is the class kinds_here.Thing, and {ROLES[role].wants} is wanted"
                if ROLES[role].functions:
                    assert load_callable(role, "kinds_here:step", where=where)() == 0
                else:
                    refusals["kinds_here:step"] = f"it is a function, and {ROLES[role].wants} is wanted"
                for spec, problem in refusals.items():
                    with pytest.raises(BadInput) as refused:
                        load_callable(role, spec, where=where)
                    assert str(refused.value) == f"{where}: {role} {spec!r} is refused: {problem}; {TRUST_HINT}"
        finally:
            sys.modules.pop("kinds_here", None)


def test_odd_objects_are_named_by_what_they_are_not_by_what_they_claim(tmp_path):
    """A module that sets a global ``__module__`` is still just a module; a built-in function of a module built into
    the interpreter but outside ``sys.stdlib_module_names`` (xxsubtype) is still the standard library's."""
    (tmp_path / "claims.py").write_text("__module__ = 'json'\n")
    (tmp_path / "odd_here.py").write_text("import claims as module\nfrom xxsubtype import bench\n")
    where = tmp_path / "manifest.json"
    with nowhere_chosen(tmp_path):
        try:
            for spec, kind in (("odd_here:module", "a module"),
                               ("odd_here:bench", "a built-in function of Python's standard library (xxsubtype)")):
                with pytest.raises(BadInput) as refused:
                    load_callable("step_fn", spec, where=where)
                assert str(refused.value) == (f"{where}: step_fn {spec!r} is refused: it is {kind}, not a function or "
                                              f"class defined in a module; {TRUST_HINT}")
        finally:
            sys.modules.pop("odd_here", None)
            sys.modules.pop("claims", None)


def test_a_function_of_the_tool_itself_is_refused_even_where_its_file_lies_in_a_chosen_place(monkeypatch):
    """From the project's own checkout (the working directory: a place the user chose, holding nanforensics'
    source) a function of the platform is refused by its top-level package, in each role that takes a function;
    trusting its distribution (--trust-package nanforensics) admits it."""
    import nanforensics.words as words

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    for role in sorted(r for r in ROLES if ROLES[r].functions):
        with pytest.raises(BadInput) as refused:
            check_callable(role, "nanforensics.words:count", words.count, where="m.json", places=Places.chosen())
        assert str(refused.value) == (f"m.json: {role} 'nanforensics.words:count' is refused: it is "
                                      f"nanforensics.words.count, a function of nanforensics, not of the run's own code; "
                                      f"{TRUST_HINT}")
        check_callable(role, "nanforensics.words:count", words.count, where="m.json",
                       places=Places.chosen(packages=["nanforensics"]))


# (role, class) admitted: the project's classes and torch's (TOOL_CLASSES) of the kind the role names; the rest refused
CLASSES_ADMITTED = {("model_factory", "Net"), ("--model", "Net"), ("model_factory", "torch.nn:Linear"),
                    ("--model", "torch.nn:Linear"), ("optimizer.class", "Opt"), ("optimizer.class", "torch.optim:Adam"),
                    ("optimizer.class", "torch.optim:SGD"), ("optimizer.factory", "torch.optim:Adam"),
                    ("optimizer.factory", "torch.optim:SGD"), ("scheduler.factory", "torch.optim.lr_scheduler:StepLR"),
                    ("--scheduler", "torch.optim.lr_scheduler:StepLR")}


def test_each_class_in_each_role(tmp_path):
    """The project's Module, optimizer and scheduler subclasses and torch's own classes, each x every role (77),
    enumerated: admitted where the role takes that kind of class (CLASSES_ADMITTED), else refused, the project's named
    with what the role wants, torch's by the file that defines it (torch is no place the user chose)."""
    (tmp_path / "classes_here.py").write_text(
        "import torch\n\nclass Net(torch.nn.Module):\n    pass\n\nclass Opt(torch.optim.SGD):\n    pass\n\n"
        "class Sched(torch.optim.lr_scheduler.StepLR):\n    pass\n")
    where = tmp_path / "manifest.json"
    with nowhere_chosen(tmp_path):
        try:
            for role, name in itertools.product(sorted(ROLES), ["Net", "Opt", "Sched", "torch.nn:Linear", "torch.optim:Adam",
                                                                "torch.optim:SGD", "torch.optim.lr_scheduler:StepLR"]):
                spec = name if ":" in name else f"classes_here:{name}"
                if (role, name) in CLASSES_ADMITTED:
                    assert inspect.isclass(load_callable(role, spec, where=where)), (role, spec)
                    continue
                with pytest.raises(BadInput) as refused:
                    load_callable(role, spec, where=where)
                message = str(refused.value).removeprefix(f"{where}: {role} {spec!r} is refused: ")
                if ":" in name:
                    cls = getattr(importlib.import_module(spec.partition(":")[0]), spec.partition(":")[2])
                    assert message.startswith(f"it is {cls.__module__}.{cls.__qualname__}, whose file ("), message
                else:
                    assert message == f"it is the class classes_here.{name}, and {ROLES[role].wants} is wanted; {TRUST_HINT}"
        finally:
            sys.modules.pop("classes_here", None)


def test_the_program_running_is_refused_and_a_script_merely_named_like_it_is_not(tmp_path):
    """``__main__`` and ``__mp_main__`` (and their submodules) are the program running, refused before any import in
    every role; the target is what the import string's last colon leaves, as ``parse`` reads it, so the project's
    script ``__main__:odd.py`` is the run's code."""
    (tmp_path / "__main__:odd.py").write_text("def step(*args, **kwargs):\n    return 0\n")
    where = tmp_path / "manifest.json"
    with nowhere_chosen(tmp_path):
        for role, target in itertools.product(sorted(ROLES), ["__main__", "__mp_main__", "__main__.sub"]):
            modules = set(sys.modules)
            with pytest.raises(BadInput) as refused:
                load_callable(role, f"{target}:main", where=where)
            assert str(refused.value) == (f"{where}: {role} '{target}:main' is refused: {target} is the program running, "
                                          f"not the run's code; {TRUST_HINT}")
            assert set(sys.modules) == modules
        assert load_callable("step_fn", "__main__:odd.py:step", where=where)() == 0


def _project(tmp: Path) -> tuple[Path, Path]:
    """A project (the working directory) with a module of its own and a ``.venv`` holding an installed package
    ``venvpkg`` (with its dist-info), as a virtual environment inside the project would; returns (project,
    site-packages). Importing either module writes a marker file beside it; calling its factory raises."""
    project = tmp / "project"
    site = project / ".venv" / "lib" / "python3.11" / "site-packages"
    (site / "venvpkg").mkdir(parents=True)
    (project / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    mark = "from pathlib import Path\nPath(__file__).with_name('imported').write_text('ran')\n"
    build = "def build_model(**kwargs):\n    raise RuntimeError('admitted and called')\n"
    (site / "venvpkg" / "__init__.py").write_text(mark + build)
    info = site / "venvpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: venvpkg\nVersion: 1.0\n")
    (info / "RECORD").write_text("venvpkg/__init__.py,,\nvenvpkg-1.0.dist-info/METADATA,,\n"
                                 "venvpkg-1.0.dist-info/RECORD,,\n")
    (project / "own.py").write_text(mark + build)
    return project, site


def test_a_venv_inside_the_project_is_refused_unless_its_package_is_named(tmp_path, monkeypatch):
    project, site = _project(tmp_path)
    monkeypatch.syspath_prepend(str(site))  # the environment is on the path, as an activated one would be
    monkeypatch.chdir(project)
    where = tmp_path / "manifest.json"
    assert callable(load_callable("model_factory", "own:build_model", where=where))  # the project's own code
    assert (project / "imported").exists()
    with pytest.raises(BadInput, match="part of the installed packages .*--trust-package NAME"):
        load_callable("model_factory", "venvpkg:build_model", where=where)
    assert not (site / "venvpkg" / "imported").exists() and "venvpkg" not in sys.modules
    with pytest.raises(BadInput, match="'nosuchdist' is not a distribution installed here"):
        load_callable("model_factory", "venvpkg:build_model", where=where, trust_packages=["nosuchdist"])
    try:
        assert callable(load_callable("model_factory", "venvpkg:build_model", where=where, trust_packages=["venvpkg"]))
        assert (site / "venvpkg" / "imported").exists()
    finally:
        sys.modules.pop("venvpkg", None)
    sys.modules.pop("own", None)


def test_the_working_directory_leaves_sys_path_after_the_import(tmp_path, monkeypatch):
    project, _ = _project(tmp_path)
    monkeypatch.chdir(project)
    path = list(sys.path)
    try:
        load_callable("model_factory", "own:build_model", where=tmp_path / "manifest.json")
    finally:
        sys.modules.pop("own", None)
    assert sys.path == path


# ---- the reported cases, through the command line ------------------------------------------------------------


SAMPLE_CODE = ROOT / "sample_runs" / "code"  # the shipped sample's model and step function


def _sample(tmp: Path, **manifest: object) -> Path:
    """A copy of the shipped sample run, its manifest changed as a hostile run directory's would be."""
    run = tmp / "run"
    shutil.copytree(ROOT / "sample_runs" / "seed_adam", run)
    data = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**data, **manifest}))
    return run


@pytest.mark.skipif(not HAS_TEST_PACKAGE, reason="this Python has no test package (packaged apart, not installed)")
def test_cpython_test_package_cannot_run_code_or_delete_batches(tmp_path):
    """``test.support:run_in_subinterp`` runs the string it is given; ``test.support.os_helper:rmtree`` deleted the
    run's batches through postmortem. Neither is imported now."""
    marker = tmp_path / "payload-ran"
    code = _sample(tmp_path / "code", model_factory="test.support:run_in_subinterp",
                   model_kwargs={"code": f"open({str(marker)!r}, 'w').write('ran')"})
    rmtree = _sample(tmp_path / "rmtree", model_factory="test.support.os_helper:rmtree")
    manifest = json.loads((rmtree / "manifest.json").read_text())
    (rmtree / "manifest.json").write_text(json.dumps({**manifest, "model_kwargs": {"path": str(rmtree / "batches")}}))
    before = tree_digest(rmtree)
    calls = [("replay", code, "--no-explain"), ("replay", rmtree, "--no-explain"),
             ("postmortem", rmtree, "--json", tmp_path / "pm.json")]
    results = [run_cli(*args, cwd=ROOT) for args in calls]
    assert_one_line_error(results[0], "manifest.json", "test.support:run_in_subinterp' is refused", "standard library")
    assert_one_line_error(results[1], "manifest.json", "test.support.os_helper:rmtree' is refused", "standard library")
    assert not marker.exists(), "the payload ran"
    assert results[2].code == 1, results[2].stderr
    replay = next(a for a in json.loads((tmp_path / "pm.json").read_text())["analyses"] if a["name"] == "replay")
    assert replay["status"] == "skipped" and "is refused" in replay["detail"], replay
    assert tree_digest(rmtree) == before  # the batches survive


def test_a_module_file_in_the_run_directory_is_never_imported_later(tmp_path):
    """``cd RUN && nanforensics replay .``: the run directory is never on sys.path, so the ``gmpy2.py`` and
    ``flint.py`` sympy tries when torch first imports it are not found there."""
    run = _sample(tmp_path)
    marker = tmp_path / "payload-ran"
    for name in ("gmpy2", "flint"):
        (run / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise ImportError('no')\n")
    result = run_cli("replay", ".", "--no-explain", "--code-path", SAMPLE_CODE, cwd=run, process=True)
    assert result.code == 1, result.stderr
    assert not marker.exists(), "a module file of the run directory ran"


def test_a_venv_package_through_the_command_line(tmp_path, monkeypatch):
    """--trust-package reaches the policy from the command line; without it the package is not even imported."""
    project, site = _project(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    run = _sample(tmp_path, model_factory="venvpkg:build_model")
    refused = run_cli("replay", run, "--no-explain", "--code-path", SAMPLE_CODE, cwd=project)
    assert_one_line_error(refused, "manifest.json", "venvpkg:build_model' is refused", "--trust-package NAME")
    assert not (site / "venvpkg" / "imported").exists()
    # trusted: a process, since a process looks a distribution up once (an earlier test's venvpkg lay elsewhere)
    trusted = run_cli("replay", run, "--no-explain", "--code-path", SAMPLE_CODE, "--trust-package", "venvpkg", cwd=project,
                      process=True)
    assert_one_line_error(trusted, "model factory venvpkg:build_model raised RuntimeError: admitted and called")
    assert (site / "venvpkg" / "imported").exists()
    # the post-mortem takes the same choice: refused without it (checkpoints only), admitted with it
    (site / "venvpkg" / "imported").unlink()
    for extra, said in (((), "is refused"), (("--trust-package", "venvpkg"), "admitted and called")):
        pm = run_cli("postmortem", run, "--json", "-", "--code-path", SAMPLE_CODE, *extra, cwd=project, process=bool(extra))
        replay = next(a for a in pm.json()["analyses"] if a["name"] == "replay")
        assert said in replay["detail"], (extra, replay)
        assert (site / "venvpkg" / "imported").exists() == bool(extra)


# ---- the allow-list's last line: a file in no place the user chose -------------------------------------------


CHOSEN_BY = ["nothing", "--code-path", "$PYTHONPATH", "the working directory"]


@pytest.mark.parametrize("reached", ["on sys.path", "as a .py path"])
@pytest.mark.parametrize("chosen_by", CHOSEN_BY)
def test_a_file_in_no_chosen_place_is_refused_and_each_choice_admits_it(tmp_path, monkeypatch, reached, chosen_by):
    """The closing refusal of the allow-list: a script neither installed, nor in the run directory, nor under the
    working directory, a --code-path folder or $PYTHONPATH (here a folder something else put on sys.path, or a path
    the manifest names) is refused before it runs; each of the three choices admits that very file."""
    stray, cwd = tmp_path / "elsewhere", tmp_path / "cwd"
    stray.mkdir()
    cwd.mkdir()
    name = f"stray_{CHOSEN_BY.index(chosen_by)}_{reached[:2]}"
    (stray / f"{name}.py").write_text("from pathlib import Path\nPath(__file__).with_name('ran').write_text('ran')\n"
                                      "def step(*args, **kwargs):\n    return 0\n")
    spec = f"{name}:step" if reached == "on sys.path" else f"{stray / name}.py:step"
    if reached == "on sys.path":
        monkeypatch.syspath_prepend(str(stray))  # as a .pth file or an IDE would put it there
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(stray if chosen_by == "the working directory" else cwd)
    if chosen_by == "$PYTHONPATH":
        monkeypatch.setenv("PYTHONPATH", str(stray))
    search = [stray] if chosen_by == "--code-path" else []
    modules = set(sys.modules)
    try:
        if chosen_by == "nothing":
            with pytest.raises(BadInput) as refused:
                load_callable("step_fn", spec, where=tmp_path / "manifest.json", search_paths=search)
            assert (f"{stray / name}.py) lies outside the working directory, the --code-path folders, $PYTHONPATH and "
                    "the --trust-package distributions;") in str(refused.value), str(refused.value)
            assert not (stray / "ran").exists() and set(sys.modules) == modules  # refused before it ran
        else:
            assert load_callable("step_fn", spec, where=tmp_path / "manifest.json", search_paths=search)() == 0
            assert (stray / "ran").exists()
    finally:
        for loaded in set(sys.modules) - modules:
            del sys.modules[loaded]


@pytest.mark.parametrize("spec, part_of, hint", [
    ("json:loads", "Python's standard library", False),  # nothing to name: no distribution holds it
    ("sympy:symbols", "the installed packages", True),  # a distribution, which --trust-package names
])
def test_installed_code_is_refused_naming_what_it_is_part_of_and_the_way_out(tmp_path, spec, part_of, hint):
    """The refusal of installed code says what the file is part of, and offers --trust-package only where a
    distribution could be named: never for the standard library."""
    with nowhere_chosen(tmp_path), pytest.raises(BadInput) as refused:
        load_callable("step_fn", spec, where=tmp_path / "manifest.json")
    message = str(refused.value)
    assert f"is part of {part_of} (" in message, message
    assert ("which a run may not call; name its distribution with --trust-package NAME to allow it;" if hint else
            "which a run may not call; --trust-code calls it anyway") in message, message


def test_code_in_the_run_directory_is_refused_saying_how_to_allow_it(tmp_path):
    """A module file inside the run directory: refused before it runs, and the message says the way out."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "shipped.py").write_text("raise SystemExit('ran')\n")
    with nowhere_chosen(tmp_path), pytest.raises(BadInput) as refused:
        load_callable("step_fn", f"{run / 'shipped.py'}:step", where=run / "manifest.json", forbidden=run)
    assert "lies inside the run directory; pass --trust-run-dir to allow code shipped with the run" in str(refused.value), \
        str(refused.value)
