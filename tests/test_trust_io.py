"""One way in, one way out (issue 19, items 2, 3, 4 and 6): the hostile inputs as CLI cases, and each class as a
property over generated members.

Classes: A, outputs over every kind of path (``outputs``, the one writer); B, reads of every kind of file and of
claims a header, a stride or a step number makes (``inputs``, the one reader); C, JSON fields of every wrong type
(``schema``); D, secrets behind symlinks; E, DCP chunks that leave holes. The CLI cases run concurrently, as
tests/test_faults.py's do, and count in conftest's summary by command and class.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import math
import os
import pickle
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import types
import typing
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics import inputs, outputs
from nanforensics.errors import BadInput
from nanforensics.formats import torch_file
from nanforensics.formats.dcp import _Chunk, _Tensor, _tiling_problem
from nanforensics.inputs import SafetensorsFile, examine, load_json, read_input
from nanforensics.outputs import append_output, check_outputs, expand, write_output
from nanforensics.runs.checkpoint import Checkpoint, CheckpointMeta
from nanforensics.runs.run import Run, batch_gaps
from nanforensics.saved import load_report

from conftest import FAULT_CASE, ROOT, Result, error_lines, run_cli, tree_digest
from test_faults import time_limit

SAMPLE = ROOT / "sample_runs" / "seed_adam"  # replays from the checkout's root, where its code lies
CK = Path("checkpoints") / "step_00000010"
SECRET = "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
WRITER, READER, SCHEMA, SECRETS, HOLES = ("A: outputs", "B: reads and claims", "C: wrong JSON types",
                                         "D: secrets", "E: DCP holes")
IS_ROOT = os.geteuid() == 0


def _copy(tmp: Path) -> Path:
    run = tmp / "run"
    shutil.copytree(SAMPLE, run)
    return run


def _edit_json(path: Path, change: Callable[[Any], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _safetensors(path: Path, header: dict[str, Any], data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _dcp(folder: Path, size: list[int]) -> Path:
    """A DCP checkpoint of one [4, 2] tensor whose metadata then declares it ``size``: a chunk short of it."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save({"model": {"w": torch.ones(4, 2)}}, checkpoint_id=folder)
    md = pickle.loads((folder / ".metadata").read_bytes())
    md.state_dict_metadata["model.w"].size = torch.Size(size)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return folder


# ---- the reported cases, through the real CLI -----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    command: str
    prepare: Callable[[Path], list[str | Path]]  # makes the hostile input under tmp, returns the command line
    needles: tuple[str, ...]  # in the one-line error (exit 2)
    check: Callable[[Path, Result], None] | None = None  # what must hold afterwards besides


def fifo_named_pt(tmp: Path) -> list[str | Path]:
    os.mkfifo(tmp / "model.pt")
    return ["scan", tmp / "model.pt"]


def fifo_named_ckpt_in_a_folder(tmp: Path) -> list[str | Path]:
    (tmp / "ckpts").mkdir()
    os.mkfifo(tmp / "ckpts" / "epoch=1.ckpt")
    return ["bisect", tmp / "ckpts"]


def stride_zero_pt(tmp: Path) -> list[str | Path]:
    torch.save({"w": torch.zeros(1).expand(2**40)}, tmp / "expanded.pt")  # 1.5 KB on disk
    return ["scan", tmp / "expanded.pt"]


def sparse_claiming_10_gib(tmp: Path) -> list[str | Path]:
    n = 10 * 2**30 // 4
    sparse = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.long).expand(1, n), torch.ones(1).expand(n), (n,),
                                     check_invariants=False)
    torch.save({"w": sparse}, tmp / "sparse.pt")
    return ["scan", tmp / "sparse.pt"]


def too_many_tensors(tmp: Path) -> list[str | Path]:
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(inputs.MAX_TENSORS + 1)}
    return ["scan", _safetensors(tmp / "many.safetensors", header)]


def strides_past_int64(tmp: Path) -> list[str | Path]:
    header = {"w": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}
    return ["scan", _safetensors(tmp / "overflow.safetensors", header)]


def steps_near_2_63(tmp: Path) -> list[str | Path]:
    run = _copy(tmp)
    (run / "steps.jsonl").write_text("".join(json.dumps({"step": 2**63 - 3 + i, "loss": loss}) + "\n"
                                             for i, loss in enumerate([1.0, "nan"])))
    return ["replay", run]


def one_tensor_200000_times(tmp: Path) -> list[str | Path]:
    run = _copy(tmp)
    tree = json.dumps({"list": [{"tensor": "0"}] * 200_000})
    from safetensors.torch import save_file

    save_file({"0": torch.ones(2, 16)}, run / "batches" / "step_00000012.safetensors",
              metadata={"format": "nanforensics.batch/1", "step": "12", "tree": tree})
    return ["replay", run, "--from-step", "10"]


def meta_scalars_a_list(tmp: Path) -> list[str | Path]:
    run = _copy(tmp)
    _edit_json(run / CK / "meta.json", lambda m: m.update(state_scalars=[1, 2]))
    return ["replay", run, "--from-step", "10"]


def meta_param_names_a_number(tmp: Path) -> list[str | Path]:
    run = _copy(tmp)
    _edit_json(run / CK / "meta.json", lambda m: m.update(param_names=7))
    return ["scan", run / CK]


def step_log_links_to_a_secret(tmp: Path) -> list[str | Path]:
    run = _copy(tmp)
    (tmp / "credentials").write_text(SECRET + "\n")
    (run / "steps.jsonl").unlink()
    (run / "steps.jsonl").symlink_to(tmp / "credentials")
    return ["postmortem", run, "--json", tmp / "report.json"]


def no_secret(tmp: Path, r: Result) -> None:
    report = (tmp / "report.json").read_text()
    for text in (r.stdout, r.stderr, report):
        assert SECRET[:12] not in text and "wJalr" not in text
    failed = [a["detail"] for a in json.loads(report)["analyses"] if a["status"] == "failed"]
    assert any("steps.jsonl" in d and "leads outside" in d for d in failed), failed


def dcp_with_holes(tmp: Path) -> list[str | Path]:
    return ["scan", _dcp(tmp / "dcp", [8, 2])]


