"""The CLI called in the test process as a process would run it: ``nanforensics.cli.main`` with the console script's
argv, environment, working directory and sys.path, its stdout and stderr (file descriptors 1 and 2, so what C code
writes too) captured and decoded as ``subprocess.run(text=True)`` decodes a child's, its exit status as the process
would end with, and every piece of process state a call may change put back afterwards, so no call sees another's.

A process imports torch afresh (most of a CLI call's time in the tests); here it is imported once. What a fresh
process has that this one does not is set for the call from a probe of one (``_fresh``): sys.path, torch's thread
count, the warnings filters, the encodings of stdout and stderr. What stays process-wide here is torch's warn-once
state (a warning torch gives once per process shows in the first call only) and the modules of libraries the CLI
imported (imported once, as they would be in a long-lived process). The tests of what only a process has (signals,
hangs, start-up) run the console script as one (``conftest.run_cli(process=True)``)."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import json
import locale
import logging
import os
import random
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import traceback
import types
import warnings
from pathlib import Path
from typing import Any, Iterator

import nanforensics
import torch

# nanforensics' process-wide registries (what this process examined, wrote, is doing): empty in a fresh process, so
# emptied for each call and given back afterwards. Any other module-level container of nanforensics that a call
# changes fails the call (``_Leaks``), so a new registry cannot carry one test's state into the next unnoticed.
REGISTRIES = {
    "nanforensics.cli": ("_ACTIVITY",),
    "nanforensics.inputs": ("_trees",),
    "nanforensics.outputs": ("_inputs", "_may_create", "_sources", "_seen"),
    "nanforensics.distributed.world": ("_GLOO",),
}

_PROBE = """
import json, sys, warnings, torch
def pattern(p):
    return None if p is None else p if isinstance(p, str) else [p.pattern, p.flags]
print(json.dumps({
    "path": sys.path[1:], "threads": torch.get_num_threads(), "recursion": sys.getrecursionlimit(),
    "stdout": [sys.stdout.encoding, sys.stdout.errors, sys.stdout.line_buffering, sys.stdout.write_through],
    "stderr": [sys.stderr.encoding, sys.stderr.errors, sys.stderr.line_buffering, sys.stderr.write_through],
    "bytecode": sys.dont_write_bytecode,
    "filters": [[a, pattern(m), c.__module__, c.__qualname__, pattern(mod), n] for a, m, c, mod, n in warnings.filters],
}))
"""


@functools.cache
def _fresh(pythonpath: str) -> dict[str, Any]:
    """What a fresh process of the console script has after importing torch, from a probe of one."""
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True,
                         timeout=300).stdout
    return json.loads(out)


def _filters(fresh: dict[str, Any]) -> list[tuple[Any, ...]]:
    def pattern(p: Any) -> Any:
        import re

        return p if p is None or isinstance(p, str) else re.compile(p[0], p[1])

    out = []
    for action, message, module, qualname, where, lineno in fresh["filters"]:
        category: Any = importlib.import_module(module)
        for part in qualname.split("."):
            category = getattr(category, part)
        out.append((action, pattern(message), category, pattern(where), lineno))
    return out


def _show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    """A warning as a fresh process shows it: on its stderr (pytest records them instead)."""
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Where installed code lies (the standard library, site-packages) and nanforensics itself: a module from
    anywhere else (the tests' scenarios, a run's model.py) is user code, imported afresh by each call."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})[k]
              for k in ("stdlib", "platstdlib")}
    roots.add(os.path.dirname(nanforensics.__file__))
    return tuple(sorted({os.path.join(r, "") for root in roots for r in (root, os.path.realpath(root))}))


def _user_code(module: Any) -> bool:
    try:
        files = [module.__dict__.get("__file__"), *(module.__dict__.get("__path__", None) or [])]
    except (AttributeError, TypeError):  # not a plain module (torch.classes)
        return False
    files = [f for f in files if isinstance(f, str)]
    return bool(files) and not any(f.startswith(_library_roots()) for f in files)


class _Leaks:
    """nanforensics' module-level containers outside ``REGISTRIES``, to fail a call that changes one."""

    def __init__(self) -> None:
        self.before = {(name, attr): (value, copy.copy(value)) for name, attr, value in self._containers()}

    @staticmethod
    def _containers() -> Iterator[tuple[str, str, Any]]:
        for name, module in list(sys.modules.items()):
            if name == "nanforensics" or name.startswith("nanforensics."):
                skip = REGISTRIES.get(name, ())
                for attr, value in list(vars(module).items()):
                    if isinstance(value, (list, dict, set, bytearray)) and attr not in skip:
                        yield name, attr, value

    def check(self) -> None:
        for key, (value, was) in self.before.items():
            try:
                same = len(value) == len(was) and value == was
            except Exception:  # elements that do not compare (tensors): compared by identity
                same = len(value) == len(was) and all(a is b for a, b in zip(value, was))
            if not same:
                raise AssertionError(f"a CLI call changed {key[0]}.{key[1]}, process state a fresh process would not "
                                     "have: add it to tests/cli_inprocess.py's REGISTRIES")


