"""The reader's refusals, each at its edge: what inputs.py accepts at a limit and refuses one past it, and the one
line it refuses with (the file, then what is wrong). The command-line tests (test_trust_io, test_faults) see these
lines through whole commands; these read each check on its own, over every kind of file and each limit's two sides,
in milliseconds."""

from __future__ import annotations

import errno
import gc
import json
import math
import os
import socket
import stat
import struct
import warnings
from pathlib import Path

import pytest
import torch
from nanforensics import inputs
from nanforensics.errors import BadInput
from nanforensics.inputs import (
    MAX_EXPANDED_BYTES,
    MAX_HEADER_BYTES,
    MAX_NESTING,
    MAX_STRIDE,
    SafetensorsFile,
    check_regular,
    check_tensors,
    nesting_exceeds,
    not_regular,
    optimizer_problem,
    parse_json,
    read_input,
    shape_problem,
)

from test_faults import time_limit

WHERE = Path("run/meta.json")
try:
    int("1" * 5000)
except ValueError as e:
    TOO_LONG = str(e)  # over sys.get_int_max_str_digits(), 4300 by default


def refusal(call, *args, **kwargs) -> str:
    """The one line a check refuses with."""
    with pytest.raises(BadInput) as e:
        call(*args, **kwargs)
    return str(e.value)


@pytest.mark.parametrize("mode, said", [
    (stat.S_IFREG, None), (stat.S_IFIFO, "not a regular file (a FIFO)"), (stat.S_IFSOCK, "not a regular file (a socket)"),
    (stat.S_IFCHR, "not a regular file (a character device)"), (stat.S_IFBLK, "not a regular file (a block device)"),
    (stat.S_IFDIR, "not a regular file (a directory)"), (stat.S_IFLNK, "not a regular file")])
def test_every_kind_of_file_is_named(mode, said):
    assert not_regular(mode | 0o644) == said


def test_a_file_is_checked_by_stat_alone(tmp_path):
    regular = tmp_path / "steps.jsonl"
    regular.write_bytes(b"{}\n")
    os.mkfifo(fifo := tmp_path / "fifo")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock := tmp_path / "sock"))
        assert check_regular(regular) is None
        assert refusal(check_regular, tmp_path / "gone") == f"{tmp_path / 'gone'}: file is missing"
        assert refusal(check_regular, tmp_path) == f"{tmp_path}: not a regular file (a directory)"
        assert refusal(check_regular, fifo) == f"{fifo}: not a regular file (a FIFO)"
        assert refusal(check_regular, sock) == f"{sock}: not a regular file (a socket)"
        assert refusal(check_regular, regular / "x") == f"{regular / 'x'}: cannot read (Not a directory)"
        assert refusal(read_input, fifo) == f"{fifo}: not a regular file (a FIFO)"  # refused unopened: never waits
        assert refusal(read_input, tmp_path / "gone") == f"{tmp_path / 'gone'}: file is missing"


@pytest.mark.parametrize("size", [0, 1, 9, 10, 11])
def test_a_file_is_read_whole_up_to_its_limit_and_refused_past_it(tmp_path, size):
    path = tmp_path / "manifest.json"
    path.write_bytes(b"x" * size)
    if size <= 10:
        assert read_input(path, limit=10) == b"x" * size
    else:
        assert refusal(read_input, path, limit=10) == f"{path}: 11 bytes, more than the 10 this nanforensics reads of such a file"


