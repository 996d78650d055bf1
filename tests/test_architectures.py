"""Recurrent and compiled models, recorded by the project's recorder and replayed: the origin named for each.

The LSTM runs (tests/sequence_models.py) meet an empty sequence whose mean over time is guarded by ``torch.where``:
a finite loss, NaN in every LSTM weight's gradient, NaN loss one step later. The compiled run is the scenarios'
regressor under ``torch.compile(backend="aot_eager")`` (inductor takes minutes to compile on two cores).
"""

from __future__ import annotations

import json
import math
import shutil
import string
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.monitor import StepMonitor
from nanforensics.report import Event
from nanforensics.rootcause.operations import trace_step
from nanforensics.runs.checkpoint import Checkpoint
from nanforensics.runs.compiled import compiled_backend, eager
from torch.nn.utils.rnn import pack_padded_sequence

import scenarios
import sequence_models as sm
from conftest import run_cli, tree_digest

STEPS, DEFECT, EVERY = 6, 3, 3


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An unpacked and a packed LSTM run, and a compiled regressor's, each recorded once for this module."""
    root = tmp_path_factory.mktemp("architectures")
    sm.record_sequence(root / "lstm", STEPS, DEFECT, EVERY, packed=False)
    sm.record_sequence(root / "lstm_packed", STEPS, DEFECT, EVERY)
    sm.record_compiled(root / "compiled", STEPS, DEFECT, EVERY)
    return {p.name: p for p in root.iterdir()}


def _grads_at_defect(run: Path, **kwargs) -> dict[str, torch.Tensor]:
    """The defective step's gradients, computed here by plain PyTorch from the checkpoint before it (no replay)."""
    model = sm.build_sequence_model(**kwargs)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    Checkpoint(run / "checkpoints" / f"step_{DEFECT:08d}", DEFECT).load_into(model, optimizer)
    batch = sm.make_sequence_batch(DEFECT, defect=True)
    torch.nn.functional.mse_loss(model(batch["x"], batch["lengths"]), batch["y"]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _first_nonfinite(t: torch.Tensor) -> list[int]:
    flat = (~torch.isfinite(t)).flatten().nonzero()
    return [int(i) for i in torch.unravel_index(flat[0, 0], t.shape)]


def test_lstm_replay_names_step_weight_coordinate_operation_and_sample(recorded):
    run = recorded["lstm"]
    before = tree_digest(run)
    result = run_cli("replay", run, "--json", "-")
    assert result.code == 1, result.stderr  # 1: an origin was found
    r = result.json()
    grads = _grads_at_defect(run, packed=False)
    assert r["verdict"] == "nonfinite" and r["responsible_step"] == DEFECT
    assert r["logged_first_nonfinite_loss_step"] == DEFECT + 1 and r["reproduced"] is True
    origin = r["origin"]
    assert origin["stage"] == "grad" and origin["tensor"] in [n for n in grads if n.startswith("rnn.")]
    # the coordinate is the first non-finite one of that gradient, as plain PyTorch computes it from the checkpoint
    assert origin["index"] == _first_nonfinite(grads[origin["tensor"]]) and origin["value"] == "nan"
    assert origin["tensors_nonfinite"] == sum(not bool(torch.isfinite(g).all()) for g in grads.values())
    assert not torch.isfinite(grads["rnn.weight_ih_l0"]).all() and torch.isfinite(grads["head.weight"]).all()
    site = r["operation"]["site"]
    assert site["op"] == "aten::div.Tensor" and site["phase"] == "forward"
    assert site["source"].endswith(f"sequence_models.py:{_line_of('total / n')}" + " in forward")
    assert r["operation"]["nan_node"] == "DivBackward0"
    assert r["samples"]["samples"] == [sm.EMPTY_SAMPLE]
    assert r["samples"]["sample_leaves"]["batch['ids']"] == [f"seq{DEFECT:05d}-{sm.EMPTY_SAMPLE:02d}"]
    assert r["setup"]["compiled"] is None and not any("torch.compile" in f for f in r["findings"])
    assert tree_digest(run) == before


def _line_of(text: str) -> int:
    lines = Path(sm.__file__).read_text().splitlines()
    [n] = [i + 1 for i, line in enumerate(lines) if text in line and "where" in line]
    return n


@pytest.fixture(scope="module")
def packed_report(recorded):
    return replay_run(recorded["lstm_packed"], ReplayOptions(device="cpu"))


def test_packed_lstm_replay_names_step_weight_coordinate_and_sample(packed_report, recorded):
    r = packed_report
    grads = _grads_at_defect(recorded["lstm_packed"])
    assert r.verdict == "nonfinite" and r.responsible_step == DEFECT and r.reproduced
    assert r.origin.stage == "grad" and r.origin.tensor.startswith("rnn.")
    assert r.origin.index == _first_nonfinite(grads[r.origin.tensor])
    assert r.samples.samples == [sm.EMPTY_SAMPLE]


def test_packed_lstm_replay_names_the_operation(packed_report):
    """Packing's backward copies each time step's gradient into a slice of a buffer that already holds the whole
    sequence's NaN (autograd's CopySlices): the record of that NaN outlives the finite slices written over it, so the
    trace reaches the division the unpacked run names."""
    op = packed_report.operation
    assert (op.site.op, op.site.phase, op.nan_node) == ("aten::div.Tensor", "forward", "DivBackward0")
    assert op.site.source.endswith(f"sequence_models.py:{_line_of('total / n')} in forward")


class _Patched(torch.nn.Module):
    """log of the readings, then ``write`` over columns [a, b) of the result in place: the -inf of a zero reading
    outside them stays in the storage the partial write touched."""

    def __init__(self, a: int, b: int, write: str) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(4))
        self.a, self.b, self.write = a, b, write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.log(self.gain * x)
        part = h[:, self.a:self.b]
        with torch.no_grad():
            {"fill": lambda: part.fill_(0.5), "copy": lambda: part.copy_(torch.ones_like(part)),
             "mul": lambda: part.mul_(2.0)}[self.write]()
        return h


