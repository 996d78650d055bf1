"""The one safetensors writer (runs/files.safetensors_parts): the file safetensors' own writer makes, from the tensors'
memory. The class: a file whose header or layout differs from safetensors' (a dtype's name, its place in the data, the
header's padding, a view or shared storage written as it lies), generated over dtypes, shapes, views and names."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics.runs.files import safetensors_parts, write_bytes_atomic
from safetensors.torch import load, save

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint16, torch.uint32, torch.uint64]


@st.composite
def tensor(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    t = torch.arange(max(1, 2 * torch.Size(shape).numel()), dtype=torch.float64).to(dtype)[:torch.Size(shape).numel()]
    t = t.reshape(shape)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # a view: not contiguous
    if t.is_complex() and draw(st.booleans()):
        t = (t * (1 + 1j)).conj()  # a lazy conjugate: its memory holds the values unconjugated
    return t


NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=6).filter(
    lambda k: k != "__metadata__")


def _header(data: bytes) -> dict:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(NAMES, tensor(), max_size=5), st.dictionaries(NAMES, st.text(max_size=8), max_size=3),
       st.booleans())
def test_the_file_is_safetensors_own(tensors, metadata, share):
    if share and tensors:  # one storage under two names: written twice, as safetensors would be given two copies
        first = next(iter(tensors))
        tensors["shared"] = tensors[first]
    ours = b"".join(safetensors_parts(tensors, metadata))
    loaded = load(ours)
    assert loaded.keys() == tensors.keys()
    for k, t in tensors.items():
        assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape
        assert torch.equal(loaded[k].reshape(-1).view(torch.uint8), t.resolve_conj().reshape(-1).view(torch.uint8))
    if not tensors and not metadata:  # safetensors 0.8 writes '{},"__metadata__":{}}' here: a header no reader parses
        assert _header(ours) == {"__metadata__": {}}
        return
    theirs = save({k: v.resolve_conj().contiguous().clone() for k, v in tensors.items()}, metadata=metadata)
    # safetensors writes the metadata's keys in an order that varies per process; ours are sorted
    assert _header(ours) == _header(theirs)
    assert list(_header(ours)["__metadata__"]) == sorted(metadata)
    n = struct.unpack("<Q", ours[:8])[0]
    assert ours[:8] == theirs[:8] and ours[8 + n:] == theirs[8 + n:]  # the header's length and padding, the data
    if len(metadata) <= 1:
        assert ours == theirs


def test_parts_are_written_whole_and_in_order(tmp_path):
    tensors = {"x": torch.randn(300, 1000), "y": torch.arange(7)}
    path = tmp_path / "f.safetensors"
    write_bytes_atomic(path, safetensors_parts(tensors, {"format": "f"}), durable=False)
    assert path.read_bytes() == b"".join(safetensors_parts(tensors, {"format": "f"}))
    assert [p.name for p in tmp_path.iterdir()] == ["f.safetensors"]  # no temporary file left


def test_a_dtype_safetensors_cannot_store_is_refused():
    with pytest.raises(ValueError, match="'z'.*complex128"):
        safetensors_parts({"z": torch.zeros(2, dtype=torch.complex128)}, {})