def dcp_declared_4_tib(tmp: Path) -> list[str | Path]:
    return ["scan", _dcp(tmp / "dcp", [2**39, 2])]


def json_over_a_device_node(tmp: Path) -> list[str | Path]:
    os.mknod(tmp / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a second /dev/null, made here
    return ["scan", SAMPLE / CK, "--json", tmp / "null"]


def still_a_device(tmp: Path, r: Result) -> None:
    assert stat.S_ISCHR(os.lstat(tmp / "null").st_mode) and stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def json_over_a_fifo(tmp: Path) -> list[str | Path]:
    os.mkfifo(tmp / "pipe")
    (tmp / "link.json").symlink_to(tmp / "pipe")
    return ["scan", SAMPLE / CK, "--json", tmp / "link.json"]


def still_a_fifo(tmp: Path, r: Result) -> None:
    assert stat.S_ISFIFO(os.lstat(tmp / "pipe").st_mode) and (tmp / "link.json").is_symlink()


CODE = Path("sample_runs") / "code" / "regressor.py"  # the sample's code, which its manifest names


def json_over_the_imported_code(tmp: Path) -> list[str | Path]:
    """The replay imports sample_runs/code/regressor.py (the manifest names it); --json aims at that file, in a copy
    of the project so that a failure damages nothing."""
    (tmp / CODE).parent.mkdir(parents=True)
    shutil.copy(ROOT / CODE, tmp / CODE)
    shutil.copytree(SAMPLE, tmp / "run")
    return ["replay", "run", "--json", str(CODE)]


def code_untouched(tmp: Path, r: Result) -> None:
    assert (tmp / CODE).read_bytes() == (ROOT / CODE).read_bytes()


def json_into_a_missing_folder(tmp: Path) -> list[str | Path]:
    return ["scan", SAMPLE / CK, "--json", tmp / "no" / "such" / "report.json"]


def no_folder_made(tmp: Path, r: Result) -> None:
    assert not (tmp / "no").exists()


def json_deep_inside_the_code_path(tmp: Path) -> list[str | Path]:
    """--code-path X --json X/sub/r.json --create-dirs: nothing is written inside an input, at any depth (a check
    of "directly inside" passed while every other case wrote one level deep)."""
    shutil.copytree(ROOT / CODE.parent, tmp / "code")
    return ["replay", SAMPLE, "--code-path", tmp / "code", "--json", tmp / "code" / "sub" / "r.json", "--create-dirs"]


def code_folder_untouched(tmp: Path, r: Result) -> None:
    assert tree_digest(tmp / "code") == tree_digest(ROOT / CODE.parent) and not (tmp / "code" / "sub").exists()


def step_summary_is_a_fifo(tmp: Path) -> list[str | Path]:
    os.mkfifo(tmp / "summary")
    return ["postmortem", SAMPLE / "checkpoints", "--markdown", tmp / "summary"]


CASES = [
    Case("fifo_named_pt", READER, "scan", fifo_named_pt, ("model.pt", "not a regular file (a FIFO)")),
    Case("fifo_named_ckpt_in_a_folder", READER, "bisect", fifo_named_ckpt_in_a_folder, ("epoch=1.ckpt", "a FIFO")),
    Case("stride_zero_pt", READER, "scan", stride_zero_pt, ("expanded.pt", "stride-0", "over a storage of 4")),
    Case("sparse_claiming_10_gib", READER, "scan", sparse_claiming_10_gib, ("sparse.pt", "stride-0")),
    Case("too_many_tensors", READER, "scan", too_many_tensors, ("many.safetensors", f"more than {inputs.MAX_TENSORS} tensors")),
    Case("strides_past_int64", READER, "scan", strides_past_int64, ("overflow.safetensors", "strides beyond 2^63")),
    Case("steps_near_2_63", READER, "replay", steps_near_2_63, ("run", "step log starts at step 9223372036854775805")),
    Case("one_tensor_200000_times", READER, "replay", one_tensor_200000_times, ("step_00000012.safetensors",
                                                                      "referenced more than once")),
    Case("meta_scalars_a_list", SCHEMA, "replay", meta_scalars_a_list, ("meta.json", "state_scalars: expected an object")),
    Case("meta_param_names_a_number", SCHEMA, "scan", meta_param_names_a_number, ("meta.json", "param_names: expected a list")),
    Case("step_log_links_to_a_secret", SECRETS, "postmortem", step_log_links_to_a_secret, (), no_secret),
    Case("dcp_with_holes", HOLES, "scan", dcp_with_holes, (".metadata", "'model.w'", "leaving holes")),
    Case("dcp_declared_4_tib", HOLES, "scan", dcp_declared_4_tib, (".metadata", "'model.w'", "leaving holes")),
    Case("json_over_a_fifo", WRITER, "scan", json_over_a_fifo, ("--json", "link.json", "FIFO"), still_a_fifo),
    Case("json_over_the_imported_code", WRITER, "replay", json_over_the_imported_code, ("--json", "regressor.py", "imported"),
         code_untouched),
    Case("json_into_a_missing_folder", WRITER, "scan", json_into_a_missing_folder, ("--json", "does not exist",
                                                                            "--create-dirs"), no_folder_made),
    Case("json_deep_inside_the_code_path", WRITER, "replay", json_deep_inside_the_code_path, ("--json", "r.json",
                                                                                            "lies inside"),
         code_folder_untouched),
    Case("step_summary_is_a_fifo", WRITER, "postmortem", step_summary_is_a_fifo, ("--markdown", "summary", "FIFO")),
    *([Case("json_over_a_device_node", WRITER, "scan", json_over_a_device_node, ("--json", "null", "character device"),
            still_a_device)] if IS_ROOT else []),
]


def _attempt(case: Case, tmp: Path, argv: list[str | Path], process: bool) -> Result:
    cwd = tmp if case.name == "json_over_the_imported_code" else ROOT
    before = tree_digest(SAMPLE)
    result = run_cli(*argv, cwd=cwd, process=process)
    assert tree_digest(SAMPLE) == before
    return result


def _special(tmp: Path) -> bool:
    """A FIFO among a case's files: a command that hung on it would be a process, which run_cli's timeout ends."""
    return any(stat.S_ISFIFO(p.lstat().st_mode) for p in tmp.rglob("*"))


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Result]]:
    """Every case collected: the processes at once (most of each is the import of torch), the in-process calls
    meanwhile on this thread."""
    wanted = [item.callspec.params["case"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params]
    tmps = {c.name: tmp_path_factory.mktemp(c.name) for c in wanted}
    argvs = {c.name: c.prepare(tmps[c.name]) for c in wanted}
    special = {c.name for c in wanted if _special(tmps[c.name])}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {c.name: pool.submit(_attempt, c, tmps[c.name], argvs[c.name], True) for c in wanted
                   if c.name in special}
        done = {c.name: _attempt(c, tmps[c.name], argvs[c.name], False) for c in wanted if c.name not in special}
        return {name: (tmps[name], r) for name, r in (done | {n: f.result() for n, f in futures.items()}).items()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_input(results: dict[str, tuple[Path, Result]], case: Case,
                       record_property: Callable[[str, object], None]) -> None:
    record_property(FAULT_CASE, (case.command, case.kind))  # conftest's summary counts them by command and class
    tmp, r = results[case.name]
    assert "Traceback" not in r.stderr and "NANFORENSICS_DEBUG" not in r.stderr, r.stderr
    if case.needles:
        assert r.code == 2, (r.code, r.stderr, r.stdout[-1000:])
        [line] = error_lines(r.stderr)
        assert line.startswith("nanforensics: error: ")
        for needle in case.needles:
            assert needle in line, (needle, line)
    if case.check is not None:
        case.check(tmp, r)


def test_create_dirs_creates_the_missing_folder(tmp_path: Path) -> None:
    r = run_cli("scan", SAMPLE / CK, "--json", tmp_path / "a" / "b" / "r.json", "--create-dirs")
    assert r.code == 0, r.stderr
    assert json.loads((tmp_path / "a" / "b" / "r.json").read_text())["verdict"] == "clean"


@pytest.mark.parametrize("option", [None, "--json"])
def test_an_output_under_a_file_is_refused_and_every_missing_folder_above_one_is_made(tmp_path: Path, option) -> None:
    """A file where the output's folder would be: refused in one line naming the path (and the option) once, with or
    without --create-dirs; every missing folder above an output is made with --create-dirs."""
    (tmp_path / "f").write_text("a file\n")
    for where, create in itertools.product((tmp_path / "f" / "r.json", tmp_path / "f" / "sub" / "r.json"), (False, True)):
        with pytest.raises(BadInput) as e:
            write_output(where, "{}", option, create_dirs=create)
        assert str(e.value) == (f"--json: {where} " if option else f"{where}: ") + "cannot be checked (Not a directory)"
    deep = tmp_path / "a" / "b" / "c" / "r.json"
    write_output(deep, "{}", option, create_dirs=True)
    assert deep.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "f"] and (tmp_path / "f").read_text() == "a file\n"


def test_an_output_folder_is_refused_where_a_file_stands_and_taken_where_a_folder_or_nothing_does(tmp_path: Path) -> None:
    """repair's --out is a folder the command replaces: a regular file there is not one; a folder or nothing is."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    with pytest.raises(BadInput) as e:
        check_outputs([], {"--out": tmp_path / "file"}, folders=("--out",))
    assert str(e.value) == f"--out: {tmp_path / 'file'} exists and is not a directory"
    for fine in ("folder", "absent"):
        check_outputs([], {"--out": tmp_path / fine}, folders=("--out",))
    with pytest.raises(BadInput) as e:  # the same path as a file output: a folder is not a regular file
        check_outputs([], {"--json": tmp_path / "folder"})
    assert str(e.value) == f"--json: {tmp_path / 'folder'} is a directory, not a regular file: reports replace only " \
        "regular files"


def test_inputs_and_examined_trees_hold_back_only_the_outputs_inside_them(tmp_path: Path) -> None:
    """A folder read as input, or examined, refuses the outputs inside it, not those beside it; a file read as input
    refuses only itself."""
    for name in ("input", "tree", "out"):
        (tmp_path / name).mkdir()
    (tmp_path / "input.json").write_text("{}")
    examine(tmp_path / "tree")
    check_outputs([tmp_path / "input", tmp_path / "input.json"], {"--json": tmp_path / "out" / "r.json"})
    write_output(tmp_path / "out" / "r.json", "{}", "--json")
    write_output(tmp_path / "input.json.md", "# r", "--md")
    assert (tmp_path / "out" / "r.json").read_text() == "{}" and (tmp_path / "input.json").read_text() == "{}"
    with pytest.raises(BadInput) as e:
        write_output(tmp_path / "tree" / "r.json", "{}", "--json")
    assert str(e.value) == f"--json: {tmp_path / 'tree' / 'r.json'} lies inside {tmp_path / 'tree'}, which this command " \
        "examines and never writes into"


def test_a_missing_folder_is_refused_at_the_check_and_made_only_when_asked(tmp_path: Path) -> None:
    """check_outputs refuses an output whose folder is missing, before any work, and makes nothing; with
    --create-dirs it makes the folder then."""
    out = tmp_path / "missing" / "r.json"
    with pytest.raises(BadInput) as e:
        check_outputs([], {"--json": out})
    assert str(e.value) == f"--json: {out} cannot be written: the folder {out.parent} does not exist (--create-dirs " \
        "creates it)"
    assert not out.parent.exists()
    check_outputs([], {"--json": out}, create_dirs=True)
    assert out.parent.is_dir() and list(out.parent.iterdir()) == []
    write_output(out, "{}", "--json")
    assert out.read_text() == "{}"


def test_a_file_with_no_write_bit_but_an_execute_bit_is_read_only(tmp_path: Path) -> None:
    """Only write bits make a report replaceable (root may write anything): --x for others alone is read-only."""
    for mode in (0o001, 0o010, 0o100, 0o555):
        path = tmp_path / f"r{mode:o}.json"
        path.write_text("{}")
        path.chmod(mode)
        with pytest.raises(BadInput) as e:
            write_output(path, "[]", "--json")
        assert str(e.value) == f"--json: {path} is read-only: not replaced"


def _as_another_user(call: Callable[[], object]) -> str:
    """What ``call`` returns, or the error it raises, as text, from a child process running as nobody (uid 65534)
    when this one is root, who may write anywhere; as this process's own user otherwise."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of pytest's runs here, and it never returns into it
        try:
            os.close(read)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            out = repr(call())
        except BaseException as e:  # every outcome goes back to the parent as text
            out = f"{type(e).__name__}: {e}"
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    return out


def test_a_folder_this_process_may_not_write_or_create_in_is_refused_before_anything_is_written() -> None:
    """A folder its owner alone may write, seen by another user: the output is refused in one line, and a missing
    folder under it cannot be made (--create-dirs), said with the system's reason."""
    with tempfile.TemporaryDirectory(dir="/tmp") as base:  # /tmp: every user may reach into it
        folder = Path(base) / "theirs"
        folder.mkdir()
        Path(base).chmod(0o755)
        folder.chmod(0o755 if os.geteuid() == 0 else 0o555)
        assert _as_another_user(lambda: write_output(folder / "r.json", "{}", "--json")) == \
            f"BadInput: --json: {folder / 'r.json'} cannot be written: {folder} is not writable"
        assert _as_another_user(lambda: write_output(folder / "sub" / "r.json", "{}", "--json", create_dirs=True)) == \
            f"BadInput: --json: {folder / 'sub' / 'r.json'} cannot be written: cannot create {folder / 'sub'} (Permission denied)"
        folder.chmod(0o755)
        assert list(folder.iterdir()) == []


# ---- A: outputs over every kind of path -------------------------------------------------------------------------

KINDS = ["absent", "regular", "read-only", "read-only executable", "directory", "fifo", "socket", "device", "dangling"]
ROLES = ["plain", "an input", "inside an input folder", "inside an examined tree", "under a code path", "imported"]


@contextlib.contextmanager
def _made(kind: str, path: Path) -> Iterator[None]:
    """A file of ``kind`` at ``path`` for the length of the block."""
    server = None
    if kind in ("regular", "read-only", "read-only executable"):
        path.write_text("# earlier\n")
        if kind.startswith("read-only"):
            path.chmod(0o444 if kind == "read-only" else 0o555)  # r-x: execute bits are no write bits
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
    elif kind == "device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "dangling":
        path.symlink_to(path.with_name("nowhere"))
    try:
        yield
    finally:
        if server is not None:
            server.close()


def _state(path: Path) -> tuple[int, bytes | None]:
    st_ = os.lstat(path)
    return st_.st_mode, path.read_bytes() if stat.S_ISREG(st_.st_mode) else None


def _import_file(path: Path) -> str:
    name = f"_trust_io_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return name


def _role(role: str, folder: Path, name: str, depth: int) -> tuple[Path, Callable[[], None]]:
    """Where the output goes for ``role``, ``depth`` folders below the input or tree it is inside (none for the
    others), and what makes it that (run before the output is written)."""
    if role == "an input":
        return folder / name, lambda: check_outputs([folder / name], {})
    if role in ("inside an input folder", "under a code path", "inside an examined tree"):
        below = folder.joinpath("tree", *[f"sub{i}" for i in range(depth - 1)])
        below.mkdir(parents=True)
        if role == "inside an examined tree":
            return below / name, lambda: examine(folder / "tree")
        return below / name, lambda: check_outputs([folder / "tree"], {})
    return folder / name, lambda: None


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_over_every_kind_of_path(kind: str, role: str) -> None:
    """Written only when absent, or a regular file this process may write, and nothing the command reads, examines
    or imported, however deep inside it; through a symlink, the file it resolves to is replaced and the symlink stays.
    Else refused, one line, and the path as it was. Every combination (kind x role x the four yes/no choices, 864),
    enumerated: a space this small is listed, not sampled."""
    for through_symlink, folder_missing, create_dirs, deep in itertools.product([False, True], repeat=4):
        _one_output(kind, role, through_symlink, folder_missing, create_dirs, 3 if deep else 1)


# what a refusal says, by role ("plain": the kind of file or its missing folder, said by their own tests)
WHY = {"plain": "", "an input": "an input of this command", "inside an input folder": "lies inside",
       "under a code path": "lies inside", "inside an examined tree": "lies inside",
       "imported": "which this process imported"}


def test_a_path_the_file_system_cannot_check_is_refused_in_one_line(tmp_path: Path) -> None:
    """A name longer than the file system takes (the file, or a folder on the way): stat fails with another error
    than 'missing', and the refusal says so in one line, naming the option and the path, or the path alone."""
    for target in (tmp_path / ("x" * 300 + ".json"), tmp_path / ("y" * 300) / "r.json"):
        with pytest.raises(BadInput) as refused:
            write_output(target, "{}\n", "--json")
        assert str(refused.value) == f"--json: {target} cannot be checked (File name too long)"
        with pytest.raises(BadInput) as refused:
            write_output(target, "{}\n")
        assert str(refused.value) == f"{target}: cannot be checked (File name too long)"
    assert list(tmp_path.iterdir()) == []


def _why_plain(kind: str, through_symlink: bool) -> str:
    """What refuses an output of ``kind`` that is nothing the command reads: the words of the writer's refusal."""
    if kind.startswith("read-only"):
        return "is read-only: not replaced"
    if kind == "dangling" or (kind == "absent" and through_symlink):
        return "which does not exist: not followed"
    if kind == "absent":
        return "does not exist (--create-dirs creates it)"
    named = {"directory": "a directory", "fifo": "a FIFO", "socket": "a socket", "device": "a character device"}[kind]
    return f"is {named}, not a regular file: reports replace only regular files"


def test_a_refusal_without_an_option_names_the_path_once(tmp_path: Path) -> None:
    """A report written with no option to name (a saved report's own writer): the error names the path, once, then
    why."""
    (tmp_path / "tree").mkdir()
    check_outputs([tmp_path / "tree"], {})
    target = tmp_path / "tree" / "r.json"
    with pytest.raises(BadInput) as refused:
        write_output(target, "{}\n")
    assert str(refused.value) == f"{target}: lies inside {tmp_path / 'tree'}, which this command examines and never writes into"
    assert not target.exists()


def _one_output(kind: str, role: str, through_symlink: bool, folder_missing: bool, create_dirs: bool, depth: int) -> None:
    """One combination of test_outputs_over_every_kind_of_path."""
    if kind == "device" and not IS_ROOT:
        kind = "fifo"  # making a device node takes root; as root, /dev/null's twin is made in the temporary folder
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        target, declare = _role(role, folder, "report.py" if role == "imported" else "report.json", depth)
        if role == "imported":
            kind = "regular"
        with _made(kind, target):
            if role == "imported":
                module = _import_file(target)
            declare()
            path = target
            if through_symlink:
                path = folder / "link.json"
                path.symlink_to(target)
            elif folder_missing and kind == "absent" and role == "plain":
                path = target = folder / "missing" / "report.json"
            before = _state(target) if os.path.lexists(target) else None
            allowed = role == "plain" and (kind == "regular" or (kind == "absent" and not through_symlink and (
                not folder_missing or create_dirs)))
            try:
                with time_limit(10):
                    write_output(path, "{}\n", "--json", create_dirs=create_dirs)
            except BadInput as e:
                assert not allowed, e
                assert str(e).startswith("--json: ") and "\n" not in str(e)
                assert WHY[role] in str(e), (role, str(e))  # the reason it is refused, not only that it is
                if role == "plain":  # and for a path of its own, what it is that is not replaced, in words
                    assert _why_plain(kind, through_symlink) in str(e), (kind, through_symlink, str(e))
                assert (_state(target) if os.path.lexists(target) else None) == before
            else:
                assert allowed, (kind, role, through_symlink, folder_missing, create_dirs, depth)
                assert target.read_text() == "{}\n" and (not through_symlink or path.is_symlink())
            finally:
                if role == "imported":
                    del sys.modules[module]
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_a_device_node_is_never_replaced(tmp_path: Path) -> None:
    """``--json /dev/null``'s promise, kept on /dev/null's twin made in the temporary folder: the real one is never
    handed to the code under test (a mutant without the device check once replaced this machine's /dev/null)."""
    if not IS_ROOT:
        pytest.skip("making a device node takes root")
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    with pytest.raises(BadInput, match="character device"):
        write_output(null, "x", "--json")
    with pytest.raises(BadInput, match="character device"):
        check_outputs([], {"--json": null})
    assert stat.S_ISCHR(os.lstat(null).st_mode)



def test_a_glob_names_the_paths_it_matches_and_a_plain_path_itself(tmp_path: Path) -> None:
    """bisect's targets: a glob as every path it matches (none: nothing), a plain path as given (there or not), in
    the order given."""
    for name in ("a1", "a2", "b1"):
        (tmp_path / name).mkdir()
    assert sorted(expand([tmp_path / "a*"])) == [tmp_path / "a1", tmp_path / "a2"]
    assert expand([tmp_path / "gone", str(tmp_path / "b?"), tmp_path / "a[2]", tmp_path / "z*"]) == \
        [tmp_path / "gone", tmp_path / "b1", tmp_path / "a2"]


@pytest.mark.parametrize("stdout", [[], ["--json"], ["--json", "--markdown"], ["--json", "--markdown", "--html"]])
def test_one_report_at_most_goes_to_stdout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stdout: list[str]) -> None:
    outputs: dict[str, str | Path | None] = {"--junit": None, "--svg": tmp_path / "r.svg",
                                             **{option: "-" if i % 2 else Path("-") for i, option in enumerate(stdout)}}
    if len(stdout) <= 1:
        (tmp_path / "tree").mkdir()
        examine(tmp_path / "tree")
        monkeypatch.chdir(tmp_path / "tree")  # "-" is stdout, never the file ./- (here inside an examined tree)
        assert check_outputs([], outputs) is None
    else:
        with pytest.raises(BadInput) as refused:
            check_outputs([], outputs)
        assert str(refused.value) == f"{' and '.join(stdout)}: only one report can go to stdout (-); write the others " \
            "to files"


