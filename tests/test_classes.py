"""Issue 31's classes, each closed at one place and tested on real recorded runs on both sides:

- the reader touching a torch.func-wrapped tensor (finite.py reads the plain tensor under the wrappers, transforms
  set aside): DP-SGD's per-sample gradients replay, and an enumeration of transforms reads as the real tensor does;
- a tensor read by its strided assumption (finite.stored reads a sparse one by its coalesced values): SparseAdam's
  recommender replays, and generated sparse tensors read exactly as their dense twins;
- which leaves of a batch are the samples' rows (rootcause/samples.py's rule): per-batch tensors kept whole, the one
  behind a batch-wide failure named, not one where the rows fail; an enumeration of batch shapes, ambiguous ones too;
- the clipping finding tied to its evidence (rootcause/findings.py): said where the gradients optimizer.step() saw
  hold more non-finite values and more NaN than backward left after the step function rewrote them, not otherwise.
"""

from __future__ import annotations

import functools
import itertools
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics import finite
from nanforensics.replay.monitor import StepMonitor
from nanforensics.rootcause.samples import batch_size, select, whole_leaves
from torch.func import functionalize, grad, jacrev, jvp, vmap

import class_models as cm
import scenarios
from conftest import run_cli


def _replay(run: Path, *args: str) -> dict[str, Any]:
    result = run_cli("replay", run, "--json", "-", *args)
    assert result.code == 1, (result.code, result.stderr)
    return result.json()


def _events(report: dict[str, Any], step: int) -> dict[str, dict[str, Any]]:
    return {e["stage"]: e for e in report["events"] if e["step"] == step and e["state_key"] is None}


# -- torch.func: the monitor under vmap(grad(...)) -----------------------------------------------------------------

def test_per_sample_gradients_through_torch_func_replay_to_the_sample(tmp_path: Path) -> None:
    """DP-SGD: the model's forward hooks run on vmap's batched tensors; the report locates the -inf log made, with
    the sample's position leading the coordinate, the op, and the sample, where replay stopped at its first step."""
    run = cm.record(tmp_path / "run", cm.build_log_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.01),
                    cm.train_step_dpsgd, cm.dpsgd_batch)
    r = _replay(run)
    o = r["origin"]
    assert (r["responsible_step"], o["stage"], o["tensor"], o["index"][0], o["value"]) == (
        cm.DEFECT_STEP, "forward", "fc1", cm.BAD_SAMPLE, "inf")
    site = r["operation"]["site"]
    assert (site["op"], site["phase"], r["operation"]["output_index"]) == (
        "aten::log.default", "forward", [cm.BAD_SAMPLE, 0, cm.BAD_FEATURE])
    assert (r["samples"]["status"], r["samples"]["samples"]) == ("attributed", [cm.BAD_SAMPLE])
    assert _events(r, cm.DEFECT_STEP)["optimizer_grad"]["value"] == "nan"  # the per-sample clip, as p.grad


@pytest.mark.parametrize("defer", [False, True], ids=["read at once", "kept on the device"])
def test_the_monitor_checks_a_step_under_vmap_in_both_modes(defer: bool) -> None:
    """Detect mode's two paths: verdicts read at once, and (as on an accelerator) min/max pairs kept until the step
    ends, computed inside the transforms and read after they returned; a clean step flags nothing."""
    for step in (cm.DEFECT_STEP - 1, cm.DEFECT_STEP):
        model = cm.build_log_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batch = cm.dpsgd_batch(step)
        with StepMonitor(model, optimizer, defer=defer) as monitor:
            monitor.begin(step, batch, locate=False)
            events = monitor.end(cm.train_step_dpsgd(model, optimizer, batch))
        flagged = [(e.stage, e.tensor) for e in events]
        assert flagged == ([] if step != cm.DEFECT_STEP else
                           [("forward", "fc1"), ("optimizer_grad", "fc1.weight"), ("param", "fc1.weight")]), flagged


def _log_at(x: torch.Tensor, seen: list[tuple[Any, ...]]) -> torch.Tensor:
    """log(x), read by the reader inside whatever transforms run it."""
    y = torch.log(x)
    where = finite.locate(y)
    seen.append((finite.is_finite(y), where and (where.index, where.value), finite.count_nonfinite(y),
                 finite.count_nan(y), finite.extremes(y).tolist()))
    return y.sum()