@pytest.mark.parametrize("text, problem", [
    ("", "not valid JSON (Expecting value at line 1)"),
    ('{"a": 1,\n"b": }', "not valid JSON (Expecting value at line 2)"),
    ("[" * 100_000, "JSON nested too deeply (more than 100 levels)"),
    ("[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1), "JSON nested too deeply (more than 100 levels)"),
    ("1" * 5000, f"not valid JSON ({TOO_LONG[:120]})"),  # Python's own message, cut at 120 characters
    (b'"\xff"', "not valid JSON ('utf-8' codec can't decode byte 0xff in position 1: invalid start byte)"),
])
@pytest.mark.parametrize("what", ["", "lr"])
def test_json_is_refused_in_one_line_naming_the_file_and_the_field(text, problem, what):
    assert refusal(parse_json, text, WHERE, what) == f"{WHERE}: {what + ': ' if what else ''}{problem}"


@pytest.mark.parametrize("objects", [0, 1, 2, 3])
def test_json_is_refused_past_its_count_of_objects(objects):
    text = '[{}, {"a": {}}]'  # three objects
    if objects >= 3:
        assert parse_json(text, WHERE, objects=objects) == [{}, {"a": {}}]
    else:
        assert refusal(parse_json, text, WHERE, objects=objects) == f"{WHERE}: more than {objects} JSON objects"


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("container", ["[", '{"k": '])
def test_nesting_is_counted_in_containers_and_exceeds_its_limit_one_past_it(depth, container):
    close = "]" if container == "[" else "}"
    obj = json.loads(container * depth + "1" + close * depth)
    assert nesting_exceeds(obj, limit=2) is (depth > 2)
    assert nesting_exceeds([obj, [[1]]], limit=3) is (depth + 1 > 3)  # every branch counts, not the first
    assert nesting_exceeds([[[1]], obj], limit=3) is (depth + 1 > 3)
    assert parse_json(json.dumps(obj), WHERE) == obj
    deep = json.dumps([[obj]] * 2)
    assert parse_json(deep, WHERE) == [[obj]] * 2


def test_the_deepest_json_accepted_is_at_its_limit():
    at = json.loads("[" * MAX_NESTING + "]" * MAX_NESTING)
    assert parse_json("[" * MAX_NESTING + "]" * MAX_NESTING, WHERE) == at
    assert not nesting_exceeds(at) and nesting_exceeds([at])


@pytest.mark.parametrize("shape, itemsize, said", [
    ((), 4, None), ((0,), 4, None), ((3, -1), 4, "shape [3, -1] has a negative size"),
    ((-1,), 1, "shape [-1] has a negative size"), ((0, -2), 1, "shape [0, -2] has a negative size"),
    ((MAX_STRIDE,), 1, None), ((MAX_STRIDE,), 2, f"shape [{MAX_STRIDE}] has strides beyond 2^63 bytes"),
    ((MAX_STRIDE // 4, 0), 4, None), ((MAX_STRIDE // 4 + 1, 0), 4, f"shape [{MAX_STRIDE // 4 + 1}, 0] has strides "
                                                                   "beyond 2^63 bytes"),
    ((2 ** 31, 2 ** 30), 2, None), ((2 ** 31, 2 ** 30), 4, "shape [2147483648, 1073741824] has strides beyond 2^63 bytes"),
])
def test_a_shape_that_cannot_be_laid_out_says_why(shape, itemsize, said):
    assert shape_problem(shape, itemsize) == said


def sd(groups, state) -> dict:
    return {"state": state, "param_groups": groups}


GROUP = {"params": [0, 1], "lr": 0.1}


@pytest.mark.parametrize("groups, state, problem", [
    ([GROUP], {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2)}}, None),
    ([{"params": ["fc.weight"]}], {"fc.weight": {"momentum_buffer": None}}, None),
    ([GROUP], {0: {"old_dirs": [torch.zeros(1)], "al": [None], "t": 3.5, "n_iter": 4}}, None),  # LBFGS: lists of tensors
    ([GROUP], {0: {"exp_avg_sq_row": [torch.zeros(1), 2, 3.5]}}, None),  # a key no torch optimizer keeps: a flat list
    ([], {}, None),
    (["params"], {}, "a parameter group without a 'params' list"),
    ([{"lr": 1}], {}, "a parameter group without a 'params' list"),
    ([{"params": (0, 1)}], {}, "a parameter group without a 'params' list"),
    ([GROUP, {"params": [True]}], {}, "a parameter group's 'params' holds something other than parameter ids or names"),
    ([{"params": [0, 1.0]}], {}, "a parameter group's 'params' holds something other than parameter ids or names"),
    ([GROUP], {0: [torch.zeros(1)]}, "a parameter's state is a list, not a dict of named values"),
    ([GROUP], {0: {}, 1: None}, "a parameter's state is a NoneType, not a dict of named values"),
    ([GROUP], {0: {1: torch.zeros(1)}}, "a parameter's state holds a key that is not a name"),
    # a value of a type its key does not take (inputs.STATE; test_optimizer_state_types enumerates them): by its field
    ([GROUP], {0: {"step": "1"}}, "=state[0].step is a string, not a real number or a one-element real tensor"),
    ([GROUP], {0: {"old_dirs": [torch.zeros(1), "x"]}}, "=state[0].old_dirs is a list of 2, not a list of real tensors"),
    ([GROUP], {1: {"qmap1": [torch.zeros(1), "x"]}}, "=state[1].qmap1 is a list of 2, not a tensor, a number, None or a "
                                                     "flat list of these"),
])
def test_an_optimizer_state_dict_unlike_torchs_says_what(groups, state, problem):
    said = None if problem is None else problem[1:] if problem.startswith("=") else \
        f"optimizer state is malformed: {problem}"
    assert optimizer_problem(sd(groups, state)) == said
    wrapped = {"optimizer": sd(groups, state), "epoch": 3}  # wherever it lies in the file
    if problem is None:
        assert check_tensors(wrapped, WHERE) is None
    else:
        field = "optimizer." if problem.startswith("=") else ""  # a field path names where the state dict lies
        assert refusal(check_tensors, wrapped, WHERE) == f"{WHERE}: {field}{said}"