def test_an_output_folder_never_holds_an_input_nor_another_output(tmp_path: Path) -> None:
    """repair's --out is replaced whole: refused where it holds an input (or is one), and an output inside it is
    refused; beside it, or a file output holding nothing, each is taken."""
    run, out = tmp_path / "run", tmp_path / "out"
    (run / "ck").mkdir(parents=True)
    for folder in (run, run / "ck"):
        with pytest.raises(BadInput) as refused:
            check_outputs([run / "ck"], {"--out": folder}, folders=("--out",))
        assert str(refused.value) == f"--out: {folder} holds {run / 'ck'}, which this command examines: replacing it " \
            "would delete it"
    with pytest.raises(BadInput) as refused:
        check_outputs([run / "ck"], {"--json": run / "ck"})
    assert str(refused.value) == f"--json: {run / 'ck'} is {run / 'ck'}, an input of this command, which it never " \
        "writes over"
    with pytest.raises(BadInput) as refused:
        check_outputs([], {"--json": out / "r.json", "--out": out}, folders=("--out",))
    assert str(refused.value) == f"--json: {out / 'r.json'} lies inside --out {out}, which is replaced as a whole"
    check_outputs([run / "ck"], {"--out": out, "--json": tmp_path / "r.json"}, folders=("--out",))


