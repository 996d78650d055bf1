"""One command on one mutant, run as a process under a time limit and an address-space limit, and the invariants
the README's Security section states, checked on what it did.

Two ways to run it: ``fork`` calls the CLI's real entry point (``cli_inprocess.call``) in a child forked from this
process, which has torch imported already (milliseconds instead of the 1.5 s a fresh interpreter takes); ``spawn``
starts the console script (or ``python -m nanforensics``) as a user does, for what only a fresh process shows: start-up
imports, the interpreter's own stream encoding under ``PYTHONIOENCODING=ascii``. Either way the child's address space
is capped (``RLIMIT_AS``), a child past its time is killed, and death by a signal is seen as such."""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from conftest import cli_command, cli_env, error_lines

from . import payload

TIME_LIMIT_S = 60.0  # a call past it is a hang
MEMORY_LIMIT = 3 * 2**30  # address space a call may add to what it starts with (torch imported)
SPAWN_MEMORY_LIMIT = 8 * 2**30  # a fresh console script's whole address space
OUTPUT_LIMIT = 256 * 1024  # stdout + stderr: a name printed whole (64 MiB) is unbounded output
CATCH_ALL = "(set NANFORENSICS_DEBUG=1 for the traceback)"  # cli.main's line for an exception nobody foresaw
EXIT_CODES = {0, 1, 2, 3, 4}  # the README's table less 130 (no Ctrl-C here); 5 for scan and bisect alone
EXIT_CODES_5 = {"scan", "bisect"}


@dataclass
class Outcome:
    code: int | None  # exit status; None when killed by a signal or the time limit
    stdout: str
    stderr: str
    signal: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    max_rss: int = 0  # bytes
    harness: str = ""  # the harness' own failure (not the command's), to be told apart


@dataclass
class Workspace:
    """A mutant's folder: ``in`` the examined tree, ``out`` where outputs are named, ``cwd`` the working directory,
    ``tmp`` $TMPDIR; the payload's sentinel beside them. Only the named outputs may appear afterwards."""

    root: Path
    tree: Path = field(init=False)
    out: Path = field(init=False)
    cwd: Path = field(init=False)
    tmp: Path = field(init=False)
    sentinel: Path = field(init=False)

    def __post_init__(self) -> None:
        for name, child in (("tree", "in"), ("out", "out"), ("cwd", "cwd"), ("tmp", "tmp"), ("sentinel", "SENTINEL")):
            setattr(self, name, self.root / child)

    def make(self, seed: Path) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        shutil.copytree(seed, self.tree, symlinks=True)
        for d in (self.out, self.cwd, self.tmp):
            d.mkdir()
        payload.plant(self.tree, self.sentinel)

    def remove(self) -> None:
        for p in self.root.rglob("*"):  # a folder made unreadable or unwritable by a mutant
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o700)
        shutil.rmtree(self.root, ignore_errors=True)


def digest(root: Path) -> dict[str, str]:
    """Every entry under root by its kind, mode, size and content hash (lstat: a symlink is not followed, a FIFO not
    opened, a sparse file's hole not read past 64 MiB)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        key = str(p.relative_to(root))
        if stat.S_ISREG(st.st_mode):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                h.update(f.read(64 * 2**20))
            out[key] = f"file {oct(st.st_mode)} {st.st_size} {h.hexdigest()}"
        elif stat.S_ISLNK(st.st_mode):
            out[key] = f"link {os.readlink(p)}"
        else:
            out[key] = f"other {oct(st.st_mode)}"
    return out


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def run_fork(args: list[str], ws: Workspace, *, ascii_streams: bool = False, time_limit: float = TIME_LIMIT_S,
             memory_limit: int = MEMORY_LIMIT) -> Outcome:
    """The CLI's real entry point in a forked child: its address space capped, killed past the time limit."""
    from cli_inprocess import _fresh, call

    env = cli_env(TMPDIR=str(ws.tmp), **({"PYTHONIOENCODING": "ascii", "LANG": "C"} if ascii_streams else {}))
    _fresh(env.get("PYTHONPATH", ""))  # probed once, here, before any fork
    result = ws.root.parent / f".{ws.root.name}.result"
    start = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 0
        try:
            limit = _address_space() + memory_limit
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            tempfile.tempdir = str(ws.tmp)
            if ascii_streams:
                import cli_inprocess

                fresh = dict(_fresh(env.get("PYTHONPATH", "")))
                fresh["stdout"] = ["ascii", "strict", *fresh["stdout"][2:]]
                fresh["stderr"] = ["ascii", "backslashreplace", *fresh["stderr"][2:]]
                cli_inprocess._fresh = lambda _path: fresh  # type: ignore[assignment]
            code, out, err = call(cli_command()[0], args, env, ws.cwd, timeout=time_limit)
            data = {"code": code, "stdout": out, "stderr": err}
        except subprocess.TimeoutExpired:
            data = {"timed_out": True}
        except BaseException:
            data = {"harness": traceback.format_exc()[-4000:]}
        try:
            result.write_text(json.dumps(data))
        except BaseException:
            status = 70
        os._exit(status)
    deadline = start + time_limit + 30
    while True:
        done, wstatus, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.wait4(pid, 0)
            result.unlink(missing_ok=True)
            return Outcome(None, "", "", timed_out=True, seconds=time.monotonic() - start)
        time.sleep(0.005)
    seconds = time.monotonic() - start
    if os.WIFSIGNALED(wstatus):
        result.unlink(missing_ok=True)
        return Outcome(None, "", "", signal=os.WTERMSIG(wstatus), seconds=seconds, max_rss=usage.ru_maxrss * 1024)
    data = json.loads(result.read_text()) if result.exists() else {"harness": f"child exited {wstatus} with no result"}
    result.unlink(missing_ok=True)
    return Outcome(data.get("code"), data.get("stdout", ""), data.get("stderr", ""), timed_out=data.get("timed_out", False),
                   seconds=seconds, max_rss=usage.ru_maxrss * 1024, harness=data.get("harness", ""))