# nanforensics.outputs' map of the source files of imported modules is a cache, valid for a module while that module
# object stays in sys.modules: rebuilt from empty it cost each call a realpath per module (thousands in a test
# process) and was most of an in-process call's time. The entries a call built for modules still loaded afterwards
# are given to the next call, for those modules it finds loaded, the same objects: what it would have computed.
_IMPORTED: dict[str, tuple[Any, list[str]]] = {}  # module name -> (the module, outputs._sources' files for it)


def _carry_imported(outputs: Any, keep: bool) -> None:
    """Give the call ``_IMPORTED``'s entries of the modules loaded now; ``keep``: record the call's in it first."""
    if keep:
        files: dict[str, list[str]] = {}
        for file, name in outputs._sources.items():
            files.setdefault(name, []).append(file)
        _IMPORTED.clear()
        _IMPORTED.update((name, (module, files.get(name, []))) for name, module in outputs._seen.items()
                         if sys.modules.get(name) is module)
        return
    for name, (module, files) in _IMPORTED.items():
        if sys.modules.get(name) is module:
            outputs._seen[name] = module
            outputs._sources.update((file, name) for file in files)


@contextlib.contextmanager
def _registries() -> Iterator[None]:
    """nanforensics' registries empty for the call, as a fresh process has them (but the cache ``_IMPORTED``
    carries), and given back afterwards."""
    saved = {}
    for name, attrs in REGISTRIES.items():
        module = sys.modules.get(name)
        for attr in attrs if module is not None else ():
            value = getattr(module, attr)
            saved[name, attr] = copy.copy(value)
            value.clear()
    if "nanforensics.outputs" in sys.modules:
        _carry_imported(sys.modules["nanforensics.outputs"], keep=False)
    try:
        yield
    finally:
        if "nanforensics.outputs" in sys.modules:
            _carry_imported(sys.modules["nanforensics.outputs"], keep=True)
        for name, attrs in REGISTRIES.items():  # modules the call imported first, too
            module = sys.modules.get(name)
            for attr in attrs if module is not None else ():
                value = getattr(module, attr)
                value.clear()
                if (name, attr) in saved:
                    (value.extend if isinstance(value, list) else value.update)(saved[name, attr])


@contextlib.contextmanager
def _modules(path: list[str]) -> Iterator[None]:
    """sys.path as the process has it; user code imported afresh (the next call may have another file of the same
    name), and dropped afterwards; the import system's caches and hooks as they were."""
    saved_path, meta_path, path_hooks = sys.path[:], sys.meta_path[:], sys.path_hooks[:]
    importers = set(sys.path_importer_cache)
    hidden = {name: m for name, m in list(sys.modules.items()) if _user_code(m)}
    for name in hidden:
        del sys.modules[name]
    before = set(sys.modules)
    sys.path[:] = path
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path[:] = saved_path
        sys.meta_path[:] = meta_path
        sys.path_hooks[:] = path_hooks
        for key in set(sys.path_importer_cache) - importers:
            del sys.path_importer_cache[key]
        for name in set(sys.modules) - before:
            if _user_code(sys.modules[name]):
                del sys.modules[name]
        sys.modules.update(hidden)


@contextlib.contextmanager
def _environment(env: dict[str, str], cwd: Path | None) -> Iterator[None]:
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    try:
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