def test_only_a_dict_with_a_state_dict_and_a_param_groups_list_is_taken_for_optimizer_state():
    for lookalike in ({"state": [1], "param_groups": ["x"]}, {"state": {0: 1}, "param_groups": ({"x": 1},)},
                      {"state": {0: 1}}, {"param_groups": ["x"]}):
        assert check_tensors(lookalike, WHERE) is None


@pytest.mark.parametrize("depth", [MAX_NESTING - 1, MAX_NESTING, MAX_NESTING + 1])
def test_objects_nested_past_the_limit_are_refused(depth):
    obj: object = 1
    for i in range(depth):
        obj = [obj] if i % 3 == 0 else (obj,) if i % 3 == 1 else {"k": obj}
    if depth <= MAX_NESTING:
        assert check_tensors(obj, WHERE) is None
    else:
        assert refusal(check_tensors, obj, WHERE) == f"{WHERE}: its objects nest more than 100 deep"


def test_objects_are_counted_per_reference_up_to_the_limit(monkeypatch):
    monkeypatch.setattr(inputs, "MAX_JSON_OBJECTS", 10)
    shared = [1, 2]  # 3 objects, referenced three times: 1 + 3 * 3 = 10
    assert check_tensors([shared, shared, shared], WHERE) is None
    assert refusal(check_tensors, [shared, shared, shared, 1], WHERE) == \
        f"{WHERE}: holds more than 10 objects, counting each reference to a shared one"
    monkeypatch.setattr(inputs, "MAX_TENSORS", 2)
    assert check_tensors({"a": torch.zeros(1), "b": [torch.zeros(2)]}, WHERE) is None
    assert refusal(check_tensors, [torch.zeros(1)] * 3, WHERE) == f"{WHERE}: holds more than 2 tensors"


def test_a_view_may_claim_at_most_its_limit_beyond_its_storage():
    stored = torch.zeros(4)  # 16 bytes
    at = stored[:1].expand((MAX_EXPANDED_BYTES + 16) // 4)
    assert check_tensors({"t": at}, WHERE) is None
    past = stored[:1].expand((MAX_EXPANDED_BYTES + 16) // 4 + 1)
    assert refusal(check_tensors, {"t": past}, WHERE) == (
        f"{WHERE}: a tensor of shape [{(MAX_EXPANDED_BYTES + 16) // 4 + 1}] claims {MAX_EXPANDED_BYTES + 20} bytes over a "
        f"storage of 16 (a stride-0 or overlapping view); nanforensics reads at most {MAX_EXPANDED_BYTES} more than a "
        "tensor stores")
    huge = torch.zeros(1).expand(2 ** 40)
    assert refusal(check_tensors, [huge], WHERE).startswith(f"{WHERE}: a tensor of shape [1099511627776] claims 4398046511104")


@pytest.mark.filterwarnings("ignore:Sparse CS[RC] tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr", "bsc"])
def test_a_sparse_tensors_stored_parts_are_checked_as_views(layout):
    dense = torch.eye(4)
    sparse = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc(),
              "bsr": dense.to_sparse_bsr((2, 2)), "bsc": dense.to_sparse_bsc((2, 2))}[layout]
    assert check_tensors([sparse], WHERE) is None
    values = torch.zeros(1).expand(MAX_EXPANDED_BYTES)  # values claiming far past what they store
    index = torch.zeros(1, dtype=torch.long).expand(MAX_EXPANDED_BYTES)
    compressed = torch.tensor([0, MAX_EXPANDED_BYTES])
    bad = {"coo": lambda: torch.sparse_coo_tensor(index.unsqueeze(0), values, (4,), check_invariants=False),
           "csr": lambda: torch.sparse_csr_tensor(compressed, index, values, (1, 4), check_invariants=False),
           "csc": lambda: torch.sparse_csc_tensor(compressed, index, values, (4, 1), check_invariants=False),
           "bsr": lambda: torch.sparse_bsr_tensor(compressed, index, values.view(-1, 1, 1), (1, 4), check_invariants=False),
           "bsc": lambda: torch.sparse_bsc_tensor(compressed, index, values.view(-1, 1, 1), (4, 1), check_invariants=False),
           }[layout]()
    assert refusal(check_tensors, [bad], WHERE).startswith(f"{WHERE}: a tensor of shape [")