def test_a_folder_check_outputs_may_create_is_created_on_writing(tmp_path: Path) -> None:
    """--create-dirs said once, at the check: the writer, told nothing, makes the folder again if it went since."""
    out = tmp_path / "a" / "b" / "r.json"
    check_outputs([], {"--json": out}, create_dirs=True)
    (tmp_path / "a" / "b").rmdir()
    (tmp_path / "a").rmdir()
    write_output(out, "{}", "--json")
    assert out.read_text() == "{}"
    elsewhere = tmp_path / "c" / "r.json"  # no --create-dirs for it: the writer makes no folder
    with pytest.raises(BadInput) as refused:
        write_output(elsewhere, "{}")
    assert str(refused.value) == f"{elsewhere}: cannot be written: the folder {elsewhere.parent} does not exist " \
        "(--create-dirs creates it)"


def test_a_hard_link_to_an_input_is_the_input(tmp_path: Path) -> None:
    source, link, other = tmp_path / "in.json", tmp_path / "link.json", tmp_path / "other.json"
    source.write_text("{}")
    other.write_text("{}")
    os.link(source, link)
    check_outputs([source], {})
    with pytest.raises(BadInput) as refused:
        write_output(link, "[]", "--json")
    assert str(refused.value) == f"--json: {link} is {source}, an input of this command, which it never writes over"
    write_output(other, "[]", "--json")
    write_output(tmp_path / "new.json", "[]", "--json")
    assert (source.read_text(), other.read_text(), (tmp_path / "new.json").read_text()) == ("{}", "[]", "[]")