@pytest.mark.parametrize("write", ["fill", "copy", "mul"])
def test_a_write_into_part_of_a_storage_keeps_the_record_of_the_rest(write: str) -> None:
    """Every zero column and every slice written: a -inf the write leaves (outside the slice, or doubled inside it) is
    traced to the log that made it; one a fill or a copy overwrote is gone, and nothing is traced."""
    for zero in range(4):
        for a in range(4):
            for b in range(a + 1, 5):
                model = _Patched(a, b, write)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                x = torch.ones(2, 4)
                x[1, zero] = 0.0

                def step() -> torch.Tensor:
                    return model(x).sum()

                op = trace_step(model, optimizer, step, Event(0, "forward", "<root>", [1, zero], "-inf"))
                if write == "mul" or not a <= zero < b:  # the -inf is left, or doubled where it was
                    assert op is not None and (op.site.op, op.output_index) == ("aten::log.default", [1, zero]), (
                        zero, a, b)
                else:
                    assert op is None, (zero, a, b)


# -- a module's nested output: every leaf checked, named by its place -------------------------------------------

_KEY = st.text(string.ascii_lowercase, min_size=1, max_size=3)
_STRUCT = st.recursive(st.just("leaf"), lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=3).map(tuple), st.lists(inner, min_size=1, max_size=3),
    st.dictionaries(_KEY, inner, min_size=1, max_size=3)), max_leaves=8)


def _build(shape, places: list[str], place: str = ""):
    """Tensors in ``shape``'s structure, and each leaf's place written as ``output[1]['k']`` would index it."""
    if shape == "leaf":
        places.append(place)
        return torch.ones(2)
    if isinstance(shape, dict):
        return {k: _build(v, places, f"{place}[{k!r}]") for k, v in sorted(shape.items())}
    return type(shape)(_build(v, places, f"{place}[{i}]") for i, v in enumerate(shape))


class _Emit(torch.nn.Module):
    def __init__(self, output) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.output = output

    def forward(self):
        return self.output


def _forward_events(model: torch.nn.Module, run) -> list:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with StepMonitor(model, optimizer) as monitor:
        monitor.begin(0, None, locate=True)
        run()
        return [e for e in monitor.end(0.0) if e.stage == "forward"]


@settings(max_examples=40, deadline=None)
@given(shape=_STRUCT, data=st.data())
def test_a_nonfinite_leaf_of_any_nested_output_is_named_by_its_place(shape, data):
    places: list[str] = []
    output = _build(shape, places)
    k = data.draw(st.integers(0, len(places) - 1))
    leaves = torch.utils._pytree.tree_leaves(output)
    leaves[k][1] = math.inf
    module = torch.nn.Sequential()
    module.add_module("block", _Emit(output))
    [event] = _forward_events(module, lambda: module.block())
    assert event.tensor == ("block" if k == 0 else f"block{places[k]}") and event.index == [1]