@contextlib.contextmanager
def _torch_state(threads: int) -> Iterator[None]:
    """torch's process-wide settings as a fresh process has them, and this process' back afterwards (a replay sets
    the thread count and the RNG from the run; user code may seed or switch modes)."""
    saved = (torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled(),
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    rng, py_rng = torch.get_rng_state(), random.getstate()
    np_rng = sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None
    torch.set_num_threads(threads)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(False)
    torch.autograd.set_detect_anomaly(False)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.set_default_dtype(saved[1])
        torch.set_grad_enabled(saved[2])
        torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
        torch.autograd.set_detect_anomaly(saved[5], check_nan=saved[6])
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        if np_rng is not None:
            sys.modules["numpy"].random.set_state(np_rng)


@contextlib.contextmanager
def _handlers(fresh: dict[str, Any]) -> Iterator[None]:
    """Signal handlers, warnings, logging and the interpreter's limits as a fresh process has them, this process'
    back afterwards."""
    signals = {}
    for sig in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            signals[sig] = signal.getsignal(sig)
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    saved_logs = [(lg, lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in loggers]
    disabled = logging.root.manager.disable
    root = logging.getLogger()
    root.handlers[:] = []  # pytest's capture; a fresh process has none: warnings reach stderr (logging.lastResort)
    root.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    limit, bytecode = sys.getrecursionlimit(), sys.dont_write_bytecode
    sys.setrecursionlimit(fresh["recursion"] + depth)  # the stack room the console script's main() would have
    sys.dont_write_bytecode = fresh["bytecode"]
    try:
        with warnings.catch_warnings():
            warnings.filters[:] = _filters(fresh)
            warnings.filterwarnings("default", message="\x00never")  # invalidates the modules' warning registries
            warnings.filters.pop(0)
            warnings.showwarning = _show
            yield
    finally:
        sys.setrecursionlimit(limit)
        sys.dont_write_bytecode = bytecode
        for sig, handler in signals.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)
        logging.disable(disabled)
        known = {id(lg) for lg in loggers}
        for lg in logging.Logger.manager.loggerDict.values():  # loggers the call created keep no handler
            if isinstance(lg, logging.Logger) and id(lg) not in known:
                lg.handlers[:] = []
        for lg, handlers, level, propagate, off in saved_logs:
            lg.handlers[:] = handlers
            lg.level, lg.propagate, lg.disabled = level, propagate, off
        logging.Logger.manager._clear_cache()  # type: ignore[attr-defined]


@contextlib.contextmanager
def _streams(fresh: dict[str, Any], out: int, err: int) -> Iterator[None]:
    """Descriptors 1 and 2 onto the files ``out`` and ``err``, and sys.stdout and sys.stderr over them made as the
    interpreter makes a piped process' (encoding, errors, buffering)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    streams = sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__
    os.dup2(out, 1)
    os.dup2(err, 2)

    def text(fd: int, encoding: str, errors: str, line_buffering: bool, write_through: bool) -> Any:
        import io

        return io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)), encoding=encoding, errors=errors,
                                line_buffering=line_buffering, write_through=write_through)

    sys.stdout = sys.__stdout__ = text(1, *fresh["stdout"])
    sys.stderr = sys.__stderr__ = text(2, *fresh["stderr"])
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__ = streams
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for fd in saved_fds:
            os.close(fd)


def _status(code: object) -> int:
    """The exit status ``sys.exit(code)`` ends a process with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class _Expired(BaseException):
    """The call ran past its timeout (raised by SIGALRM wherever it waits, a FIFO's open included)."""


def _expire(signum: int, frame: object) -> None:
    raise _Expired()


def _main(main: Any) -> int:
    """``sys.exit(main())`` as the console script runs it, ended as the interpreter ends it."""
    try:
        main()
        return 0
    except _Expired:
        raise
    except SystemExit as e:
        return _status(e.code)
    except BaseException as e:  # uncaught: the interpreter prints the traceback (of the script's frames)
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1


_lock = threading.Lock()


def call(script: str, args: list[str], env: dict[str, str], cwd: Path | None, timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``script args`` run in ``env`` and ``cwd``, as ``subprocess.run(text=True)``
    returns them, from ``nanforensics.cli.main`` called here; ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the in-process CLI sets signal handlers: call it on the main thread (or process=True)")
    from nanforensics.distributed.env import torchrun_env

    fresh = _fresh(env.get("PYTHONPATH", ""))
    with _lock, tempfile.TemporaryFile(buffering=0) as out, tempfile.TemporaryFile(buffering=0) as err:
        threads = set(threading.enumerate())
        leaks = _Leaks()
        main_module = types.ModuleType("__main__")
        main_module.__file__ = script
        argv, main_before = sys.argv, sys.modules["__main__"]
        with contextlib.ExitStack() as stack:
            stack.enter_context(_environment(env, cwd))
            if torchrun_env() is not None:
                raise RuntimeError("under torchrun's variables the CLI ends the process (os._exit): process=True")
            stack.enter_context(_modules([os.path.dirname(script), *fresh["path"]]))
            stack.enter_context(_torch_state(fresh["threads"]))
            stack.enter_context(_registries())
            stack.enter_context(_streams(fresh, out.fileno(), err.fileno()))
            stack.enter_context(_handlers(fresh))
            sys.argv, sys.modules["__main__"] = [script, *args], main_module
            signal.signal(signal.SIGALRM, _expire)  # put back by _handlers
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                from nanforensics.cli import main

                code = _main(main)
                for thread in set(threading.enumerate()) - threads:  # the interpreter waits for them at exit
                    if not thread.daemon:
                        thread.join(60)
            except _Expired:
                raise subprocess.TimeoutExpired([script, *args], timeout) from None
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                sys.argv, sys.modules["__main__"] = argv, main_before
        leaks.check()
        encoding = locale.getpreferredencoding(False)
        results = []
        for f in (out, err):
            f.seek(0)
            results.append(f.read().decode(encoding).replace("\r\n", "\n").replace("\r", "\n"))
    return code, results[0], results[1]