def run_spawn(args: list[str], ws: Workspace, *, module_in_tree: bool = False, time_limit: float = TIME_LIMIT_S) -> Outcome:
    """The console script as a fresh process, ``LANG=C PYTHONIOENCODING=ascii``, its address space capped; with
    ``module_in_tree``, ``python -m nanforensics`` started from inside the examined tree (as torchrun workers start)."""
    env = cli_env(TMPDIR=str(ws.tmp), LANG="C", LC_ALL="C", PYTHONIOENCODING="ascii")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (SPAWN_MEMORY_LIMIT, SPAWN_MEMORY_LIMIT))

    command = [sys.executable, "-m", "nanforensics"] if module_in_tree else cli_command()
    start = time.monotonic()
    p = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         cwd=ws.tree if module_in_tree else ws.cwd, preexec_fn=limit)
    try:
        out, err = p.communicate(timeout=time_limit)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return Outcome(None, "", "", timed_out=True, seconds=time.monotonic() - start)
    text = (out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
    if p.returncode < 0:
        return Outcome(None, *text, signal=-p.returncode, seconds=time.monotonic() - start)
    return Outcome(p.returncode, *text, seconds=time.monotonic() - start)


# ---- the invariants ------------------------------------------------------------------------------------------------

_EXC = re.compile(r"nanforensics: error: ([A-Za-z_][\w.]*(?:Error|Exception|Warning|Interrupt|Exit)?): (.*) \(set NANFOR")


def violations(command: str, outcome: Outcome, ws: Workspace, before: dict[str, str], outputs: list[Path],
               target: str) -> list[str]:
    """The invariants broken by one call, each as a class name, the gravest first (code run, inputs written); empty
    when all hold. ``target`` is the mutated file, relative to the tree; ``outputs`` the paths the command line named."""
    found: list[str] = []
    if outcome.harness:
        return [f"harness: {outcome.harness.strip().splitlines()[-1][:120]}"]
    if outcome.timed_out:
        found.append("hang: past the time limit")
    elif outcome.signal is not None:
        found.append(f"signal: {signal.Signals(outcome.signal).name}")
    else:
        codes = EXIT_CODES | ({5} if command in EXIT_CODES_5 else set())
        if outcome.code not in codes:
            found.append(f"exit code {outcome.code} not in the README's table")
        if "Traceback (most recent call last)" in outcome.stderr:
            last = [ln for ln in outcome.stderr.strip().splitlines() if ln and not ln.startswith(" ")][-1:]
            found.append(f"traceback: {(last or ['?'])[0].split(':')[0][:60]}")
        if CATCH_ALL in outcome.stderr:
            m = _EXC.search(outcome.stderr)
            found.append(f"catch-all: {m.group(1) if m else '?'}: {_shape(m.group(2)) if m else ''}")
        if len(outcome.stdout) + len(outcome.stderr) > OUTPUT_LIMIT:
            found.append("output unbounded")
        if outcome.code == 2 and CATCH_ALL not in outcome.stderr:
            lines = error_lines(outcome.stderr)
            if len(lines) != 1:
                found.append(f"error in {len(lines)} lines")
            elif not _names_a_file(lines[0], ws, target):
                found.append("error names no file")
            elif str(ws.tmp) in lines[0]:
                found.append("error names a temporary path")
    stray = _stray(ws, outputs)
    if stray:
        found.insert(0, f"created outside the named outputs: {stray[0]}")
    if digest(ws.tree) != before:
        found.insert(0, "input changed")
    if ws.sentinel.exists():
        found.insert(0, "payload ran")
    return found


def _shape(message: str) -> str:
    """An exception message's first words, without its values: one class, whatever the values."""
    return " ".join(re.findall(r"[a-z]{3,}", re.sub(r"'[^']*'", "", message.lower()))[:4])


def _names_a_file(line: str, ws: Workspace, target: str) -> bool:
    """The line names the mutated file, a folder on its way, or another file of the examined tree (the run's
    manifest naming the code it cannot import, a checkpoint naming its folder)."""
    names = {p.name for p in ws.tree.rglob("*")} | set(Path(target).parts) | {ws.tree.name}
    return any(n and n in line for n in names)


# torch's per-user cache folder: torch makes it in $TMPDIR when dynamo is first imported, which building any optimizer
# does (Optimizer.add_param_group is wrapped by torch._disable_dynamo). Not the tool's: every torch program makes it.
TORCH_CACHE = re.compile(r"tmp/torchinductor_[^/]+(/.*)?$")


def _stray(ws: Workspace, outputs: list[Path]) -> list[str]:
    """What the call created outside its named outputs: in the workspace, its cwd, its $TMPDIR."""
    allowed = {ws.tree, ws.out, ws.cwd, ws.tmp, ws.sentinel, *outputs}
    out = []
    for p in sorted(ws.root.rglob("*")):
        if p == ws.tree or ws.tree in p.parents:
            continue
        if TORCH_CACHE.match(str(p.relative_to(ws.root))):
            continue
        if p in allowed or any(o in p.parents for o in outputs):
            continue
        out.append(str(p.relative_to(ws.root)))
    return out