def test_a_tensor_whose_strides_pass_int64_is_refused_before_its_storage_is_weighed():
    huge = torch.zeros(1).expand(2 ** 62)  # 2^64 bytes claimed: no layout holds it
    assert refusal(check_tensors, {"t": huge}, WHERE) == \
        f"{WHERE}: a tensor's shape [4611686018427387904] has strides beyond 2^63 bytes"


class _SizeSays:
    """A file's stat as /proc's files give it (size 0 whatever they hold), or as a file that grew since: its other
    fields the file's own."""

    def __init__(self, real: os.stat_result) -> None:
        self._real = real
        self.st_size = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def test_a_file_holding_more_than_its_size_says_is_refused_past_the_limit(tmp_path, monkeypatch):
    """A size that says less than the file holds (/proc's 0, or a file grown since the fstat): read past the limit
    is refused, never returned cut. The file is the test's own; its stat says 0."""
    grown = tmp_path / "grown"
    grown.write_bytes(b"x" * 300)
    real_fstat = os.fstat
    monkeypatch.setattr(inputs.os, "fstat", lambda fd: _SizeSays(real_fstat(fd)))
    assert read_input(grown, limit=100_000) == b"x" * 300
    assert refusal(read_input, grown, limit=100) == \
        f"{grown}: more than the 100 bytes this nanforensics reads of such a file (its size said 0)"


class _Unreadable:
    """An open regular file whose reads fail as a failing disk's do (EIO)."""

    def __init__(self, f: object) -> None:
        self._f = f

    def __enter__(self) -> "_Unreadable":
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()  # type: ignore[attr-defined]

    def fileno(self) -> int:
        return self._f.fileno()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._f.close()  # type: ignore[attr-defined]

    def read(self, n: int) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_a_regular_file_that_cannot_be_read_is_refused_in_one_line(tmp_path, monkeypatch):
    """A regular file whose read fails (EIO from a failing disk): one line naming it, the system's words."""
    broken = tmp_path / "broken"
    broken.write_bytes(b"{}")
    real_open = inputs.open_input
    monkeypatch.setattr(inputs, "open_input", lambda path: _Unreadable(real_open(path)))
    assert refusal(read_input, broken) == f"{broken}: cannot read (Input/output error)"


# ---- opening: the tree, the kind of file, the handle -----------------------------------------------------------


def test_a_symlink_inside_an_examined_tree_is_followed_only_while_it_stays_inside(tmp_path):
    """A link in the tree to a file outside it is refused unread, naming the tree as it was given; a link inside it,
    a link out of a tree not examined, and the root itself given as a link (to a folder or a file) are read."""
    real, outside = tmp_path / "real", tmp_path / "secret"
    real.mkdir()
    outside.write_bytes(b"SECRET")
    (real / "data").write_bytes(b"inner")
    (real / "out").symlink_to(outside)
    (real / "in").symlink_to(real / "data")
    (tmp_path / "run").symlink_to(real)  # the run named through a link: its own links judged against where it leads
    (tmp_path / "ck").symlink_to(outside)  # a checkpoint file named through a link: the root, read
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "out").symlink_to(outside)
    inputs.examine(tmp_path / "run")
    inputs.examine(tmp_path / "run")  # twice: one tree
    inputs.examine(os.path.relpath(tmp_path / "ck"))
    assert inputs.examined().count(real) == 1 and outside in inputs.examined()
    assert refusal(read_input, tmp_path / "run" / "out") == \
        f"{tmp_path / 'run' / 'out'}: leads outside {tmp_path / 'run'}, the tree being examined (a symlink): not read"
    for path in (tmp_path / "run" / "in", tmp_path / "run" / "data", real / "out", tmp_path / "elsewhere" / "out"):
        assert read_input(path) in (b"inner", b"SECRET")
    assert read_input(tmp_path / "ck") == b"SECRET"


