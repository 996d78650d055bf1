"""The import policy's parts, each on small real files in a temporary folder and called as a library (a fraction of a
second in all): the import string of a callable and its parse, a requirement's distribution name and a distribution's
top-level modules, the places the user chose (``Places``) and each of their verdicts, and the loading of a module or a
script with each of its refusals. Every space is listed rather than sampled; ``test_import_policy.py`` generates the
policy's classes over the whole standard library and the installed packages, and runs the reported cases through the
command line."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import pytest
import torch
from nanforensics import words
from nanforensics.errors import BadInput
from nanforensics.runs import imports
from nanforensics.runs.imports import (
    PACKAGE_HINT,
    ROLES,
    TRUST_HINT,
    MissingName,
    Places,
    check_callable,
    distribution_name,
    import_string_of,
    load_callable,
    parse,
    top_levels,
)

STEP = "def step(*args, **kwargs):\n    return 0\n"
OUTSIDE = "lies outside the working directory, the --code-path folders, $PYTHONPATH and the --trust-package distributions"


@contextmanager
def project(folder: Path) -> Iterator[Path]:
    """``folder`` as the working directory, no $PYTHONPATH, and every module imported meanwhile forgotten after."""
    before, environment, modules, path = os.getcwd(), os.environ.pop("PYTHONPATH", None), set(sys.modules), list(sys.path)
    os.chdir(folder)
    try:
        yield folder
    finally:
        os.chdir(before)
        if environment is not None:
            os.environ["PYTHONPATH"] = environment
        for name in set(sys.modules) - modules:
            del sys.modules[name]
        assert sys.path == path


def refused(role: str, spec: str, where: Path, **options: object) -> str:
    """The one-line refusal of loading ``spec`` for ``role``, without the file's name it starts with."""
    with pytest.raises(BadInput) as error:
        load_callable(role, spec, where=where, **options)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{where}: "), message
    return message.removeprefix(f"{where}: ")


# ---- import strings ------------------------------------------------------------------------------------------


def _local() -> object:
    def inner() -> None: ...
    return inner


