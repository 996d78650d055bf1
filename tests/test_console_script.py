"""Every command through the installed console script, as a process, beside the same call in the test process:
the same exit code, stdout and stderr. The rest of the suite calls the CLI in-process (``conftest.run_cli``, through
``tests/cli_inprocess.py``) for speed; this is where the two are held equal, on the shipped sample runs."""

from __future__ import annotations

import os
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cli_inprocess import _user_code
from conftest import ROOT, Result, cli_command, run_cli, tree_digest

SAMPLE, CODE = ROOT / "sample_runs" / "seed_adam", ROOT / "sample_runs" / "code"
TIMED = re.compile(r"^nanforensics: \[[a-z -]+\] .* elapsed")  # a progress update: when one comes is timing


def calls(saved: Path) -> dict[str, tuple[str | Path, ...]]:
    """Each command on the sample, a usage error, a bad input and --version; paths the same from either folder."""
    return {
        "scan": ("scan", SAMPLE / "checkpoints" / "step_00000020"),
        "bisect": ("bisect", SAMPLE, "--markdown", "bisect.md"),
        "replay": ("replay", SAMPLE, "--code-path", CODE, "--json", "replay.json"),
        "postmortem": ("postmortem", SAMPLE, "--code-path", CODE),  # its JSON holds each analysis' seconds
        "repair": ("repair", SAMPLE, "--code-path", CODE, "--out", "repaired", "--verify-steps", "2"),
        "report": ("report", saved, "--markdown", "-"),
        "version": ("--version",),
        "usage": ("replay", "--from-step"),
        "bad input": ("scan", "missing.pt"),
    }


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Result, Result, Path, Path]]:
    """name -> (the process' result, the in-process one, the process' folder, the in-process one); the processes run
    meanwhile, two at a time, the in-process calls on this thread."""
    saved = tmp_path_factory.mktemp("saved") / "report.json"
    assert run_cli("replay", SAMPLE, "--code-path", CODE, "--json", saved, "--quiet").code == 1
    before = tree_digest(SAMPLE)
    todo = calls(saved)
    folders = {(name, way): tmp_path_factory.mktemp(f"{name.replace(' ', '_')}-{way}") for name in todo
               for way in ("process", "in")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        processes = {name: pool.submit(run_cli, *args, cwd=folders[name, "process"], process=True)
                     for name, args in todo.items()}
        inside = {name: run_cli(*args, cwd=folders[name, "in"]) for name, args in todo.items()}
        out = {name: (processes[name].result(), inside[name], folders[name, "process"], folders[name, "in"])
               for name in todo}
    assert tree_digest(SAMPLE) == before
    return out


def test_the_console_script_is_installed():
    assert Path(cli_command()[0]).name == "nanforensics", cli_command()  # the entry point pip installs


@pytest.mark.parametrize("name", list(calls(Path("saved.json"))))
def test_in_process_call_is_the_process(both, name):
    process, inside, process_dir, inside_dir = both[name]
    assert (inside.code, inside.stdout) == (process.code, process.stdout)
    assert [line for line in inside.stderr.splitlines() if not TIMED.match(line)] == \
           [line for line in process.stderr.splitlines() if not TIMED.match(line)]
    assert tree_digest(inside_dir) == tree_digest(process_dir) or name == "repair"  # its meta.json holds a time
    assert sorted(p.relative_to(inside_dir) for p in inside_dir.rglob("*")) == \
           sorted(p.relative_to(process_dir) for p in process_dir.rglob("*"))
    expected = {"scan": 0, "version": 0, "report": 0, "usage": 2, "bad input": 2}
    assert process.code == expected.get(name, 1 if name != "repair" else 0), process.stderr


def test_an_in_process_call_leaves_the_process_as_it_was(tmp_path):
    """A replay sets torch's threads and RNG from the run and imports the run's code: none of it outlives the call."""
    def state() -> tuple[object, ...]:
        return (torch.get_num_threads(), torch.get_rng_state().tolist(), os.getcwd(), dict(os.environ), sys.path[:],
                sorted(n for n, m in list(sys.modules.items()) if _user_code(m)), signal.getsignal(signal.SIGINT),
                sys.stdout, sys.stderr, sys.argv, sys.modules["__main__"])

    before = state()
    result = run_cli("replay", SAMPLE, "--code-path", CODE, "--quiet", "--no-explain", cwd=tmp_path)
    assert result.code == 1 and "responsible step 27" in result.stdout, result.stderr
    after = state()
    assert [i for i, (a, b) in enumerate(zip(before, after)) if a != b] == [], (before, after)
    assert sys.modules["regressor"].__file__ == str(CODE / "regressor.py")  # the tests' own, imported by scenarios