def test_a_file_replaced_between_its_check_and_its_open_is_refused_and_closed(tmp_path, monkeypatch):
    """A FIFO put where a regular file was checked: opened without waiting for a writer, found out by fstat, closed,
    refused; a regular file's handle reads as any file does (blocking)."""
    os.mkfifo(fifo := tmp_path / "fifo")
    (regular := tmp_path / "regular").write_bytes(b"{}")
    with inputs.open_input(regular) as f:
        assert os.get_blocking(f.fileno()) and f.read() == b"{}" and "b" in f.mode
    monkeypatch.setattr(inputs, "check_regular", lambda path: None)  # the check passed: the path changed since
    gc.collect()  # the files of the tests before, closed first
    os.close(lowest := os.open(regular, os.O_RDONLY))  # POSIX: open takes the lowest free descriptor
    with time_limit(10):
        assert refusal(inputs.open_input, fifo) == f"{fifo}: not a regular file (a FIFO)"
    os.close(again := os.open(regular, os.O_RDONLY))
    assert again == lowest  # the FIFO's descriptor was closed, not left holding the lowest one
    assert refusal(inputs.open_input, tmp_path / "gone") == f"{tmp_path / 'gone'}: file is missing"
    (tmp_path / "folder").mkdir()
    assert refusal(inputs.open_input, tmp_path / "folder" / "x" / "y") == f"{tmp_path / 'folder' / 'x' / 'y'}: file is missing"
    assert refusal(inputs.open_input, regular / "x") == f"{regular / 'x'}: cannot read (Not a directory)"


def test_a_json_file_is_refused_naming_itself_and_an_excerpt_is_short_and_escaped(tmp_path):
    (path := tmp_path / "manifest.json").write_text('{"a": [1, 2]}')
    assert inputs.load_json(path) == {"a": [1, 2]}
    path.write_text('{"a": ')
    assert refusal(inputs.load_json, path) == f"{path}: not valid JSON (Expecting value at line 1)"
    assert inputs.excerpt(b"\x1b[2J" + b"x" * 40) == repr(b"\x1b[2J" + b"x" * 20)
    assert inputs.excerpt("a\nb" * 20, limit=4) == repr("a\nba")
    assert inputs.excerpt("\n" * 40, limit=30) == repr("\n" * 30)[:57] + "..."
    assert inputs.one_line(ValueError("a\n  b\tc ")) == "a b c" and inputs.one_line(ValueError()) == "ValueError"


# ---- safetensors: every claim of a header at its edge ----------------------------------------------------------


def _st(path: Path, header: object, data: bytes = b"", raw: bytes | None = None) -> Path:
    """A safetensors file: its 8-byte header length, its header (``raw`` as given, else ``header`` as JSON), ``data``."""
    raw = json.dumps(header).encode() if raw is None else raw
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _f32(name: str, shape: list[int], begin: int) -> dict:
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": [begin, begin + 4 * math.prod(shape)]}}


@pytest.mark.parametrize("size", range(9))
def test_a_file_too_short_for_its_header_length_says_its_size(tmp_path, size):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\0" * size)
    if size < 8:
        assert refusal(SafetensorsFile, path) == f"{path}: truncated: {size} bytes, too short for a safetensors header"
    else:
        assert refusal(SafetensorsFile, path) == f"{path}: not a safetensors file (its header is not JSON)"


@pytest.mark.parametrize("n, size, said", [
    (MAX_HEADER_BYTES + 1, 8, f"not a safetensors file (header length {MAX_HEADER_BYTES + 1})"),
    (MAX_HEADER_BYTES, 8, f"truncated: the header needs {MAX_HEADER_BYTES + 8} bytes, the file has 8"),
    (2 ** 64 - 1, 8, f"not a safetensors file (header length {2 ** 64 - 1})"),
    (3, 10, "truncated: the header needs 11 bytes, the file has 10"),
    (2, 10, None), (2, 11, None)])
def test_a_header_length_is_checked_against_its_limit_and_the_files_size(tmp_path, n, size, said):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", n) + (b"{}" + b"\0" * size)[:size - 8])
    if said is None:
        f = SafetensorsFile(path)
        assert f.entries == [] and f.metadata == {}
    else:
        assert refusal(SafetensorsFile, path) == f"{path}: {said}"


