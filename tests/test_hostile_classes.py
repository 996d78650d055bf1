"""Classes of hostile artifacts closed by construction (issue 32), each by a generator of its members, with the side
that must keep working beside the side refused: run directories around the one examined, the working directory of
``python -m nanforensics``, pickles nested deep or referenced many times, structures of attacker-chosen size, text
that the output's encoding cannot hold or that runs to megabytes, memory a file claims, options and messages."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from nanforensics.errors import BadInput
from nanforensics.runs.imports import load_callable

from conftest import ROOT, assert_one_line_error, run_cli

SOME = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])

# ---- 1. every run directory on the way up is the run's, not the user's ------------------------------------------


@SOME
@given(manifests=st.lists(st.booleans(), min_size=1, max_size=4), level=st.integers(0, 4), n=st.integers(0, 10**9))
def test_code_in_any_run_directory_around_the_examined_one_is_refused(tmp_path_factory, manifests, level, n):
    """The examined folder lies ``len(manifests)`` folders below the project (the working directory); the folder
    ``i`` levels up holds a run manifest where ``manifests[i - 1]``. A script at ``level`` levels up is refused exactly
    when a folder at or above its own, below the project, holds a manifest (or it lies in the examined folder itself),
    and is never run; else it is the project's own code and admitted."""
    level = min(level, len(manifests))
    project = tmp_path_factory.mktemp("project")
    folders = [project]
    for i in range(len(manifests)):
        folders.insert(0, folders[0] / f"d{i}")
    folders[0].mkdir(parents=True)
    examined = folders[0]  # folders[i]: i levels above the examined folder; folders[-1] the project
    for i, has in enumerate(manifests, start=1):
        if has:
            (folders[i] / "manifest.json").write_text("{}")
    marker = project / f"ran{n}"
    script = folders[level] / f"evil{n}.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef build(**kwargs):\n    return 0\n")
    refused = level == 0 or any(manifests[level - 1:])
    before = os.getcwd()
    os.chdir(project)
    try:
        spec = f"{script.relative_to(project)}:build"
        if refused:
            with pytest.raises(BadInput, match="lies inside the run directory"):
                load_callable("model_factory", spec, where=examined / "manifest.json", forbidden=examined)
            assert not marker.exists(), "code from a run directory ran"
        else:
            assert load_callable("model_factory", spec, where=examined / "manifest.json", forbidden=examined)() == 0
    finally:
        os.chdir(before)


def test_an_incident_inside_a_run_cannot_name_the_runs_code_through_the_command_line(tmp_path):
    """The reported case: a replayed folder inside another run (``RUN/incidents/step_N``) names a file of that run,
    which lies under the working directory."""
    outer = tmp_path / "runs" / "exp1"
    inner = outer / "incidents" / "step_5"
    shutil.copytree(ROOT / "sample_runs" / "seed_adam", inner)
    (outer / "manifest.json").write_text((inner / "manifest.json").read_text())
    marker = tmp_path / "payload-ran"
    (outer / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                   "from regressor import build_model as build\n")
    data = json.loads((inner / "manifest.json").read_text())
    (inner / "manifest.json").write_text(json.dumps({**data, "model_factory": "runs/exp1/evil.py:build"}))
    result = run_cli("replay", inner, "--no-explain", "--code-path", ROOT / "sample_runs" / "code", cwd=tmp_path)
    assert_one_line_error(result, "manifest.json", "lies inside the run directory", str(outer.resolve()))
    assert not marker.exists(), "the enclosing run's code ran"


# ---- 2. python -m nanforensics imports nothing from the working directory ----------------------------------------


