"""The reader's refusals, each at its edge: what inputs.py accepts at a limit and refuses one past it, and the one
line it refuses with (the file, then what is wrong). The command-line tests (test_trust_io, test_faults) see these
lines through whole commands; these read each check on its own, over every kind of file and each limit's two sides,
in milliseconds."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from pathlib import Path

import pytest
import torch
from nanforensics import inputs
from nanforensics.errors import BadInput
from nanforensics.inputs import (
    MAX_EXPANDED_BYTES,
    MAX_NESTING,
    MAX_STRIDE,
    check_regular,
    check_tensors,
    nesting_exceeds,
    not_regular,
    optimizer_problem,
    parse_json,
    read_input,
    shape_problem,
)

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
    ([GROUP], {0: {"old_dirs": [torch.zeros(1), 2, 3.5], "n_iter": 4}}, None),  # LBFGS: lists of tensors and numbers
    ([], {}, None),
    (["params"], {}, "a parameter group without a 'params' list"),
    ([{"lr": 1}], {}, "a parameter group without a 'params' list"),
    ([{"params": (0, 1)}], {}, "a parameter group without a 'params' list"),
    ([GROUP, {"params": [True]}], {}, "a parameter group's 'params' holds something other than parameter ids or names"),
    ([{"params": [0, 1.0]}], {}, "a parameter group's 'params' holds something other than parameter ids or names"),
    ([GROUP], {0: [torch.zeros(1)]}, "a parameter's state is a list, not a dict of named values"),
    ([GROUP], {0: {}, 1: None}, "a parameter's state is a NoneType, not a dict of named values"),
    ([GROUP], {0: {1: torch.zeros(1)}}, "a parameter's state holds a key that is not a name or a value that is neither a "
                                        "tensor nor a number"),
    ([GROUP], {0: {"step": "1"}}, "a parameter's state holds a key that is not a name or a value that is neither a tensor "
                                  "nor a number"),
    ([GROUP], {0: {"old_dirs": [torch.zeros(1), "x"]}}, "a parameter's state holds a key that is not a name or a value "
                                                        "that is neither a tensor nor a number"),
])
def test_an_optimizer_state_dict_unlike_torchs_says_what(groups, state, problem):
    assert optimizer_problem(sd(groups, state)) == problem
    wrapped = {"optimizer": sd(groups, state), "epoch": 3}  # wherever it lies in the file
    if problem is None:
        assert check_tensors(wrapped, WHERE) is None
    else:
        assert refusal(check_tensors, wrapped, WHERE) == f"{WHERE}: optimizer state is malformed: {problem}"


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

    def read(self, n: int) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_a_regular_file_that_cannot_be_read_is_refused_in_one_line(tmp_path, monkeypatch):
    """A regular file whose read fails (EIO from a failing disk): one line naming it, the system's words."""
    broken = tmp_path / "broken"
    broken.write_bytes(b"{}")
    real_open = inputs.open_input
    monkeypatch.setattr(inputs, "open_input", lambda path: _Unreadable(real_open(path)))
    assert refusal(read_input, broken) == f"{broken}: cannot read (Input/output error)"