def _as_main(source: str, filename: str) -> types.FunctionType:
    """A function defined in ``__main__`` by code compiled from ``filename`` (a script's, or ``<stdin>``)."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["main"]  # type: ignore[return-value]


def test_the_import_string_of_each_kind_of_callable():
    """A string is taken as written where it has a target and a name; a module-level function or class gives its
    module and qualified name; a function of the program running, the path of its script; the rest are refused,
    each saying why."""
    script = Path(__file__)
    taken = {"pkg.mod:fn": "pkg.mod:fn", "dir/train.py:Net.build": "dir/train.py:Net.build", "a:b:c": "a:b:c",
             "c:/dir/train.py:fn": "c:/dir/train.py:fn",
             words.count: "nanforensics.words:count", torch.nn.Linear: "torch.nn.modules.linear:Linear",
             torch.nn.Linear.forward: "torch.nn.modules.linear:Linear.forward",
             _as_main("def main():\n    pass\n", str(script)): f"{script.resolve()}:main"}
    for fn, expected in taken.items():
        assert import_string_of(fn, "step_fn") == expected, fn
    for fn in ("mod", ":fn", "mod:", ":", "", "mod::"):  # the name is what the last colon leaves
        with pytest.raises(ValueError) as error:
            import_string_of(fn, "step_fn")
        assert str(error.value) == f"step_fn {fn!r} is not an import string of the form module:name or file.py:name"
    nameless = [3, types.SimpleNamespace(__qualname__="f", __module__=None), types.SimpleNamespace(__module__="m")]
    for fn in nameless:
        with pytest.raises(ValueError) as error:
            import_string_of(fn, "model_factory")
        assert str(error.value) == f"model_factory must be a module-level function or class, got {fn!r}"
    refusals = [((lambda: 0), "model_factory is a lambda; replay needs a named module-level function"),
                (_local(), "model_factory '_local.<locals>.inner' is defined inside a function; move it to module level")]
    # a program given as text names its code by no file (python -c, stdin, the REPL): it was once recorded as the path
    # "<string>" relative to the working directory, which replay then could not find
    refusals += [(_as_main("def main():\n    pass\n", name), "model_factory 'main' was defined interactively; put it in a file")
                 for name in ("<string>", "<stdin>", "<python-input-0>", str(script.with_name("gone.py")))]
    for fn, message in refusals:
        with pytest.raises(ValueError) as error:
            import_string_of(fn, "model_factory")
        assert str(error.value) == message


def test_the_parse_of_each_form_of_import_string(tmp_path):
    """``module:name`` and ``file.py:name`` with dotted names; every other form is refused in one line naming the
    file, before anything is imported."""
    for spec, parsed in {"a.b:c.d": ("a.b", "c.d"), "m:f": ("m", "f"), "dir/x.py:f": ("dir/x.py", "f"),
                         "x.py:A.f": ("x.py", "A.f"), "a:b:c.py:f": ("a:b:c.py", "f")}.items():
        assert parse(spec, tmp_path) == parsed
    for spec in ("a", ":f", "a:", "a-b:f", "a:f-g", "a..b:f", "a:f.", ".a:f", "a b:f", "a:b:c", "dir/x:f", ""):
        with pytest.raises(BadInput) as error:
            parse(spec, tmp_path / "manifest.json")
        assert str(error.value) == (f"{tmp_path / 'manifest.json'}: import string {spec!r} is not of the form "
                                    "module:name or file.py:name")


# ---- the platform: what the tool itself runs on ---------------------------------------------------------------


def test_the_distribution_each_requirement_names():
    """Every separator a requirement may put after the name (version, marker, extras, URL, blanks) ends it, and the
    name is normalised as pip compares names."""
    for requirement, name in {"Typing_Extensions>=4; extra == 'x'": "typing-extensions", "  torch  ": "torch",
                              "zope.interface": "zope-interface", "A_B.C": "a-b-c", "a[b]": "a", "a (>=1)": "a",
                              "a@ https://x/a.whl": "a", "a~=1.0": "a", "a!=1": "a", "a<1": "a", "a>1": "a",
                              "a==1": "a", "a\tb": "a", "a;x": "a", "a b c": "a", "abc": "abc"}.items():
        assert distribution_name(requirement) == name, requirement


def _dist(folder: Path, top_level: str | None, record: list[str] | None) -> metadata.Distribution:
    folder.mkdir()
    (folder / "METADATA").write_text("Metadata-Version: 2.1\nName: d\nVersion: 1\n")
    if top_level is not None:
        (folder / "top_level.txt").write_text(top_level)
    if record is not None:
        (folder / "RECORD").write_text("".join(f"{f},,\n" for f in record))
    return metadata.PathDistribution(folder)


def test_the_top_level_modules_of_each_kind_of_distribution(tmp_path):
    """``top_level.txt`` where it lists any; else the first part of each Python file it installed, but its
    metadata's and those outside its folder (a script in ``bin``); none without a list of files."""
    record = ["pkg/__init__.py", "pkg/sub.py", "mod.py", "d-1.dist-info/entry.py", "../../bin/tool.py", "data/f.txt",
              "other/x.pyc"]
    cases = [("listed", "one\ntwo three\n", record, {"one", "two", "three"}), ("empty", "", record, {"pkg", "mod"}),
             ("unlisted", None, record, {"pkg", "mod"}), ("bare", None, None, set())]
    for name, top_level, files, expected in cases:
        assert top_levels(_dist(tmp_path / f"{name}.dist-info", top_level, files)) == expected, name


# ---- the places the user chose ---------------------------------------------------------------------------------