# (name, transform of a function of x, x's shape, where the sample's dims put the zero of x in the reader's coordinate)
TRANSFORMS: list[tuple[str, Callable[[Callable[..., Any]], Callable[..., Any]], tuple[int, ...],
                       Callable[[tuple[int, ...]], list[int]]]] = [
    ("plain", lambda f: f, (3, 4), list),
    ("vmap", vmap, (3, 4), list),
    ("vmap in_dims=1", lambda f: vmap(f, in_dims=1), (3, 4), lambda i: [i[1], i[0]]),
    ("vmap of vmap", lambda f: vmap(vmap(f)), (2, 3, 4), list),
    ("grad", grad, (3, 4), list),
    ("vmap of grad", lambda f: vmap(grad(f)), (3, 4), list),
    ("jacrev", jacrev, (3, 4), list),
    ("jvp", lambda f: lambda x: jvp(f, (x,), (torch.ones_like(x),)), (3, 4), list),
    ("functionalize", functionalize, (3, 4), list),
]


@pytest.mark.parametrize("name, transform, shape, coordinate", TRANSFORMS, ids=[t[0] for t in TRANSFORMS])
def test_the_reader_inside_a_transform_reads_what_the_real_tensor_holds(name: str, transform: Any, shape: tuple[int, ...],
                                                                         coordinate: Any) -> None:
    """Every zero position of x, under each transform: the reader, called inside it (where .item() on a wrapper
    raises), gives the verdict, count, extremes and coordinate of log(x) read outside on the real tensor, the
    samples' positions leading the coordinate; with no zero, finite (the side where nothing is wrong)."""
    for zero in [None, *itertools.product(*map(range, shape))]:
        x = torch.arange(1.0, 1.0 + math.prod(shape)).reshape(shape)
        if zero is not None:
            x[zero] = 0.0
        seen: list[tuple[Any, ...]] = []
        transform(functools.partial(_log_at, seen=seen))(x)
        real = torch.log(x)
        assert seen[0][0] is (zero is None), (name, zero)
        assert seen[0][2:] == ((0 if zero is None else 1), 0, [real.min().item(), real.max().item()]), (name, zero)
        assert seen[0][1] == (None if zero is None else (coordinate(zero), "-inf")), (name, zero)


# -- sparse gradients: SparseAdam ---------------------------------------------------------------------------------

def test_sparse_embedding_gradients_replay_with_dense_coordinates(tmp_path: Path) -> None:
    """A recommender with nn.Embedding(sparse=True) and SparseAdam, where the precursor probe called aminmax on a
    sparse gradient: the origin is the bad user's row, in the embedding's dense coordinates, traced to log's
    backward, and the sample is named; the clip what-if clips sparse gradients too."""
    run = cm.record(tmp_path / "run", cm.build_recommender, cm.sparse_adam, cm.train_step_recommend, cm.rating_batch)
    user = int(cm.rating_batch(cm.DEFECT_STEP)["user"][cm.BAD_USER_SAMPLE])
    r = _replay(run, "--what-if", "clip=1.0")  # clip_grad_norm_ itself refuses sparse gradients
    o = r["origin"]
    assert (r["responsible_step"], o["stage"], o["tensor"], o["index"][0], o["value"]) == (
        cm.DEFECT_STEP, "grad", "users.weight", user, "-inf")
    assert (r["operation"]["site"]["op"], r["operation"]["site"]["phase"]) == ("aten::div.Tensor", "backward")
    assert (r["samples"]["status"], r["samples"]["samples"]) == ("attributed", [cm.BAD_USER_SAMPLE])
    assert all(p["grad_norm"] is not None for p in r["precursors"] if p["step"] < cm.DEFECT_STEP)
    clip = next(w for w in r["what_if"] if w["intervention"] == "clip=1.0")
    assert "clipping made 8 infinite gradient values NaN" in clip["detail"], clip  # the user's row of 8