def test_the_bytecode_of_an_imported_module_is_never_written(tmp_path: Path) -> None:
    """What a module was imported from, its source or its cached bytecode; a module replaced under the same name
    (a re-import) is looked at again."""
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("X = 1\n")
    second.write_text("X = 2\n")
    name = _import_file(first)
    cached = sys.modules[name].__cached__
    bytecode = Path(cached).read_bytes() if Path(cached).exists() else None  # the import's own, where it writes one
    try:
        for path, option in ((first, "--json"), (Path(cached), "--json"), (first, None)):
            with pytest.raises(BadInput) as refused:
                write_output(path, "{}", option)
            assert str(refused.value) == (f"{option}: {path} " if option else f"{path}: ") + \
                f"is the source of {name}, which this process imported: never written over"
        write_output(second, "X = 3\n", "--json")
        spec = importlib.util.spec_from_file_location(name, second)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        with pytest.raises(BadInput, match=f"is the source of {name}"):
            write_output(second, "{}", "--json")
        sys.modules[f"{name}_made"] = types.ModuleType(f"{name}_made")  # a module of no file: nothing to hold back
        write_output(tmp_path / "r.json", "{}", "--json")
    finally:
        del sys.modules[name]
        sys.modules.pop(f"{name}_made", None)
    assert first.read_text() == "X = 1\n"
    assert (Path(cached).read_bytes() if Path(cached).exists() else None) == bytecode