def test_python_m_imports_nothing_from_the_working_directory_but_the_code_the_policy_admits(tmp_path):
    """The class: every module name the interpreter, the package or a library it loads might import (the whole
    standard library, every top-level module of the platform, sympy's optional ``gmpy2``), left as a file in the
    working directory that ``python -m nanforensics`` (torchrun's workers start so) runs in. None is imported, from
    the first import on (the package's own ``__init__`` runs before its ``__main__``), and no bytecode is written there;
    the other side: the project's own code in that folder, which the manifest names, is imported and replayed."""
    import subprocess
    import sys

    from nanforensics.runs.imports import platform

    project = tmp_path / "project"
    shutil.copytree(ROOT / "sample_runs" / "code", project / "sample_runs" / "code")
    names = {n for n in {*sys.stdlib_module_names, *platform(), "gmpy2", "flint"} if n.isidentifier()}
    names -= {"__main__", "sample_runs", "nanforensics"}  # -m finds the package itself in the working directory first
    for name in names:
        (project / f"{name}.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'a').write({name!r} + ' ')\n"
                                            "raise ImportError('a module of the working directory')\n")
    before = sorted(p.name for p in project.iterdir())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONPYCACHEPREFIX", "PYTHONSAFEPATH")}
    out = subprocess.run([sys.executable, "-m", "nanforensics", "replay", str(ROOT / "sample_runs" / "seed_adam"),
                          "--no-explain", "--json", str(tmp_path / "r.json")], cwd=project, env=env,
                         capture_output=True, text=True, timeout=300)
    assert not (tmp_path / "imported").exists(), (tmp_path / "imported").read_text()
    assert out.returncode == 1, out.stderr  # found and attributed: the project's model and step function ran
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "nonfinite"
    assert sorted(p.name for p in project.iterdir()) == before  # no __pycache__
    assert not list((project / "sample_runs").rglob("__pycache__"))


# ---- 3. every pickle is checked for depth and size on its opcode stream, before any unpickler runs ----------------

def _nested_stream(kind: str, depth: int) -> bytes:
    """A protocol-2 pickle of one container nested ``depth`` deep, written op by op (the pickler itself would
    recurse): the stream a hostile file holds."""
    if kind == "tuple1":
        body = b")" + b"\x85" * depth
    elif kind == "tuple_mark":
        body = b"(" * depth + b")" + b"t" * depth
    elif kind == "list_append":
        body = b"]" * (depth + 1) + b"a" * depth
    elif kind == "list_appends":
        body = b"](" * depth + b"]" + b"e" * depth
    elif kind == "dict_key":  # the nested tuple a dict's key: hashing it recursed (a segmentation fault)
        body = b"})" + b"\x85" * depth + b"K\x01s"
    elif kind == "dict_setitem":
        body = b"}K\x01" * depth + b"}" + b"s" * depth
    else:  # "reduce": OrderedDict(((1, <inner>),)) all the way down, the class memoized once
        body = b"ccollections\nOrderedDict\nq\x00K\x01" + b"h\x00K\x01" * (depth - 1) + b"}" + b"\x86\x85\x85R" * depth
    return b"\x80\x02" + body + b"."


def _zip_of(tmp: Path, stream: bytes) -> Path:
    """A torch.save zip file whose ``data.pkl`` is ``stream``."""
    import io
    import zipfile

    import torch

    buffer = io.BytesIO()
    torch.save(0, buffer)
    path = tmp / "model.pt"
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, stream if info.filename.endswith("data.pkl") else src.read(info))
    return path


KINDS = st.sampled_from(["tuple1", "tuple_mark", "list_append", "list_appends", "dict_key", "dict_setitem", "reduce"])