def test_the_places_chosen_by_the_command_line_the_environment_and_the_working_directory(tmp_path, monkeypatch):
    """Each place resolved (a symbolic link to the folder is the folder): the --code-path folders and scripts,
    $PYTHONPATH's entries but its empty ones, the working directory last; the folders searched for a script by its
    name are the --code-path folders alone; the run directory, the trusted distributions and --trust-code as given."""
    for name in ("code", "env1", "env2", "cwd", "run"):
        (tmp_path / name).mkdir()
    (tmp_path / "code" / "train.py").write_text(STEP)
    (tmp_path / "link").symlink_to(tmp_path / "code")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["", str(tmp_path / "env1"), "", str(tmp_path / "env2"), ""]))
    monkeypatch.chdir(tmp_path / "cwd")
    places = Places.chosen([tmp_path / "link", tmp_path / "code" / "train.py"], tmp_path / "run", (), True)
    assert places == Places((tmp_path / "code", tmp_path / "code" / "train.py", tmp_path / "env1", tmp_path / "env2",
                             tmp_path / "cwd"), (tmp_path / "code",), tmp_path / "cwd", tmp_path / "run", trust_code=True)
    assert Places.chosen().forbidden is None and not Places.chosen().trust_code
    monkeypatch.delenv("PYTHONPATH")
    assert Places.chosen().roots == (tmp_path / "cwd",)
    trusted = Places.chosen(packages=["Nanforensics"])  # named as a requirement would name it
    assert trusted.package_tops == {"nanforensics"} and trusted.refusal(imports.__file__, "it") is None
    with pytest.raises(BadInput) as error:
        Places.chosen(packages=["no-such-distribution"])
    assert str(error.value) == "--trust-package: 'no-such-distribution' is not a distribution installed here"


def test_the_run_directories_around_the_one_examined(tmp_path):
    """The run directory and each folder above it holding a manifest, whatever the manifest is (a dangling link
    too), outermost first; a path is placed in the outermost; folders searched that lie in one are withheld."""
    outer, middle, run = tmp_path / "outer", tmp_path / "outer" / "middle", tmp_path / "outer" / "middle" / "incidents" / "s1"
    run.mkdir(parents=True)
    (outer / "manifest.json").write_text("{}")
    (middle / "manifest.json").symlink_to(tmp_path / "nowhere")
    places = Places(folders=(tmp_path, middle / "code"), cwd=run, forbidden=run)
    assert places.runs == (outer, middle, run)
    assert Places().runs == () and Places(forbidden=middle).runs == (outer, middle)
    for path, around in ((run / "x.py", outer), (middle, outer), (outer, outer), (tmp_path, None),
                         (tmp_path / "outer2", None)):
        assert places.run_around(path) == around, path
    assert places.withheld() == [str(middle / "code"), str(run)]
    assert Places(folders=(tmp_path,), cwd=tmp_path, forbidden=run).withheld() == []
    assert Places(folders=(tmp_path,)).withheld() == []


def test_each_verdict_on_a_file(tmp_path):
    """A file inside the run directory (or one around it) is refused whatever else holds; --trust-code, a trusted
    distribution's file or folder admit the rest; installed code is refused saying what it is part of (the way out
    only where a distribution could be named); a chosen place admits; anywhere else is refused."""
    run, cwd, outer = tmp_path / "outer" / "run", tmp_path / "cwd", tmp_path / "outer"
    run.mkdir(parents=True)
    cwd.mkdir()
    stdlib = Path(os.__file__)
    installed = Path(torch.__file__)
    places = Places(roots=(cwd, tmp_path / "script.py"), forbidden=run, package_files=frozenset({tmp_path / "pkg.py"}),
                    package_folders=(tmp_path / "pkgdir",))
    what = "it is m.f, whose file"
    verdicts = {
        run / "m.py": f"{what} ({run / 'm.py'}) lies inside the run directory; pass --trust-run-dir to allow code "
                      "shipped with the run",
        tmp_path / "pkg.py": None, tmp_path / "pkgdir" / "m.py": None, cwd / "m.py": None, cwd: None,
        tmp_path / "script.py": None,
        tmp_path / "script.py2": f"{what} ({tmp_path / 'script.py2'}) {OUTSIDE}",
        stdlib: f"{what} ({stdlib}) is part of Python's standard library ({stdlib.parent}), which a run may not call",
        installed: f"{what} ({installed}) is part of the installed packages ({installed.parent.parent}), which a run "
                   f"may not call; {PACKAGE_HINT}",
        tmp_path / "m.py": f"{what} ({tmp_path / 'm.py'}) {OUTSIDE}",
    }
    for file, verdict in verdicts.items():
        assert places.refusal(file, what) == verdict, file
        trusted = Places(roots=places.roots, forbidden=run, trust_code=True).refusal(file, what)
        assert trusted == (verdict if file.is_relative_to(run) else None), file
    (outer / "manifest.json").write_text("{}")  # a run directory around the one examined: its files are as untrusted
    for file in (run / "m.py", outer / "m.py"):
        for trust_code in (False, True):
            assert Places(roots=(outer,), forbidden=run, trust_code=trust_code).refusal(file, what) == (
                f"{what} ({file}) lies inside the run directory {outer}, around the one examined; pass --trust-run-dir "
                "to allow code shipped with the run")