def test_a_report_goes_to_stdout_whole_and_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``-``: the text, or the bytes as UTF-8 text, written and flushed (a terminal view printed next never comes
    first)."""
    for destination, data in (("-", "r\u00e9sum\u00e9\n"), (Path("-"), "r\u00e9sum\u00e9\n".encode()),
                              ("-", bytearray("r\u00e9sum\u00e9\n".encode()))):
        raw = io.BytesIO()
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8"))
        write_output(destination, data, "--json")
        assert raw.getvalue() == "r\u00e9sum\u00e9\n".encode()


def test_a_report_is_written_as_utf_8_and_a_failed_write_names_the_file(tmp_path: Path) -> None:
    for data in ("r\u00e9sum\u00e9", "r\u00e9sum\u00e9".encode(), memoryview("r\u00e9sum\u00e9".encode())):
        write_output(tmp_path / "r.md", data, "--markdown")
        assert (tmp_path / "r.md").read_bytes() == "r\u00e9sum\u00e9".encode()
    long = tmp_path / ("x" * 250)  # its temporary name, beside it, is longer than the file system takes
    for option in ("--json", None):
        with pytest.raises(BadInput) as refused:
            write_output(long, "{}", option)
        assert str(refused.value) == f"{option or long}: cannot write {long} (File name too long)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.md"]


def test_the_step_summary_is_appended_to_and_created_as_any_file(tmp_path: Path) -> None:
    """$GITHUB_STEP_SUMMARY: what was there kept, each text appended after it, UTF-8; created absent, with the
    mode any file the user writes has."""
    summary = tmp_path / "summary.md"
    previous = os.umask(0o002)
    try:
        append_output(summary, "# one\n", "$GITHUB_STEP_SUMMARY")
    finally:
        os.umask(previous)
    append_output(summary, "r\u00e9sum\u00e9\n")
    assert summary.read_bytes() == "# one\nr\u00e9sum\u00e9\n".encode()
    assert stat.S_IMODE(summary.stat().st_mode) == 0o664
    os.mkfifo(fifo := tmp_path / "fifo")
    with pytest.raises(BadInput) as refused:
        append_output(fifo, "x", "$GITHUB_STEP_SUMMARY")
    assert str(refused.value) == f"$GITHUB_STEP_SUMMARY: {fifo} is a FIFO, not a regular file: reports replace only " \
        "regular files"


def test_the_step_summary_is_utf_8_whatever_the_locale(tmp_path: Path) -> None:
    """Under the C locale (ASCII: a CI runner's LANG unset), a summary holding a name in any script is still written,
    as UTF-8; in a process of its own, since a process's locale encoding is fixed when it starts."""
    summary = tmp_path / "summary.md"
    code = ("import locale, sys; from nanforensics.outputs import append_output; "
            "assert locale.getpreferredencoding(False) == 'ANSI_X3.4-1968'; append_output(sys.argv[1], '\\u00e9\\u4e2d')")
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    done = subprocess.run([sys.executable, "-c", code, str(summary)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert summary.read_bytes() == "\u00e9\u4e2d".encode()

def test_a_step_summary_replaced_after_its_check_is_refused_unwritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      ) -> None:
    """Between the check and the open, the path became a FIFO (with or without a reader) or a folder: refused in one
    line naming it, never waited on, nothing written."""
    fifo, folder = tmp_path / "fifo", tmp_path / "folder"
    os.mkfifo(fifo)
    folder.mkdir()
    monkeypatch.setattr(outputs, "_checked", lambda path, option: path)  # the check passed: the path changed since
    for path, why in ((fifo, "cannot append to {p} (No such device or address)"),
                      (folder, "cannot append to {p} (Is a directory)")):
        for option in ("$GITHUB_STEP_SUMMARY", None):
            with pytest.raises(BadInput) as refused, time_limit(10):
                append_output(path, "x", option)
            assert str(refused.value) == f"{option or path}: " + why.format(p=path)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(BadInput) as refused, time_limit(10):
            append_output(fifo, "x", "$GITHUB_STEP_SUMMARY")
        assert str(refused.value) == f"$GITHUB_STEP_SUMMARY: {fifo} is a FIFO, not a regular file"
        assert os.read(reader, 16) == b""  # nothing was written: the writer is gone, and the FIFO empty
    finally:
        os.close(reader)


# ---- B and D: reads of every kind of file; nothing of a file outside the tree quoted ------------------------------

READ_KINDS = ["regular", "fifo", "socket", "directory", "device", "link inside", "link outside", "link to fifo",
              "dangling"]


# a secret no message may quote: printable, Latin-1 and beyond, JSON's and Python's quote characters
SECRET = "s3cr\u00e9t-\u0263\u02a9\"'{[token=AKIA\u00d8\u02ff]}"


@pytest.mark.parametrize("name", ["steps.jsonl", "manifest.json", "meta.json", "model.safetensors", "model.pt",
                                  "report.json"])
@pytest.mark.parametrize("kind", READ_KINDS)
def test_reads_of_every_kind_of_file(kind: str, name: str) -> None:
    """Read only when a regular file inside the examined tree; else a one-line refusal, at once (a FIFO never
    waited on), that quotes nothing of a file outside the tree. Every kind x name (54), enumerated: it was 100
    sampled."""
    secret = SECRET
    if kind == "device" and not IS_ROOT:
        kind = "fifo"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as made:
        tree, outside = Path(tmp) / "run", Path(tmp) / "credentials"
        tree.mkdir()
        outside.write_text(secret)
        (tree / "inner").write_text(secret)
        path = tree / name
        if kind.startswith("link") or kind == "dangling":
            to = {"link inside": tree / "inner", "link outside": outside, "dangling": tree / "gone",
                  "link to fifo": tree / "pipe"}[kind]
            if kind == "link to fifo":
                os.mkfifo(to)
            path.symlink_to(to)
        elif kind != "regular":
            made.enter_context(_made(kind, path))
        else:
            path.write_text(secret)
        examine(tree)
        readers = [lambda: read_input(path), lambda: load_json(path), lambda: SafetensorsFile(path),
                   lambda: torch_file.load(path)]
        for read in readers:
            try:
                with time_limit(10):
                    read()
            except BadInput as e:
                message = str(e)
                assert message.startswith(str(path)) and "\n" not in message
                if kind == "link outside":
                    assert "leads outside" in message and secret[:8] not in message
                if kind in ("fifo", "socket", "directory", "device", "link to fifo"):
                    assert "not a regular file" in message
            else:
                assert kind in ("regular", "link inside"), kind


# ---- B: what headers and strides claim, across the int64 range ---------------------------------------------------

_sizes = st.one_of(st.integers(0, 8), st.integers(0, 2**63 + 8), st.integers(-(2**64), 2**64),
                   st.sampled_from([2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63]))


@settings(max_examples=200, deadline=None)
@given(entries=st.lists(st.tuples(st.sampled_from(["F32", "F16", "I64", "U8", "BOOL", "C64"]),
                                  st.lists(_sizes, max_size=4), _sizes, _sizes), max_size=12),
       data_size=st.integers(0, 256))
def test_safetensors_headers_claiming_any_size(entries: list[tuple[str, list[int], int, int]], data_size: int,
) -> None:
    """A header's shapes and offsets across the int64 range and beyond: refused in one line, or every tensor it
    lists lies within the file and reads without allocating more than the file holds."""
    header = {f"t{i}": {"dtype": d, "shape": shape, "data_offsets": [a, b]} for i, (d, shape, a, b) in enumerate(entries)}
    with tempfile.TemporaryDirectory() as tmp:
        path = _safetensors(Path(tmp) / "x.safetensors", header, bytes(data_size))
        try:
            f = SafetensorsFile(path)
        except BadInput as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e)
            return
        for entry in f.entries:
            assert entry.end - entry.start <= data_size
            assert f.read(entry).numel() * entry.dtype.itemsize == entry.end - entry.start


def test_the_tensor_count_is_checked_before_the_tensors_are_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every limit from 1 to 30 against no tensors, 40, and the three counts around it (enumerated: it was 60
    sampled of the 1,230 pairs, which seldom met an edge)."""
    for limit in range(1, 31):
        monkeypatch.setattr(inputs, "MAX_TENSORS", limit)
        for count in sorted({0, limit - 1, limit, limit + 1, 40}):
            header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
            path = _safetensors(tmp_path / f"{limit}_{count}.safetensors", header)
            if count > limit:
                with pytest.raises(BadInput, match=f"more than {limit} tensors"):
                    SafetensorsFile(path)
            else:
                assert len(SafetensorsFile(path).entries) == count


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.one_of(st.integers(0, 4), st.integers(0, 2**45)), min_size=1, max_size=3),
       stored=st.integers(1, 64), strided=st.booleans())
def test_pickled_views_claiming_more_than_they_store(shape: list[int], stored: int, strided: bool) -> None:
    """A stride-0 view of a few stored elements may claim any shape: read when its claim is within
    MAX_EXPANDED_BYTES of what it stores and its contiguous strides fit int64, refused before anything reads it
    otherwise."""
    base = torch.arange(stored, dtype=torch.float32)
    strides = [0] * len(shape)
    if strided and shape[-1] <= stored:
        strides[-1] = 1
    try:
        view = base.as_strided(shape, strides)
    except RuntimeError:  # a shape whose element count torch itself cannot hold
        return
    claimed = math.prod(shape) * 4
    refused = claimed > stored * 4 + inputs.MAX_EXPANDED_BYTES or math.prod(n for n in shape if n) * 4 >= 2**63
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "view.pt"
        torch.save({"w": view}, path)
        try:
            obj, _ = torch_file.load(path)
        except BadInput as e:
            assert refused, str(e)
            assert "stride-0" in str(e) or "strides beyond 2^63" in str(e), str(e)
        else:
            assert not refused and obj["w"].shape == view.shape


@settings(max_examples=150, deadline=None)
@given(present=st.sets(st.integers(0, 60), max_size=40), first=st.integers(0, 60), span=st.integers(0, 60),
       far=st.sampled_from([0, 2**40, 2**63 - 70]))
def test_missing_batches_never_walk_the_gap(present: set[int], first: int, span: int, far: int) -> None:
    """``batch_gaps`` over any [first, end), up to 2^63: the spans of missing batches, from the listing alone."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "batches").mkdir()
        for s in present:
            (run / "batches" / f"step_{far + s:08d}.safetensors").write_bytes(b"")
        with time_limit(5):
            gaps = batch_gaps(run, far + first, far + first + span)
        missing = [s for a, b in gaps for s in range(a, b + 1)]
        assert missing == [far + s for s in range(first, first + span) if s not in present]


@settings(max_examples=200, deadline=None)
@given(size=st.lists(st.integers(0, 6), min_size=1, max_size=2),
       boxes=st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=2, max_size=2),
                                st.lists(st.integers(0, 6), min_size=2, max_size=2)), max_size=5))