@SOME
@given(kind=KINDS, depth=st.integers(100, 3000))  # depth + 1 containers, the innermost empty
@example(kind="dict_key", depth=300_000)  # the reported file: a segmentation fault
def test_a_pickle_nested_too_deep_is_refused_before_any_unpickler_runs(tmp_path_factory, kind, depth):
    """A container nested past the limit, as a torch zip file, a legacy ``.pth`` of the bare stream and a DCP
    ``.metadata``: one error naming the file, never a crash."""
    from nanforensics.formats import dcp, torch_file

    tmp = tmp_path_factory.mktemp("deep")
    stream = _nested_stream(kind, depth)
    (tmp / "legacy.pth").write_bytes(stream)
    (tmp / ".metadata").write_bytes(stream)
    for path, read in ((_zip_of(tmp, stream), torch_file.load), (tmp / "legacy.pth", torch_file.load),
                       (tmp / ".metadata", dcp.Layout)):
        with pytest.raises(BadInput, match="nests more than 100 deep: refused before unpickling") as refused:
            read(path)
        assert refused.value.where == str(path)


@SOME
@given(kind=KINDS, depth=st.integers(1, 60))
def test_a_pickle_nested_within_the_limit_is_read(tmp_path_factory, kind, depth):
    """The other side: the same containers within the limit are unpickled as they are (weights-only). The walk
    counts the values of the stream, argument tuples included: each level of ``reduce`` holds a tuple of pairs."""
    import pickle

    from nanforensics.formats import torch_file

    depth = depth // 2 if kind == "reduce" else depth
    stream = _nested_stream(kind, depth)
    expected = pickle.loads(stream)
    obj, _ = torch_file.load(_zip_of(tmp_path_factory.mktemp("shallow"), stream))
    assert obj == expected


@pytest.mark.parametrize("refs", [1_000, 1_000_000])
def test_a_container_referenced_many_times_is_bounded_by_what_it_expands_to(tmp_path, refs):
    """One param group memo-referenced ``refs`` times: a thousand groups are a checkpoint, a million are refused
    before unpickling (processed, they took more than 2 GiB)."""
    import pickle

    from nanforensics.formats import torch_file

    group = {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0]}
    stream = pickle.dumps({"state": {}, "param_groups": [group] * refs}, protocol=2)
    path = _zip_of(tmp_path, stream)
    if refs > 1_000:
        with pytest.raises(BadInput, match="more than 10000000 objects once its shared references are followed"):
            torch_file.load(path)
    else:
        obj, _ = torch_file.load(path)
        assert len(obj["param_groups"]) == refs


@pytest.mark.parametrize("stream", [b"\x80\x02]q\x00(h\x00h\x00e.",  # a list holding itself twice
                                    b"\x80\x02](]q\x00h\x00h\x00eh\x00K\x01a0."])  # filled after two references
def test_a_container_changed_after_it_was_referenced_is_refused(tmp_path, stream):
    """What a count taken at each reference would miss: a list referenced a million times while empty, then filled."""
    from nanforensics.formats import torch_file

    with pytest.raises(BadInput, match="changes a container after referring to it"):
        torch_file.load(_zip_of(tmp_path, stream))


# ---- 4. structures read from a file are processed in time linear in their size -----------------------------------