def test_each_folder_of_installed_code_names_itself(tmp_path):
    """Each folder of the standard library and the installed packages, the most specific first (site-packages may
    lie inside the standard library's folder); a Python environment anywhere else by its marks."""
    for folder, what in imports._installed_folders():
        assert imports._installed(folder / "m.py") == f"{what} ({folder})"
    for marks, expected in (({"lib/site-packages"}, "the installed packages ({}/lib/site-packages)"),
                            ({"lib/dist-packages"}, "the installed packages ({}/lib/dist-packages)"),
                            ({"pyvenv.cfg"}, "the Python environment {}"), ({"conda-meta/"}, "the Python environment {}"),
                            ({"pyvenv.cfg/", "conda-meta"}, None), (set(), None)):
        env = tmp_path / f"env{len(list(tmp_path.iterdir()))}"
        (env / "lib" / "site-packages" / "pkg" if "lib/site-packages" in marks else env / "lib" / "dist-packages" / "pkg"
         if "lib/dist-packages" in marks else env / "lib" / "pkg").mkdir(parents=True)
        for mark in marks - {"lib/site-packages", "lib/dist-packages"}:
            (env / mark).mkdir() if mark.endswith("/") else (env / mark).write_text("")
        file = next(env.glob("lib/*/pkg"), env / "lib" / "pkg") / "m.py"
        assert imports._installed(file) == (expected.format(env) if expected else None), marks


def test_each_verdict_on_a_module_before_it_runs(tmp_path):
    """Built-in and frozen modules are the standard library's (admitted by --trust-code alone); a module with a file
    is decided by it; a namespace package where any of its folders may be; a module with neither, by --trust-code."""
    chosen, elsewhere = tmp_path / "chosen", tmp_path / "elsewhere"
    places, trusting = Places(roots=(chosen,)), Places(roots=(chosen,), trust_code=True)
    spec = importlib.machinery.ModuleSpec
    built_in, frozen = spec("sys", None, origin="built-in"), spec("__hello__", None, origin="frozen")
    assert places.spec_refusal(built_in) == ("sys is part of Python's standard library (built into the interpreter), "
                                             "which a run may not call")
    assert places.spec_refusal(frozen) == ("__hello__ is part of Python's standard library (frozen into the "
                                           "interpreter), which a run may not call")
    filed = importlib.util.spec_from_file_location("m", elsewhere / "m.py")
    assert places.spec_refusal(filed) == f"m ({elsewhere / 'm.py'}) {OUTSIDE}"
    assert places.spec_refusal(importlib.util.spec_from_file_location("m", chosen / "m.py")) is None
    located = spec("m", None, origin=str(elsewhere / "m.py"))  # an origin that is no location: nothing to decide by
    assert places.spec_refusal(located) == "m has no file to decide by"
    namespaces = {(): None, (chosen,): None, (elsewhere, chosen): None,
                  (elsewhere, tmp_path): f"ns ({elsewhere}) {OUTSIDE}"}
    for folders, verdict in namespaces.items():
        namespace = spec("ns", None, is_package=True)
        namespace.submodule_search_locations = [str(f) for f in folders]
        assert places.spec_refusal(namespace) == verdict, folders
    assert places.spec_refusal(spec("m", None)) == "m has no file to decide by"
    for admitted in (built_in, frozen, located, spec("m", None)):
        assert trusting.spec_refusal(admitted) is None