def test_dcp_chunks_must_tile_their_tensor(size: list[int], boxes: list[tuple[list[int], list[int]]]) -> None:
    """Chunk layouts over a small tensor: accepted exactly when they cover every element once (checked against a
    mask), since a hole would be read as uninitialised memory."""
    n = len(size)
    chunks = [_Chunk(tuple(o[:n]), tuple(s[:n]), Path("x"), 0, 1 << 20) for o, s in boxes]
    problem = _tiling_problem(_Tensor("w", ("w",), torch.float32, tuple(size), tuple(chunks)))
    mask, inside = torch.zeros(size, dtype=torch.int64), True
    for c in chunks:
        if any(o + s > m for o, s, m in zip(c.offsets, c.sizes, size)):
            inside = False
            break
        view = mask
        for dim, (o, s) in enumerate(zip(c.offsets, c.sizes)):
            view = view.narrow(dim, o, s)
        view += 1
    assert (problem is None) == (inside and bool((mask == 1).all())), (problem, size, boxes)


# ---- C: every field of a schema, given a value of every wrong JSON type --------------------------------------------

WRONG = {"an object": {"x": 1}, "a list": [1], "a string": "s", "an integer": 7, "a number": 2.5, "a boolean": True,
         "null": None}
_META_FIELDS = [f.name for f in fields(CheckpointMeta)]