def _dcp_metadata(folder: Path, size: tuple[int, int], boxes: list[tuple[tuple[int, int], tuple[int, int]]],
                  paths: dict[str, object] | None = None) -> Path:
    """A DCP ``.metadata`` laying the float32 tensor ``w`` of ``size`` out as ``boxes`` (offsets, sizes), each chunk's
    blob as large as its bytes; ``paths``: the planner's paths in the saved state dict."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]
    storage = {MetadataIndex("w", torch.Size(o)): _StorageInfo("__0_0.distcp", 0, 4 * s[0] * s[1]) for o, s in boxes}
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)},
                  storage_data=storage, planner_data=paths)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return folder / ".metadata"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 20), cols=st.integers(1, 20), flaw=st.sampled_from([None, "duplicate", "shifted"]))
@example(rows=1, cols=20_000, flaw=None)  # the reported size: 20,000 chunks side by side (pairs: past a minute)
def test_chunks_of_a_dcp_tensor_are_checked_by_sort_and_sweep(tmp_path_factory, rows, cols, flaw):
    """A grid of ``rows`` x ``cols`` chunks tiles the tensor and is read; one chunk given twice, or one shifted onto
    its neighbour, is an overlap, named."""
    from nanforensics.formats import dcp

    boxes = [((2 * i, 3 * j), (2, 3)) for i in range(rows) for j in range(cols)]
    if flaw == "duplicate":
        boxes.append(boxes[len(boxes) // 2])
    elif flaw == "shifted" and len(boxes) > 1:
        (r, c), s = boxes[-1]
        boxes[-1] = ((r, max(0, c - 1)) if cols > 1 else (r - 1, c), s)
    else:
        flaw = None
    metadata = _dcp_metadata(tmp_path_factory.mktemp("dcp"), (2 * rows, 3 * cols), boxes)
    if flaw is None:
        [tensor] = dcp.Layout(metadata).tensors
        assert len(tensor.chunks) == rows * cols
    else:
        with pytest.raises(BadInput, match="overlap"):
            dcp.Layout(metadata)


def _group_by_prefixes(path: tuple[object, ...], paths: list[tuple[object, ...]]) -> bool:
    """The planner's grouping as it was defined, every prefix built: the reference for small paths."""
    state = {p[:i] for p in paths for i, k in enumerate(p) if k == "state"}
    groups = {p[:i] for p in paths for i, k in enumerate(p) if k == "param_groups"}
    return any(path[:len(p) + 1] == (*p, "state") for p in state & groups)


KEYS = st.sampled_from(["state", "param_groups", "model", "opt", 0, 1, "w"])


@settings(max_examples=60, deadline=None)
@given(paths=st.lists(st.lists(KEYS, max_size=6).map(tuple), min_size=1, max_size=6))
def test_planner_paths_are_walked_as_a_tree_not_as_prefixes(paths):
    """Whether a tensor's path goes through an optimizer's ``state``: the tree decides as every prefix built did."""
    from nanforensics.formats.dcp import _PathTree

    tree = _PathTree(paths)
    assert [tree.in_optimizer_state(p) for p in paths] == [_group_by_prefixes(p, paths) for p in paths]


def test_a_planner_path_of_300000_keys_is_read(tmp_path):
    """The reported size: a path of 300,000 keys (every prefix built ran past a minute); and a path that is no
    sequence of keys is one error."""
    from nanforensics.formats import dcp

    long = ("opt", *(["state", "param_groups"] * 150_000), "state", "w")
    metadata = _dcp_metadata(tmp_path / "long", (2, 3), [((0, 0), (2, 3))], {"w": long, "g": ("opt", "param_groups")})
    [entry] = dcp.dcp_entries(metadata, None)
    assert entry.info.group == "optimizer"
    odd = _dcp_metadata(tmp_path / "odd", (2, 3), [((0, 0), (2, 3))], {"w": 7})
    with pytest.raises(BadInput, match="planner's path of 'w' is not a sequence"):
        dcp.Layout(odd)


# ---- 7. every option is used or refused; every error names what the user gave -----------------------------------

REPLAY_ONLY = [("--code-path", "{code}"), ("--trust-run-dir",), ("--trust-package", "torch"), ("--trust-code",),
               ("--device", "cpu"), ("--max-steps", "5")]


@pytest.mark.parametrize("option", REPLAY_ONLY, ids=lambda o: o[0])
def test_bisect_refuses_a_replay_option_without_a_replay(option):
    """An option of the replay given to a bisection that replays nothing was accepted and ignored."""
    args = [a.format(code=ROOT / "sample_runs" / "code") for a in option]
    result = run_cli("bisect", ROOT / "sample_runs" / "seed_adam", *args)
    assert_one_line_error(result, f"{option[0]}: is for the replay that follows the bisection")