@pytest.mark.parametrize("raw, said", [
    (b"[" * 100_000, "not a safetensors file (its header is JSON nested too deeply)"),
    (b"{", "not a safetensors file (its header is not JSON)"),
    (b'{"\xff": 1}', "not a safetensors file (its header is not JSON)"),
    (b"1" * 5000, "not a safetensors file (its header is not JSON)"),
    (b"[]", "not a safetensors file (its header is not a JSON object)"),
    (b'"x"', "not a safetensors file (its header is not a JSON object)"),
    (b'{"__metadata__": ["a"]}', "malformed safetensors header (__metadata__ is not an object of strings)"),
    (b'{"__metadata__": "x"}', "malformed safetensors header (__metadata__ is not an object of strings)"),
    (b'{"__metadata__": {"a": {}}}', "malformed safetensors header (__metadata__ is not an object of strings)"),
    (b'{"__metadata__": {"a": [1]}}', "malformed safetensors header (__metadata__ is not an object of strings)"),
])
def test_a_header_that_is_no_safetensors_header_says_why(tmp_path, raw, said):
    assert refusal(SafetensorsFile, path := _st(tmp_path / "x.safetensors", None, raw=raw)) == f"{path}: {said}"


@pytest.mark.parametrize("meta, kept", [(None, {}), ({}, {}), ([], {}), ("", {}), (0, {}),
                                        ({"format": "pt", "n": 1, "x": None}, {"format": "pt", "n": "1", "x": "None"})])
def test_a_headers_metadata_is_read_as_strings(tmp_path, meta, kept):
    f = SafetensorsFile(_st(tmp_path / "x.safetensors", {"__metadata__": meta, **_f32("w", [1], 0)}, b"\0" * 4))
    assert f.metadata == kept and [e.name for e in f.entries] == ["w"]


@pytest.mark.parametrize("limit", [1, 2, 3])
@pytest.mark.parametrize("count", range(5))
@pytest.mark.parametrize("meta", [False, True])
def test_a_header_lists_at_most_its_limit_of_tensors(tmp_path, monkeypatch, limit, count, meta):
    """Counted while the JSON is parsed (each entry an object), then as entries: one past the limit is refused by
    one or the other, with or without __metadata__ (itself an object)."""
    monkeypatch.setattr(inputs, "MAX_TENSORS", limit)
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(count)}
    path = _st(tmp_path / "x.safetensors", {**({"__metadata__": {"a": "b"}} if meta else {}), **header})
    if count <= limit:
        assert [e.name for e in SafetensorsFile(path).entries] == list(header)
    else:
        assert refusal(SafetensorsFile, path) == f"{path}: its header lists more than {limit} tensors"


MALFORMED = "malformed safetensors header entry for tensor 'w'"


@pytest.mark.parametrize("spec, said", [
    ([], MALFORMED), ("F32", MALFORMED), (None, MALFORMED), ({"shape": [1], "data_offsets": [0, 4]}, MALFORMED),
    ({"dtype": "F32", "data_offsets": [0, 4]}, MALFORMED), ({"dtype": "F32", "shape": [1]}, MALFORMED),
    ({"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}, MALFORMED),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}, MALFORMED),
    ({"dtype": "F32", "shape": [1], "data_offsets": 4}, MALFORMED),
    ({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]},
     "tensor 'w': shape [1.0] is not a list of integers from 0 to 2^63-1"),
    ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]},
     "tensor 'w': shape [True] is not a list of integers from 0 to 2^63-1"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
     "tensor 'w': shape [-1] is not a list of integers from 0 to 2^63-1"),
    ({"dtype": "F32", "shape": [1, MAX_STRIDE + 1], "data_offsets": [0, 4]},
     f"tensor 'w': shape [1, {MAX_STRIDE + 1}] is not a list of integers from 0 to 2^63-1"),
    ({"dtype": "U8", "shape": [MAX_STRIDE], "data_offsets": [0, 8]},
     "truncated: tensor 'w' ends at data byte 8, the file holds 4 data bytes"),
    ({"dtype": "F32", "shape": [MAX_STRIDE], "data_offsets": [0, 4]},
     f"tensor 'w': shape [{MAX_STRIDE}] has strides beyond 2^63 bytes"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]},
     "tensor 'w': data_offsets [0, 4.0] is not a list of integers from 0 to 2^63-1"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [-1, 4]},
     "tensor 'w': data_offsets [-1, 4] is not a list of integers from 0 to 2^63-1"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, MAX_STRIDE + 1]},
     f"tensor 'w': data_offsets [0, {MAX_STRIDE + 1}] is not a list of integers from 0 to 2^63-1"),
    ({"dtype": "F128", "shape": [1], "data_offsets": [0, 4]},
     "tensor 'w' has dtype 'F128', which this nanforensics cannot read"),
    ({"dtype": 32, "shape": [1], "data_offsets": [0, 4]}, "tensor 'w' has dtype 32, which this nanforensics cannot read"),
    ({"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
     "tensor 'w' has dtype ['F32'], which this nanforensics cannot read"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, MALFORMED),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, "truncated: tensor 'w' ends at data byte 8, the file holds 4 "
                                                              "data bytes"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "tensor 'w' spans 4 bytes, its shape [2] of F32 needs 8"),
    ({"dtype": "I64", "shape": [], "data_offsets": [0, 4]}, "tensor 'w' spans 4 bytes, its shape [] of I64 needs 8"),
    ({"dtype": "F16", "shape": [1], "data_offsets": [1, 4]}, "tensor 'w' spans 3 bytes, its shape [1] of F16 needs 2"),
])
def test_a_header_entry_that_cannot_be_laid_out_in_the_file_says_why(tmp_path, spec, said):
    """Each field of an entry at its edge, against a file of 4 data bytes."""
    path = _st(tmp_path / "x.safetensors", {"w": spec}, b"\0" * 4)
    assert refusal(SafetensorsFile, path) == f"{path}: {said}"