def _wrong_for(hint: str) -> list[str]:
    """The JSON types a field of this type hint does not take."""
    takes = {"str": ["a string"], "list": ["a list"], "dict": ["an object"], "int": ["an integer"], "Any": list(WRONG)}
    ok = next((v for k, v in takes.items() if hint.startswith(k)), [])
    return [w for w in WRONG if w not in ok and not (w == "null" and "None" in hint)]


@pytest.mark.parametrize("field", _META_FIELDS)
def test_meta_json_fields_of_every_wrong_type(tmp_path: Path, field: str) -> None:
    """Each field given each JSON type it does not take (enumerated: the pairs are a few dozen)."""
    folder = tmp_path / "step_00000010"
    shutil.copytree(SAMPLE / CK, folder)
    original = (folder / "meta.json").read_text()
    for kind in _wrong_for(str(CheckpointMeta.__annotations__[field])):
        (folder / "meta.json").write_text(original)
        _edit_json(folder / "meta.json", lambda m: m.update({field: WRONG[kind]}))
        with pytest.raises(BadInput) as refused:
            Checkpoint(folder, 10).meta()
        message = str(refused.value)
        assert message.startswith(str(folder / "meta.json")) and "\n" not in message
        assert field in message or field == "format", (kind, message)


@pytest.fixture(scope="module")
def saved_bisect(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from nanforensics.checkpoints.bisect import bisect
    from nanforensics.report import to_jsonable

    return to_jsonable(bisect([SAMPLE / "checkpoints"]))


def test_saved_report_fields_of_every_wrong_type(saved_bisect: dict[str, Any], tmp_path: Path) -> None:
    """A saved report's fields (those the bisect filled), each given a value of every other JSON type: refused naming
    the field, unless its type takes that value too (Any; null where optional; an integer for a float). Every pair,
    enumerated (it was 120 sampled)."""
    from nanforensics.checkpoints.bisect import BisectReport

    path = tmp_path / "report.json"
    for field in sorted(k for k, v in saved_bisect.items() if k != "schema" and v is not None):
        hint = typing.get_type_hints(BisectReport)[field]
        args = typing.get_args(hint)
        for kind in sorted(k for k, v in WRONG.items() if type(v) is not type(saved_bisect[field])):
            value = WRONG[kind]
            takes = hint is Any or (value is None and type(None) in args) or (type(value) is int and float in (hint, *args))
            path.write_text(json.dumps({**saved_bisect, field: value}))
            try:
                load_report(path)
            except BadInput as e:
                assert str(e).startswith(str(path)) and "\n" not in str(e) and f"report.{field}" in str(e), str(e)
            else:
                assert takes, (field, kind, hint)


# ---- D: an excerpt of a damaged file inside the tree is short and escaped -------------------------------------------


@settings(max_examples=100, deadline=None)
@given(line=st.text(min_size=1, max_size=200).filter(lambda s: "\n" not in s and s.strip()))
def test_a_damaged_step_log_line_is_quoted_short_and_escaped(line: str) -> None:
    from nanforensics.runs.steplog import read_steps

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "steps.jsonl"
        path.write_text(line + "\n", encoding="utf-8", errors="surrogatepass")
        try:
            read_steps(path)
        except BadInput as e:
            message = str(e)
            assert "\n" not in message and "\x1b" not in message and "\r" not in message
            assert len(message) < len(str(path)) + 160


def test_a_run_whose_manifest_links_outside_is_refused_unread(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    (tmp_path / "secret.json").write_text(json.dumps({"format": SECRET}))
    (run / "manifest.json").unlink()
    (run / "manifest.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(BadInput, match="leads outside") as refused:
        Run(run)
    assert "wJalr" not in str(refused.value)