@st.composite
def sparse_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense tensor with some NaN and ±inf values and zeros, and the same values held sparse: COO with a sparse
    dimension count of its own (hybrid: dense rows), uncoalesced with duplicate entries out of order, or CSR; real or
    complex."""
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    n = math.prod(shape)
    values = draw(st.lists(st.sampled_from([0.0, 0.0, 1.5, -2.0, 3e38, math.nan, math.inf, -math.inf]),
                           min_size=n, max_size=n))
    dense = torch.tensor(values, dtype=torch.float32).reshape(shape)
    if draw(st.booleans()):
        dense = torch.complex(dense, torch.flip(dense, [0]))
    # duplicates of real values only: torch sums a complex NaN's parts unevenly (index_add: nan+0j + 0 = nan+nanj)
    layout = draw(st.sampled_from(["coo"] if dense.is_complex() else ["coo", "duplicates", "csr"] if dense.ndim == 2
                                  else ["coo", "duplicates"]))
    if layout == "csr":
        return dense, dense.to_sparse_csr()
    coo = dense.to_sparse(draw(st.integers(1, dense.ndim)))
    if layout == "duplicates" and coo._nnz():  # the entries in reverse order, each again as a 0: uncoalesced
        indices, held = coo._indices(), coo._values()
        coo = torch.sparse_coo_tensor(torch.cat([indices.flip(1), indices], 1),
                                      torch.cat([held.flip(0), torch.zeros_like(held)]), coo.shape)
        assert not coo.is_coalesced()
    return dense, coo


@settings(max_examples=150, deadline=None)
@given(sparse_pairs())
def test_a_sparse_tensor_reads_as_its_dense_twin(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    dense, sparse = pair
    for read in (finite.is_finite, finite.count_nonfinite, finite.count_nan, finite.max_abs, finite.locate):
        assert read(sparse) == read(dense), read.__name__
    assert torch.equal(finite.extremes(sparse), finite.extremes(dense)) or (
        finite.extremes(sparse).isnan().any() and finite.extremes(dense).isnan().any())


# -- per-batch tensors beside per-sample rows ------------------------------------------------------------------

@pytest.fixture(scope="module")
def weighted_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weighted")
    return {d: cm.record(root / d, cm.build_classifier, cm.adam, cm.train_step_weighted,
                         functools.partial(cm.class_batch, defect=d)) for d in ("weights", "rows")}


WHOLE = ["batch['label_mask']", "batch['class_weight']"]


def test_a_per_batch_tensor_behind_a_batch_wide_failure_is_named(weighted_runs: dict[str, Path]) -> None:
    """Class weights all 0: every sample fails, the batch is split along its rows with the mask and weights kept
    whole (it was "unsplittable"), and the weights, not the state, are named: with the step before's the batch
    passes, with the step before's mask it does not."""
    r = _replay(weighted_runs["weights"])
    s = r["samples"]
    assert (s["status"], s["batch_size"], s["whole_leaves"], s["cause_leaves"]) == (
        "batch_wide", cm.BATCH, WHOLE, ["batch['class_weight']"])
    assert any("through its per-batch tensor batch['class_weight']" in f for f in r["findings"]), r["findings"]
    assert not any("not its data, is responsible" in f for f in r["findings"])
    shown = run_cli("replay", weighted_runs["weights"], columns=200)
    assert "batch-wide: most samples fail alone, through per-batch batch['class_weight']" in shown.stdout, shown.stdout


def test_rows_that_fail_together_name_no_per_batch_tensor(weighted_runs: dict[str, Path]) -> None:
    """A feature missing in every row: batch-wide too, but swapping the per-batch tensors rescues nothing, so none is
    named and the batch is called bad data."""
    r = _replay(weighted_runs["rows"], "--no-explain")
    assert r["samples"] is None  # --no-explain: no attribution
    r = _replay(weighted_runs["rows"])
    s = r["samples"]
    assert (s["status"], s["whole_leaves"], s["cause_leaves"]) == ("batch_wide", WHOLE, [])
    assert any("the batch as a whole is bad data" in f for f in r["findings"]), r["findings"]
    assert not any("through its per-batch" in f for f in r["findings"])


@pytest.mark.parametrize("step_fn", [cm.train_step_weighted, cm.train_step_weighted_named], ids=["split", "named"])
def test_per_batch_tensors_as_long_as_the_batch(tmp_path: Path, step_fn: Any) -> None:
    """As many classes as samples: the mask and the weights are split like rows by the rule, the step function
    raises on every subset, and the report says why and how to name them; named whole, the weights are found."""
    run = cm.record(tmp_path / "run", cm.build_classifier, cm.adam, step_fn,
                    functools.partial(cm.class_batch, defect="weights", classes=cm.BATCH),
                    model_kwargs={"classes": cm.BATCH})
    s = _replay(run)["samples"]
    if step_fn is cm.train_step_weighted:
        assert (s["status"], s["whole_leaves"], s["cause_leaves"]) == ("coupled", [], [])
        assert "unless train_step.nanforensics_whole names it" in s["message"], s["message"]
    else:
        assert (s["status"], s["whole_leaves"], s["cause_leaves"]) == ("batch_wide", WHOLE, ["batch['class_weight']"])


def _batch(rows: int, per_batch: list[int], ids: bool, extra_rows: int = 1) -> dict[str, Any]:
    """``rows`` samples in ``extra_rows`` tensors (and labels), per-batch tensors of the lengths ``per_batch``."""
    b: dict[str, Any] = {f"x{k}": torch.arange(rows * 2.0).reshape(rows, 2) + k for k in range(extra_rows)}
    b.update({f"w{k}": torch.arange(float(n)) for k, n in enumerate(per_batch)})
    b["scale"] = torch.tensor(2.0)
    if ids:
        b["ids"] = [f"s{i}" for i in range(rows)]
    return b


@pytest.mark.parametrize("rows, extra_rows, per_batch, ids", list(itertools.product(
    (2, 5), (1, 2), ([], [3], [3, 7], [3, 3]), (False, True))))