def test_a_member_of_several_optimizers_stands_where_the_one_optimizer_does(tmp_path):
    """``optimizers.members.N`` takes an optimizer's role and ``optimizers.members.N.scheduler`` a scheduler's; the
    refusal names the field as the manifest spells it. --trust-code admits what the role refuses."""
    where = tmp_path / "manifest.json"
    (tmp_path / "several.py").write_text(STEP)
    with project(tmp_path):
        for role, wants in (("optimizers.members.0.class", ROLES["optimizer.class"].wants),
                            ("optimizers.members.12.class", ROLES["optimizer.class"].wants)):
            assert refused(role, "several:step", where) == (f"{role} 'several:step' is refused: it is a function, and "
                                                            f"{wants} is wanted; {TRUST_HINT}")
            assert load_callable(role, "several:step", where=where, trust_code=True)() == 0
        for role in ("optimizers.members.0.factory", "optimizers.members.3.scheduler.factory"):
            assert load_callable(role, "several:step", where=where)() == 0
        for role in ("optimizers.members.x.class", "optimizers.members.0", "xoptimizers.members.0.class"):
            with pytest.raises(KeyError):
                check_callable(role, "several:step", where=where)
        assert refused("optimizers.members.2.scheduler.factory", "torch.optim:SGD", where).startswith(
            "optimizers.members.2.scheduler.factory 'torch.optim:SGD' is refused: it is torch.optim.sgd.SGD, whose file")


# ---- loading ---------------------------------------------------------------------------------------------------


def test_a_script_by_each_path_that_reaches_it(tmp_path):
    """A script by its absolute path, by a path relative to the working directory, or by its name in a --code-path
    folder, run once (a second load is the same module); its definitions refused where it lies in the run directory
    and admitted from the next place that holds it."""
    code, cwd, run = tmp_path / "code", tmp_path / "cwd", tmp_path / "cwd" / "run"
    run.mkdir(parents=True)
    code.mkdir()
    for folder in (code, cwd, run):
        (folder / "train.py").write_text(f"RUNS = []\nRUNS.append(1)\nWHERE = {str(folder)!r}\n{STEP}\n"
                                         "def typed(x: int) -> None:\n    pass\n")
    where = tmp_path / "manifest.json"
    with project(cwd):
        step = load_callable("step_fn", f"{code / 'train.py'}:step", where=where, search_paths=[code])
        module = sys.modules[step.__module__]
        assert module.WHERE == str(code) and module.__file__ == str(code / "train.py")
        assert step.__code__.co_filename == str(code / "train.py")  # its tracebacks name the script
        assert module.typed.__annotations__ == {"x": int, "return": None}  # compiled as itself, not with our future
        assert load_callable("step_fn", f"{code / 'train.py'}:RUNS", where=where, search_paths=[code],
                             trust_code=True) == [1]  # ran once
        assert load_callable("step_fn", "train.py:WHERE", where=where, trust_code=True) == str(cwd)
        assert load_callable("step_fn", "elsewhere/train.py:WHERE", where=where, search_paths=[code],
                             trust_code=True) == str(code)
        assert load_callable("step_fn", "run/train.py:WHERE", where=where, search_paths=[code], forbidden=run,
                             trust_code=True) == str(code)  # the run's own is passed over for the next
        assert refused("step_fn", "run/train.py:step", where, forbidden=run) == (
            f"step_fn 'run/train.py:step' is refused: script run/train.py ({cwd / 'run' / 'train.py'}) lies inside the "
            f"run directory; pass --trust-run-dir to allow code shipped with the run; {TRUST_HINT}")
        assert refused("step_fn", "lost/none.py:step", where, search_paths=[code]) == (
            "script lost/none.py does not exist here; pass --code-path DIR, DIR the folder that holds none.py itself")
        assert refused("step_fn", "train.py:nothing", where) == (
            "'train.py:nothing': train.py has no attribute 'nothing'")
        with pytest.raises(MissingName):
            load_callable("step_fn", "train.py:RUNS.nothing", where=where)