def test_a_header_entry_at_its_edges_is_taken(tmp_path):
    """Each limit reached, not passed: an offset at the data's end, a tensor of no bytes at it, every dtype."""
    header: dict = {"e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [12, 12]}}
    begin = 0
    for name, dtype in inputs._dtypes().items():
        header[name] = {"dtype": name, "shape": [1, 1], "data_offsets": [begin, begin + dtype.itemsize]}
        begin += dtype.itemsize
    f = SafetensorsFile(_st(tmp_path / "x.safetensors", header, b"\1" * begin))
    base = 8 + len(json.dumps(header))
    assert [(e.name, e.dtype, e.shape, e.start, e.end) for e in f.entries] == sorted(
        [(name, inputs._dtypes().get(s["dtype"], torch.float32), tuple(s["shape"]), base + s["data_offsets"][0],
          base + s["data_offsets"][1]) for name, s in header.items()], key=lambda e: e[3])
    assert f.entries[-1].end == base + begin


def test_tensors_are_read_from_any_offset_as_they_were_written(tmp_path):
    """Tensors before, across and past a page's edge (the map starts on one), empty ones, one of each shape: their
    values exactly; read twice, from the file whose header was checked."""
    tensors = {"a": torch.arange(3, dtype=torch.float32), "b": torch.arange(2000, dtype=torch.float32).view(40, 50),
               "c": torch.tensor([7, -8], dtype=torch.int64), "d": torch.zeros(0, 4), "e": torch.tensor(2.5),
               "f": torch.arange(5000, dtype=torch.int16), "g": torch.zeros(2, 0, dtype=torch.int64)}
    header, data = {}, b""
    for name, t in tensors.items():
        raw = t.numpy().tobytes()
        header[name] = {"dtype": {torch.float32: "F32", torch.int64: "I64", torch.int16: "I16"}[t.dtype],
                        "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    f = SafetensorsFile(_st(tmp_path / "x.safetensors", header, data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning about a read-only buffer is the reader's to silence
        torch.set_warn_always(True)  # torch says it once a process: here, each time
        try:
            reads = [{e.name: f.read(e) for e in f.entries} for _ in range(2)]
        finally:
            torch.set_warn_always(False)
        for read in reads:
            assert read.keys() == tensors.keys()
            for name, t in tensors.items():
                assert read[name].dtype == t.dtype and read[name].shape == t.shape and torch.equal(read[name], t), name


def test_a_file_cut_short_after_its_header_was_checked_is_refused_at_the_tensor_past_its_end(tmp_path):
    path = _st(tmp_path / "x.safetensors", {**_f32("a", [2], 0), **_f32("b", [2], 8)}, b"\0" * 16)
    f = SafetensorsFile(path)
    a, b = f.entries
    os.truncate(path, b.end - 1)
    assert f.read(a).tolist() == [0.0, 0.0]
    assert refusal(f.read, b) == f"{path}: truncated while being read: tensor 'b' is past its end"
    os.truncate(path, b.end)
    assert f.read(b).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("error, said", [(errno.ENOMEM, "tensor 'w': 8 bytes claimed, more memory than this process may take"),
                                         (errno.ENODEV, "cannot map tensor 'w' (No such device)")])
def test_a_tensor_the_system_will_not_map_is_refused_in_one_line(tmp_path, monkeypatch, error, said):
    f = SafetensorsFile(path := _st(tmp_path / "x.safetensors", _f32("w", [2], 0), b"\0" * 8))

    def refuse(*args, **kwargs):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(inputs.mmap, "mmap", refuse)
    assert refusal(f.read, f.entries[0]) == f"{path}: {said}"


def test_a_header_that_cannot_be_read_is_refused_in_one_line(tmp_path, monkeypatch):
    path = _st(tmp_path / "x.safetensors", {}, b"")
    real_open = inputs.open_input
    monkeypatch.setattr(inputs, "open_input", lambda p: _Unreadable(real_open(p)))
    assert refusal(SafetensorsFile, path) == f"{path}: cannot read (Input/output error)"


def test_a_tensor_file_reads_what_its_header_lists_and_refuses_what_safetensors_cannot(tmp_path):
    """TensorFile: the checked header first (a truncated file named by its tensor), then safetensors' own reading;
    what safetensors refuses (overlapping tensors, bytes no tensor covers, a name not in the file) in one line."""
    good = _st(tmp_path / "good.safetensors", {"__metadata__": {"format": "pt"}, **_f32("a", [2], 0), **_f32("b", [1], 8)},
               struct.pack("<3f", 1.0, 2.0, 3.0))
    f = inputs.TensorFile(good)
    assert f.keys() == ["a", "b"] and f.metadata() == {"format": "pt"}
    assert {k: v.tolist() for k, v in f.items()} == {"a": [1.0, 2.0], "b": [3.0]}
    assert {k: v.tolist() for k, v in f.load_all().items()} == {"a": [1.0, 2.0], "b": [3.0]}
    assert inputs.TensorFile(_st(tmp_path / "bare.safetensors", _f32("a", [1], 0), b"\0" * 4)).metadata() == {}
    assert refusal(f.get, "zz") == f"{good}: tensor 'zz' is unreadable (File does not contain tensor zz)"
    short = _st(tmp_path / "short.safetensors", _f32("a", [2], 0), b"\0" * 4)
    assert refusal(inputs.TensorFile, short) == f"{short}: truncated: tensor 'a' ends at data byte 8, the file holds 4 " \
        "data bytes"
    overlap = _st(tmp_path / "overlap.safetensors", {**_f32("a", [2], 0), **_f32("b", [2], 0)}, b"\0" * 8)
    assert refusal(inputs.TensorFile, overlap).startswith(f"{overlap}: not a readable safetensors file (Error while "
                                                          "deserializing header: invalid offset for tensor `")
    gap = _st(tmp_path / "gap.safetensors", _f32("a", [2], 0), b"\0" * 12)
    assert refusal(inputs.TensorFile, gap) == f"{gap}: not a readable safetensors file (Error while deserializing " \
        "header: incomplete metadata, file not fully covered)"


def test_a_safetensors_file_freed_closes_its_file_quietly(tmp_path):
    path = _st(tmp_path / "x.safetensors", _f32("w", [1], 0), b"\0" * 4)
    gc.collect()  # the files of the tests before, closed first

    def lowest_free() -> int:  # POSIX: open takes the lowest free descriptor
        os.close(fd := os.open(path, os.O_RDONLY))
        return fd

    before = lowest_free()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        f = SafetensorsFile(path)
        assert lowest_free() != before  # the file holds it
        del f
        gc.collect()
    assert lowest_free() == before and not [w for w in said if w.category is ResourceWarning]


def test_memory_refused_to_a_tensor_file_names_the_file_and_its_claim(tmp_path, monkeypatch):
    """The system refusing memory (an address-space limit) when safetensors maps the file, or reads a tensor: one
    line naming the file, what was read and the bytes its header claims for it."""
    import safetensors

    path = _st(tmp_path / "x.safetensors", {**_f32("a", [2], 0), **_f32("b", [1], 8)}, b"\0" * 12)
    real = safetensors.safe_open

    class Refusing:
        def __init__(self, *args, **kwargs) -> None:
            self._handle = real(*args, **kwargs)

        def get_tensor(self, key: str) -> torch.Tensor:
            raise MemoryError

    monkeypatch.setattr(safetensors, "safe_open", Refusing)
    f = inputs.TensorFile(path)
    for key, claimed in (("a", 8), ("b", 4)):
        assert refusal(f.get, key) == f"{path}: tensor {key!r}: {claimed} bytes claimed, more memory than this process may take"

    def no_map(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(safetensors, "safe_open", no_map)
    assert refusal(inputs.TensorFile, path) == f"{path}: its tensors: 12 bytes claimed, more memory than this process may take"