class _Pair:
    """An output type registered with pytree without names for its children (no flatten_with_keys_fn)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


torch.utils._pytree.register_pytree_node(_Pair, lambda p: ([p.a, p.b], None), lambda xs, _: _Pair(*xs))


def test_an_output_type_pytree_cannot_name_the_children_of_is_checked_by_leaf_number():
    module = torch.nn.Sequential()
    module.add_module("block", _Emit(_Pair(torch.ones(2), torch.tensor([1.0, math.nan]))))
    [event] = _forward_events(module, lambda: module.block())
    assert event.tensor == "block[1]" and event.index == [1]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("state", [0, 1])
def test_lstm_states_are_named_the_same_whether_the_output_is_packed(packed, state):
    """h_n is ``rnn[1][0]`` and c_n ``rnn[1][1]`` beside a padded tensor or a PackedSequence (of four leaves: data,
    batch_sizes and two index tensors), never a leaf number (``rnn[4]``, ``rnn[5]``)."""
    torch.manual_seed(0)
    model = sm.SequenceRegressor()
    x, lengths = torch.randn(4, sm.SEQ, sm.FEATURES), torch.tensor([6, 2, 4, 3])

    def run():
        with torch.no_grad():
            return model.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False) if packed else x)

    def poison(module, args, out) -> None:  # returns None: a hook's value would replace the output
        out[1][state].view(-1)[3] = math.nan
    model.rnn.register_forward_hook(poison)  # runs before the monitor's hooks: hooks run in registration order
    [event] = _forward_events(model, run)
    assert event.tensor == f"rnn[1][{state}]" and event.index == [0, 0, 3] and event.tensors_nonfinite == 1


# -- compiled -------------------------------------------------------------------------------------------------

def test_compiled_run_is_recorded_under_the_module_it_compiled(recorded):
    run = recorded["compiled"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["compiled"] == {"backend": "aot_eager"}
    meta = json.loads((run / "checkpoints" / "step_00000000" / "meta.json").read_text())
    assert meta["param_groups"][0]["params"] == [n for n, _ in scenarios.build_model().named_parameters()]
    # the recorder leaves the loop's model compiled; replay's rebuilt one runs eagerly
    model = sm.build_compiled_model()
    assert compiled_backend(model) == "aot_eager" and compiled_backend(eager(model)) is None


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_module_compiled_in_place_names_its_backend_and_replays_eagerly(backend):
    model = scenarios.build_model()
    model.compile(backend=backend)  # compiles lazily, at the first call: nothing is compiled here
    assert compiled_backend(model) == backend
    assert eager(model) is model and compiled_backend(model) is None
    assert compiled_backend(torch.compile(scenarios.build_model(), backend=backend)) == backend


def test_compiled_replay_runs_eagerly_and_names_the_origin(recorded):
    run = recorded["compiled"]
    result = run_cli("replay", run, "--json", "-")
    assert result.code == 1, result.stderr
    r = result.json()
    assert r["verdict"] == "nonfinite" and r["responsible_step"] == DEFECT and r["reproduced"] is True
    assert r["origin"]["tensor"] == "features.gain" and r["origin"]["index"] == [scenarios.DEFECT_FEATURE]
    assert r["operation"]["site"]["module"] == "features"
    assert r["samples"]["samples"] == [scenarios.DEFECT_SAMPLE]
    assert r["setup"]["compiled"] == "aot_eager"
    compared = [c for c in r["checkpoints_compared"] if c["error"] is None]
    assert compared and all(c["exact"] and c["tolerance"] == 0 for c in compared)
    [sentence] = [f for f in r["findings"] if "torch.compile" in f]
    assert "backend aot_eager" in sentence and "eagerly" in sentence and "compared bit for bit" in sentence
    assert f"it is bit-exact at step {compared[-1]['step']}" in sentence


def test_a_run_compiled_with_generated_kernels_is_compared_within_a_tolerance(recorded, tmp_path):
    """The manifest says inductor (its compile takes minutes on two cores): the eager replay's state is compared within
    a tolerance, the finding says why, and no CPU is blamed for it."""
    run = tmp_path / "inductor"
    shutil.copytree(recorded["compiled"], run)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "compiled": {"backend": "inductor"}}))
    r = replay_run(run, ReplayOptions(device="cpu", explain=False))
    assert r.setup.compiled == "inductor" and r.responsible_step == DEFECT
    compared = [c for c in r.checkpoints_compared if c.error is None]
    assert compared and all(c.tolerance > 0 for c in compared)
    [sentence] = [f for f in r.findings if "torch.compile" in f]
    assert "generates kernels of its own" in sentence and f"rtol {compared[-1].tolerance:g}" in sentence
    assert not any(f.startswith("Recorded on") for f in r.findings)


def _as_recorded_before_unwrapping(run: Path) -> None:
    """Rewrite a compiled run as the recorder wrote one before it named a compiled model's tensors by the module it
    compiled: every name under ``_orig_mod.``, and no ``compiled`` in the manifest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["compiled"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    for folder in (run / "checkpoints").iterdir():
        for name in ("model.safetensors", "optimizer.safetensors"):
            with safe_open(folder / name, "pt") as f:
                tensors, metadata = {f"_orig_mod.{k}": f.get_tensor(k) for k in f.keys()}, f.metadata()
            save_file(tensors, folder / name, metadata=metadata)
        meta = json.loads((folder / "meta.json").read_text())
        for key in ("param_names", "buffer_names"):
            meta[key] = [f"_orig_mod.{n}" for n in meta[key]]
        for group in meta["param_groups"]:
            group["params"] = [f"_orig_mod.{n}" for n in group["params"]]
        (folder / "meta.json").write_text(json.dumps(meta))


def test_a_compiled_run_whose_checkpoints_carry_the_wrapper_prefix_replays(recorded, tmp_path):
    run = tmp_path / "prefixed"
    shutil.copytree(recorded["compiled"], run)
    _as_recorded_before_unwrapping(run)
    r = replay_run(run, ReplayOptions(device="cpu", explain=False))
    assert r.responsible_step == DEFECT and r.reproduced and r.setup.compiled is None
    assert r.origin.tensor == "features.gain" and r.origin.index == [scenarios.DEFECT_FEATURE]
    compared = [c for c in r.checkpoints_compared if c.error is None]
    assert compared and all(c.exact for c in compared)