def test_a_script_that_fails_is_left_unloaded(tmp_path):
    """A script that raises while it defines is refused in one line naming it and the error, and is not kept: a
    second load runs it again. A FIFO in its place is refused on reading, never waited on."""
    (tmp_path / "broken.py").write_text("open('ran', 'a').write('x')\nraise ValueError('no')\n")
    os.mkfifo(tmp_path / "fifo.py")
    where = tmp_path / "manifest.json"
    with project(tmp_path):
        for runs in ("x", "xx"):
            assert refused("step_fn", "broken.py:step", where) == (
                f"running script {tmp_path / 'broken.py'} for its definitions raised ValueError: no")
            assert (tmp_path / "ran").read_text() == runs
        assert not any(m.startswith("_nanforensics_user_") and getattr(sys.modules[m], "__file__", "").endswith("broken.py")
                       for m in sys.modules)
        with pytest.raises(BadInput) as error:
            load_callable("step_fn", "fifo.py:step", where=where)
        assert str(error.value) == f"{tmp_path / 'fifo.py'}: not a regular file (a FIFO)"


def test_a_module_by_each_path_that_reaches_it(tmp_path):
    """A module of the project, a package's module (set on its package, as the import system does), one loaded
    already, one that puts another in its place (then no module: refused after); a module that fails at import is
    refused naming the error and is not left half-imported (nor when it exits, nor when it took itself out first); a
    module below one that is no package, and a name found nowhere, say so."""
    pkg = tmp_path / "proj_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text(STEP)
    (tmp_path / "proj_swap.py").write_text("import sys, types\nsys.modules[__name__] = types.SimpleNamespace(step=len)\n")
    (tmp_path / "proj_boom.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "proj_gone.py").write_text("import sys\ndel sys.modules[__name__]\nraise RuntimeError('gone')\n")
    (pkg / "inner").mkdir()
    (pkg / "inner" / "__init__.py").write_text("")
    (pkg / "inner" / "leaf.py").write_text(STEP)
    (pkg / "flat.py").write_text(STEP)
    (tmp_path / "proj_missing.py").write_text("import proj_no_such_module\n")
    (tmp_path / "proj_exit.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "proj_flat.py").write_text(STEP)
    where = tmp_path / "manifest.json"
    with project(tmp_path):
        step = load_callable("step_fn", "proj_pkg.sub:step", where=where)
        assert step() == 0 and sys.modules["proj_pkg"].sub is sys.modules["proj_pkg.sub"]
        assert load_callable("step_fn", "proj_pkg.sub:step", where=where) is step  # loaded already
        assert imports.resolve("proj_swap:step", role="step_fn", where=where, places=Places.chosen()) is len
        assert refused("step_fn", "proj_swap:step", where) == (  # in its place: no module, nothing to decide by
            f"step_fn 'proj_swap:step' is refused: proj_swap has no file to decide by; {TRUST_HINT}")
        assert refused("step_fn", "proj_boom:step", where) == "importing proj_boom for 'proj_boom:step' raised RuntimeError: boom"
        assert refused("step_fn", "proj_gone:step", where) == "importing proj_gone for 'proj_gone:step' raised RuntimeError: gone"
        assert load_callable("step_fn", "proj_pkg.inner.leaf:step", where=where)() == 0
        assert sys.modules["proj_pkg.inner"].leaf is sys.modules["proj_pkg.inner.leaf"]
        assert refused("step_fn", "proj_pkg.flat.sub:step", where) == (
            "'proj_pkg.flat.sub:step' is not importable here (proj_pkg.flat is not a package)")
        assert refused("step_fn", "proj_missing:step", where) == (
            "'proj_missing:step' is not importable here (No module named 'proj_no_such_module'); pass --code-path DIR to "
            "name where the user's code lives")
        assert "proj_boom" not in sys.modules and "proj_missing" not in sys.modules
        with pytest.raises(SystemExit):
            load_callable("step_fn", "proj_exit:step", where=where)
        assert "proj_exit" not in sys.modules
        for loaded in (False, True):
            if loaded:
                load_callable("step_fn", "proj_flat:step", where=where)
            assert refused("step_fn", "proj_flat.sub:step", where) == (
                "'proj_flat.sub:step' is not importable here (proj_flat is not a package)")
        for trust_code in (False, True):
            assert refused("step_fn", "proj_nowhere.sub:step", where, trust_code=trust_code) == (
                "'proj_nowhere.sub:step' is not importable here (no module named 'proj_nowhere'); pass --code-path "
                "DIR to name where the user's code lives" if not trust_code else
                "'proj_nowhere.sub:step' is not importable here (No module named 'proj_nowhere'); pass --code-path DIR "
                "to name where the user's code lives")


def test_a_module_with_nothing_to_decide_by(tmp_path):
    """A module loaded with no spec, a package whose search path cannot be read: refused in one line (the first
    admitted by --trust-code); a built-in or frozen module not yet loaded is the standard library's."""
    bare = types.ModuleType("proj_bare")
    bare.__spec__ = None
    bare.step = len  # type: ignore[attr-defined]
    pkg = tmp_path / "proj_badpath"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class Path:\n    def __iter__(self):\n        raise ValueError('unreadable')\n\n"
                                     "__path__ = Path()\n")
    where = tmp_path / "manifest.json"
    with project(tmp_path):
        sys.modules["proj_bare"] = bare
        assert refused("step_fn", "proj_bare:step", where) == (
            f"step_fn 'proj_bare:step' is refused: proj_bare has no file to decide by; {TRUST_HINT}")
        assert imports.resolve("proj_bare:step", role="step_fn", where=where, places=Places(trust_code=True)) is len
        assert refused("step_fn", "proj_badpath.sub:step", where) == "'proj_badpath.sub:step' is not importable here (unreadable)"
        unloaded = sorted(set(sys.builtin_module_names) - set(sys.modules))[0]
        assert refused("step_fn", f"{unloaded}:f", where) == (
            f"step_fn '{unloaded}:f' is refused: {unloaded} is part of Python's standard library (built into the "
            f"interpreter), which a run may not call; {TRUST_HINT}")
        assert refused("step_fn", "__hello__:main", where) == (
            "step_fn '__hello__:main' is refused: __hello__ is part of Python's standard library (frozen into the "
            f"interpreter), which a run may not call; {TRUST_HINT}")


class _Raising(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder on sys.meta_path alone (as an import hook is) whose module raises when it runs."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "proj_hooked" else None

    def exec_module(self, module):
        raise RuntimeError("hooked")


def test_a_module_only_an_import_hook_finds(tmp_path, monkeypatch):
    """Refused as not importable (the hooks may run code to answer), and imported by the import system under
    --trust-code, its failure named; the tool's own modules are imported by the import system, a missing one named."""
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, _Raising()])
    where = tmp_path / "manifest.json"
    with project(tmp_path):
        assert refused("step_fn", "proj_hooked:step", where).startswith(
            "'proj_hooked:step' is not importable here (no module named 'proj_hooked')")
        assert refused("step_fn", "proj_hooked:step", where, trust_code=True) == (
            "importing proj_hooked for 'proj_hooked:step' raised RuntimeError: hooked")
        assert refused("optimizer.class", "torch.optim.no_such:Adam", where) == (
            "'torch.optim.no_such:Adam' is not importable here (No module named 'torch.optim.no_such'); pass "
            "--code-path DIR to name where the user's code lives")
        assert load_callable("optimizer.class", "torch.optim:Adam", where=where) is torch.optim.Adam