def test_bisect_replay_takes_the_code_path_it_accepts(tmp_path):
    """The reported case: ``bisect RUN --replay --code-path DIR`` from a folder where the run's code is not found ignored
    ``--code-path``, then advised passing it. The other side of the refusal above: given with ``--replay``, it is used."""
    result = run_cli("bisect", ROOT / "sample_runs" / "seed_adam", "--replay", "--code-path", ROOT / "sample_runs" / "code",
                     "--quiet", cwd=tmp_path)
    assert result.code == 1 and "error" not in result.stderr, result.stderr
    assert "features.gain" in result.stdout  # the replay's diagnosis, from the code --code-path names


def test_repair_names_out_when_a_write_fails(tmp_path):
    """Under a file-size limit (``ulimit -f``) repair's write fails inside the folder it builds under a temporary name:
    the error names ``--out`` and the folder given, which is not created."""
    import sys

    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "seed_adam", run)
    out = tmp_path / "repaired"
    # no bytecode written under the limit: CPython keeps a .pyc cut at the limit, and the tests share their cache
    limit = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384)); "
             "os.environ['PYTHONDONTWRITEBYTECODE'] = '1'; os.execvp(sys.argv[1], sys.argv[1:])")
    result = run_cli("repair", run, "--out", out, "--quiet", cwd=ROOT, wrapper=[sys.executable, "-c", limit])
    assert_one_line_error(result, f"--out: cannot write {out} (File too large)")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["run"]


# ---- 5. text on its way out: encodable in the output's encoding, bounded in length -------------------------------


@settings(max_examples=200, deadline=None)
@given(text=st.text(), repeat=st.sampled_from([1, 1000, 100_000]),
       encoding=st.sampled_from(["ascii", "latin-1", "utf-8", "cp1252", "iso8859-5"]))
def test_any_text_reaches_a_stream_of_any_encoding_escaped_and_cut(text, repeat, encoding):
    """Whatever a run supplies (any code point, surrogates too, up to megabytes), through ``visible`` onto a stream
    of any encoding: written, never ``UnicodeEncodeError``; at most ``MAX_SHOWN`` characters of it and of each word
    512, the rest counted; and text within the bounds, printable and encodable, comes out as it went in."""
    import io

    from nanforensics.views.escaping import MAX_SHOWN, unencodable_escaped, visible

    whole = text * repeat
    stream = io.TextIOWrapper(io.BytesIO(), encoding=encoding)
    unencodable_escaped(stream)
    shown = visible(whole)
    stream.write(shown)
    stream.flush()
    long_word = any(len(w) > 512 for w in whole.split(" "))  # a word: what no space breaks, once escaped
    if len(whole) > MAX_SHOWN or long_word:
        assert re.search(r"\.\.\. \(\d+ more characters\)$", shown)
        assert len(shown) <= 10 * MAX_SHOWN + 40  # an escape is at most 10 characters
        assert all(len(w) <= 10 * 512 + 3 for w in shown.split(" "))  # a word is cut at 512 characters, then escaped
    elif whole.isprintable():
        try:
            whole.encode(encoding)
        except UnicodeEncodeError:
            return
        assert stream.buffer.getvalue().decode(encoding) == whole  # type: ignore[attr-defined]


def test_a_non_ascii_and_a_huge_tensor_name_on_an_ascii_terminal(tmp_path):
    """The reported case through the command line, as a process under ``LANG=C PYTHONIOENCODING=ascii``: tensor names
    in other scripts and one of 4 MiB, each poisoned, are printed escaped and cut; exit 1, the diagnosis."""
    import subprocess

    import torch
    from safetensors.torch import save_file

    from conftest import cli_command, cli_env

    names = ["poids.é", "вес", "权重", "w\u202egnp.exe", "emoji😀", "x" * (4 << 20)]
    save_file({name: torch.tensor([float("nan"), 1.0]) for name in names}, str(tmp_path / "model.safetensors"))
    env = {**cli_env(), "LANG": "C", "LC_ALL": "C", "PYTHONIOENCODING": "ascii"}
    out = subprocess.run([*cli_command(), "scan", str(tmp_path / "model.safetensors"), "--full"], env=env,
                         capture_output=True, timeout=300)
    assert out.returncode == 1, out.stderr.decode("ascii", "replace")
    text = out.stdout.decode("ascii")  # ASCII through and through
    assert "poids.\\xe9" in text and "\\u0432\\u0435\\u0441" in text and "\\u202e" in text
    assert "more characters)" in text and len(out.stdout) < 100_000