def test_the_rows_rule_on_generated_batches(rows: int, extra_rows: int, per_batch: list[int], ids: bool) -> None:
    """The batch size is the first dimension most tensors share; a tie is broken by the ids, else there is none.
    Split, every tensor of that dimension is indexed and every other leaf kept as it was."""
    b = _batch(rows, per_batch, ids, extra_rows)
    sizes = [rows] * extra_rows + per_batch
    most = max(sizes.count(n) for n in sizes)
    tied = {n for n in sizes if sizes.count(n) == most}
    expected = rows if tied == {rows} or (ids and rows in tied) else (tied.pop() if len(tied) == 1 else None)
    assert batch_size(b) == expected
    if expected != rows:
        return
    assert whole_leaves(b, rows) == [f"batch['w{k}']" for k in range(len(per_batch))]
    part = select(b, [rows - 1], rows)
    for k in range(extra_rows):
        assert torch.equal(part[f"x{k}"], b[f"x{k}"][-1:])
    assert all(part[f"w{k}"] is b[f"w{k}"] for k in range(len(per_batch))) and part["scale"] is b["scale"]
    assert part.get("ids") == (b["ids"][-1:] if ids else None)


def test_a_per_batch_tensor_as_long_as_the_batch_is_split_unless_named_whole() -> None:
    """The ambiguous case: class weights of as many entries as the batch has samples cannot be told from rows by
    their shape. The rule splits them; ``nanforensics_whole`` (the path) keeps them whole, and then does not count
    them towards the batch size either."""
    b = _batch(4, [4], ids=False)
    assert batch_size(b) == 4 and whole_leaves(b, 4) == []
    assert torch.equal(select(b, [1], 4)["w0"], torch.tensor([1.0]))
    named = ["batch['w0']"]
    assert batch_size(b, named) == 4 and whole_leaves(b, 4, named) == named
    assert select(b, [1], 4, named)["w0"] is b["w0"]
    micro = {"micro_batches": [_batch(4, [4], ids=False), _batch(3, [4], ids=False)]}
    assert batch_size(micro) is None  # the second micro-batch: a tie between 3 and 4, no ids
    assert batch_size(micro, ["batch['micro_batches'][0]['w0']", "batch['micro_batches'][1]['w0']"]) == 7


# -- the clipping finding, tied to its evidence ---------------------------------------------------------------

SPREAD = "Clipping spread it"


@pytest.mark.parametrize("step_fn, said", [(cm.train_step_poisson_clipped, True), (scenarios.train_step_poisson, False)],
                         ids=["clipped", "not clipped"])
def test_the_clipping_finding_is_said_where_its_evidence_is(tmp_path: Path, step_fn: Any, said: bool) -> None:
    """A Poisson regression whose backward leaves one -inf and one NaN gradient value: clip_grad_norm_'s factor is
    max_norm/NaN, and optimizer.step() sees every gradient NaN. The finding is said with its counts; the same run
    without the clip (backward's values reach optimizer.step() unchanged) gets the counterfactual instead."""
    run = cm.record(tmp_path / "run", cm.build_poisson, cm.adam, step_fn, cm.count_batch, steps=cm.DEFECT_STEP + 2)
    r = _replay(run, "--no-explain")
    at = _events(r, cm.DEFECT_STEP)
    assert (r["origin"]["stage"], at["grad"]["value"], at["grad"]["elements_nonfinite"], at["grad"]["nan_elements"]) == (
        "grad", "-inf", 2, 1)
    spread = [f for f in r["findings"] if f.startswith(SPREAD)]
    if said:
        total = sum(p.numel() for p in cm.build_poisson().parameters())
        assert (at["optimizer_grad"]["elements_nonfinite"], at["optimizer_grad"]["nan_elements"]) == (total, total)
        assert at["optimizer_grad"]["rewritten"] == len(list(cm.build_poisson().parameters()))
        assert spread == [f"{SPREAD}: backward left 2 non-finite gradient values (1 NaN) in 1 tensor; the step function "
                          f"then rewrote 7 gradient tensors before optimizer.step(), which saw {total:,} non-finite "
                          f"values ({total:,} NaN) in 7 tensors. A total-norm clip (clip_grad_norm_) scales every "
                          "gradient by one factor, max_norm/total norm: a NaN gradient makes the total norm NaN, and so "
                          "the factor max_norm/NaN, and every gradient it scaled became NaN."]
    else:
        assert (at["optimizer_grad"]["elements_nonfinite"], at["optimizer_grad"]["rewritten"]) == (2, 0)
        assert spread == [] and not any("turned the" in f for f in r["findings"])
        assert any(f.startswith("Gradient clipping would not have rescued this: the total gradient norm is NaN")
                   for f in r["findings"]), r["findings"]