def test_a_module_in_a_folder_kept_off_the_path_is_refused_by_where_it_lies(tmp_path):
    """The working directory and a --code-path folder inside the run directory are never on sys.path; a module
    there is found only to say why it is refused. Outside it, a module is found there first."""
    run = tmp_path / "run"
    (run / "code").mkdir(parents=True)
    (run / "proj_shipped.py").write_text(STEP)
    (run / "code" / "proj_coded.py").write_text(STEP)
    where = run / "manifest.json"
    with project(run):
        path = list(sys.path)
        for spec, file in (("proj_shipped:step", run / "proj_shipped.py"), ("proj_coded:step", run / "code" / "proj_coded.py")):
            assert refused("step_fn", spec, where, search_paths=[run / "code"], forbidden=run) == (
                f"step_fn {spec!r} is refused: {spec.partition(':')[0]} ({file}) lies inside the run directory; pass "
                f"--trust-run-dir to allow code shipped with the run; {TRUST_HINT}")
            assert sys.path == path
        assert load_callable("step_fn", "proj_coded:step", where=where, search_paths=[run / "code"])() == 0


def _fake_distribution(site: Path, name: str, module: str) -> None:
    """An installed distribution ``name`` whose top-level package ``module`` it installed no file of (as an editable
    install points at its source), and a module file ``{module}_file.py`` it did."""
    (site / module).mkdir()
    (site / module / "__init__.py").write_text(STEP)
    (site / f"{module}_file.py").write_text(STEP)
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{module}\n{module}_file\n")
    (info / "RECORD").write_text(f"{module}_file.py,,\n{info.name}/METADATA,,\n")