# ---- 6. memory a file claims, met under a limit, names the file and the claim ------------------------------------


def _sparse_claim(path: Path, tensor: str, nbytes: int) -> None:
    """Rewrite the safetensors file ``path`` so that its tensor ``tensor`` claims ``nbytes`` (float32), laid last, in a
    sparse file as long as the claim: the header checks hold, the bytes are holes."""
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    header[tensor] = {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [end, end + nbytes]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + n:8 + n + end])
        f.truncate(8 + len(raw) + end + nbytes)


@pytest.mark.parametrize("reader", ["batch", "checkpoint"])
def test_a_claim_beyond_the_memory_limit_names_the_file_and_the_claim(tmp_path, reader):
    """A batch read by the replay (``TensorFile``) and a checkpoint read by the scan (``SafetensorsFile``), each
    claiming a 10 GiB tensor in a sparse file, under an address-space limit of 6 GiB: one line naming the file and the
    bytes claimed (a ``MemoryError`` through the catch-all, naming nothing, before)."""
    import sys

    run = tmp_path / "run"
    shutil.copytree(ROOT / "sample_runs" / "seed_adam", run)
    if reader == "batch":
        target, args = run / "batches" / "step_00000020.safetensors", ("replay", run, "--no-explain", "--quiet")
    else:
        target = run / "checkpoints" / "step_00000020" / "model.safetensors"
        args = ("scan", target.parent, "--quiet")
    _sparse_claim(target, "0" if reader == "batch" else "features.gain", 10 << 30)
    limit = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30)); "
             "os.execvp(sys.argv[1], sys.argv[1:])")
    result = run_cli(*args, cwd=ROOT, wrapper=[sys.executable, "-c", limit])
    claimed = 10 << 30 if reader == "checkpoint" else (10 << 30) + 256  # the batch: its other tensor (y) too
    assert_one_line_error(result, str(target), f": {claimed} bytes claimed, more memory than this process may take")


def _central_directory(data: bytes, offset: int, value: int) -> bytes:
    """``data`` (a zip file) with the 16-bit field at ``offset`` of every central directory record set to ``value``."""
    import struct

    out, at = bytearray(data), 0
    while (at := out.find(b"PK\x01\x02", at)) >= 0:
        struct.pack_into("<H", out, at + offset, value)
        at += 4
    return bytes(out)


# every general-purpose flag bit (0: encrypted, 3: sizes in a data descriptor, 5: patched data, 11: UTF-8 names...),
# a version to extract no zipfile implements, a compression method it does not know
ZIP_FIELDS = [("flag", 8, 1 << bit) for bit in range(16)] + [("version", 6, 0xFF), ("method", 10, 99)]


@pytest.mark.parametrize("field, offset, value", ZIP_FIELDS, ids=[f"{f}-{v}" for f, _, v in ZIP_FIELDS])
def test_a_zip_field_python_cannot_read_is_left_to_torch_never_the_catch_all(tmp_path, field, offset, value):
    """The pickle pre-check reads a torch.save zip with Python's zipfile before torch.load does: whatever zipfile
    raises for a record it cannot read (NotImplementedError for a version, RuntimeError for an encrypted record, both
    found by the fuzzer) leaves the file to torch.load, which reads it or says, in one line naming the file, why not."""
    import torch

    path = tmp_path / "ck.pt"
    torch.save({"w": torch.ones(3)}, path)
    path.write_bytes(_central_directory(path.read_bytes(), offset, value))
    result = run_cli("scan", path)
    if result.code == 2:
        assert_one_line_error(result, str(path))
    else:
        assert result.code == 0, result.stderr