def test_each_trusted_distribution_adds_its_places(tmp_path, monkeypatch):
    """Every distribution --trust-package names adds its modules, files and folders to the others'."""
    imports._distribution.cache_clear()  # looked up once a process: a run of the tests before this one made others
    for name, module in (("proj-one", "proj_one"), ("proj-two", "proj_two")):
        _fake_distribution(tmp_path, name, module)
    monkeypatch.syspath_prepend(str(tmp_path))
    places = Places.chosen(packages=["proj-one", "proj_two"])
    assert places.package_tops == {"proj_one", "proj_one_file", "proj_two", "proj_two_file"}
    assert places.package_files == {tmp_path / "proj_one_file.py", tmp_path / "proj_two_file.py",
                                    tmp_path / "proj_one-1.0.dist-info" / "METADATA",
                                    tmp_path / "proj_two-1.0.dist-info" / "METADATA"}
    assert places.package_folders == (tmp_path / "proj_one", tmp_path / "proj_two")


def test_the_program_running_under_trust_code(tmp_path):
    """--trust-code lifts the refusal of the program running before the import too (``__main__`` is whatever runs
    the tests here: its name is the one attribute it surely has)."""
    assert load_callable("step_fn", "__main__:__name__", where=tmp_path / "m.json", trust_code=True) == "__main__"
    assert "the program running" in refused("step_fn", "__main__:__name__", tmp_path / "m.json")


def test_an_object_whose_module_is_no_name_is_refused_not_raised(tmp_path):
    """``__module__`` is what an object says it is: a list or a dict there is refused in one line, as an object
    defined in no file, never a traceback (it was a TypeError: neither can be looked up)."""
    (tmp_path / "proj_claims.py").write_text("class Claims:\n    __module__ = ['x']\n\nthing = Claims()\n"
                                             "class Listed:\n    __module__ = ['y']\n\n"
                                             "def step():\n    pass\n\nstep.__module__ = {'z': 1}\n")
    where = tmp_path / "manifest.json"
    with project(tmp_path):
        for spec, problem in (("proj_claims:thing", "it is a Claims object, not a function or class defined in a module"),
                              ("proj_claims:Listed", "it is None.Listed, defined in no file"),
                              ("proj_claims:step", "it is None.step, defined in no file")):
            assert refused("model_factory", spec, where) == f"model_factory {spec!r} is refused: {problem}; {TRUST_HINT}"
