"""The replay's verdict from what it met: an origin (nonfinite), a logged NaN it did not meet (not_reproduced), a
non-finite loss alone (loss_only), nothing (clean); and the facts the report states beside it: the responsible step
and batch, the first non-finite replayed loss, the step every parameter is non-finite by, whether the replay is judged
reproduced at all. Enumerated over every combination of a few steps' outcomes on the committed sample run (read, never
written): a replay reaches only some of them, and none of these tests replays a step."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from nanforensics.replay.engine import _expected_stop, _horizon, _report
from nanforensics.report import BatchRef, CheckpointComparison, Event, StepRecord, TensorMismatch
from nanforensics.runs.batches import encoded, snapshot
from nanforensics.runs.cpu import this_cpu
from nanforensics.runs.files import write_bytes_atomic
from nanforensics.runs.run import Run

from conftest import ROOT

NAN = math.nan
CLEAN_RUN = ROOT / "sample_runs" / "clean"  # 40 steps, checkpoints every 10, recorded on a CPU
DDP_RUN = ROOT / "sample_runs" / "ddp_two_ranks"


@dataclass
class Code:
    """The user's side as _report reads it: the import strings it names in the setup (nothing is imported here)."""

    imported: list[str] = field(default_factory=lambda: ["code.regressor:step"])


@pytest.fixture(scope="module")
def run() -> Run:
    return Run(CLEAN_RUN)


def spread(steps: range, logged: dict[int, float | None] | None = None, replayed: dict[int, float] | None = None,
           params: dict[int, int] | None = None) -> list[StepRecord]:
    """Finite, equal losses logged and replayed over ``steps`` unless the maps say otherwise; 10 parameter values."""
    logged, replayed, params = logged or {}, replayed or {}, params or {}
    return [StepRecord(n, logged.get(n, 2.0), replayed.get(n, 2.0), params.get(n, 0), 10, 0, 20,
                       loss_ulps=0 if logged.get(n, 2.0) == replayed.get(n, 2.0) else None) for n in steps]


def event(n: int, stage: str = "grad") -> Event:
    return Event(n, stage, "fc.weight", [0, 1], "nan", elements_nonfinite=1, tensors_nonfinite=1, dtype="float32")


def report(run: Run, events=(), records=(), caught=(), logged_nan=(), loss_only=(), compared=(), device="cpu",
           rtol: float = 0.0, **options):
    logged_first = min(logged_nan, default=None)
    return _report(run, run.checkpoints()[1], torch.device(device), 1, Code(), list(events), list(records), logged_first,
                   rtol, caught, logged_nan=list(logged_nan), loss_only=list(loss_only), compared=list(compared), **options)


def subsets(items):
    return [c for k in range(len(items) + 1) for c in itertools.combinations(items, k)]


@pytest.mark.parametrize("origin", [False, True])
@pytest.mark.parametrize("diverged", [False, True])
def test_the_verdict_over_every_combination_of_logged_nans_caught_overflows_and_loss_only_steps(run, origin, diverged):
    """nonfinite with an origin; else not_reproduced where a logged NaN was not replayed as a caught overflow or a
    loss-only step, or the replay diverged; else loss_only where there was one; else clean."""
    for logged_nan, caught, loss_only in itertools.product(subsets((11, 13)), subsets((11, 13)), subsets((11, 13))):
        records = spread(range(10, 16), logged={n: NAN for n in logged_nan} | ({14: 3.0} if diverged else {}),
                         replayed={n: NAN for n in (*caught, *loss_only)})
        r = report(run, [event(12)] if origin else [], records, caught, logged_nan, loss_only)
        explained = set(logged_nan) <= {*caught, *loss_only}
        # a loss logged NaN and replayed finite, or the other way round, diverges there, as step 14's does
        parted = min(set(logged_nan) ^ {*caught, *loss_only} | ({14} if diverged else set()), default=None)
        expected = ("nonfinite" if origin else
                    "not_reproduced" if logged_nan and (parted is not None or not explained) else
                    "loss_only" if loss_only else "clean")
        assert r.verdict == expected, (logged_nan, caught, loss_only)
        assert r.responsible_step == (12 if origin else None)
        assert r.loss_only_steps == list(loss_only)
        assert r.diverged_at_step == parted
        assert r.reproduced is (parted is None)
        assert r.logged_first_nonfinite_loss_step == min(logged_nan, default=None)


def test_the_responsible_batch_is_the_origins_batch_of_a_single_process_run(run):
    r = report(run, [event(12), event(13, "param")], spread(range(10, 16)))
    assert r.origin == event(12) and r.events == [event(12), event(13, "param")]
    leaves = {"batch['ids']": [f"s00012-{i:02d}" for i in range(64)]}
    assert r.responsible_batch == BatchRef(12, str(CLEAN_RUN / "batches" / "step_00000012.safetensors"), leaves)
    assert report(run, [], spread(range(10, 16))).responsible_batch is None
    ddp = Run(DDP_RUN)  # a distributed run's batch is a shard, or every rank's: complete() names it, not _report
    assert report(ddp, [event(2)], spread(range(0, 4))).responsible_batch is None


def test_state_poisoned_exactly_when_an_event_is_optimizer_state(run):
    for stages in subsets(("grad", "optimizer_state", "param", "buffer")):
        r = report(run, [event(12, s) for s in stages], spread(range(10, 16)))
        assert r.state_poisoned is ("optimizer_state" in stages)


def test_the_first_replayed_nonfinite_loss_and_the_step_every_parameter_is_nonfinite_by(run):
    for nonfinite, full in itertools.product(subsets((11, 13, 14)), subsets((12, 14))):
        records = spread(range(10, 16), replayed={n: (NAN if n != 13 else -math.inf) for n in nonfinite},
                         params={n: 10 for n in full} | {10: 3})
        r = report(run, [event(11)], records)
        assert r.first_nonfinite_loss_step == min(nonfinite, default=None)
        assert r.fully_nonfinite_step == min(full, default=None)
    empty = spread(range(10, 16))
    for s in empty:
        s.params_total = 0  # no parameter at all: 0 of 0 is not "every parameter non-finite"
    assert report(run, [event(11)], empty).fully_nonfinite_step is None


def test_reproduced_is_judged_only_on_a_logged_loss_or_a_readable_checkpoint(run):
    unlogged = spread(range(10, 16), logged=dict.fromkeys(range(10, 16)))
    unreadable = CheckpointComparison(20, "checkpoints/step_20", 0, False, 0, None, error="not a zip file")
    matched = CheckpointComparison(20, "checkpoints/step_20", 12, True, 0, None, values=100)
    differs = CheckpointComparison(13, "checkpoints/step_13", 12, False, 1,
                                   TensorMismatch("fc.weight", "parameter", [0], "1", "2", 1, 9), values=100)
    assert report(run, records=unlogged).reproduced is None
    assert report(run, records=unlogged, compared=[unreadable]).reproduced is None
    assert report(run, records=unlogged, compared=[matched]).reproduced is True
    r = report(run, records=unlogged, compared=[differs])
    assert (r.reproduced, r.diverged_at_step, r.checkpoints_compared) == (False, 13, [differs])
    assert report(run, records=spread(range(10, 16), logged={12: None})).reproduced is True  # one logged loss is enough
    assert report(run).reproduced is None  # nothing replayed, nothing to judge


@pytest.mark.parametrize("ulps", subsets((None, 0, 3, 7)))
def test_the_largest_loss_difference_is_over_the_steps_that_have_one(run, ulps):
    records = spread(range(10, 10 + len(ulps)))
    for s, u in zip(records, ulps):
        s.loss_ulps = u
    assert report(run, records=records).loss_max_ulps == max((u for u in ulps if u is not None), default=None)


def test_the_setup_names_the_window_replayed_the_device_and_the_cpus(run):
    r = report(run, records=spread(range(10, 16)))
    s = r.setup
    assert (s.run, s.from_checkpoint, s.first_step, s.last_step, s.device, s.num_threads, s.imported) == \
        (str(CLEAN_RUN), 10, 10, 15, "cpu", 1, ["code.regressor:step"])
    assert (s.recorded_cpu, s.replay_cpu, s.compiled) == (run.cpu, this_cpu(), None)
    assert (r.findings, r.spread, r.schema) == ([], spread(range(10, 16)), type(r)(**{**vars(r)}).schema)
    s = report(run).setup  # nothing replayed: the window is the start checkpoint's step
    assert (s.first_step, s.last_step) == (10, 10)
    s = report(run, records=spread(range(11, 14))).setup  # else the steps replayed
    assert (s.from_checkpoint, s.first_step, s.last_step) == (10, 11, 13)
    s = report(run, records=spread(range(10, 12)), device="meta").setup  # not a CPU: no CPUs named
    assert (s.device, s.recorded_cpu, s.replay_cpu) == ("meta", None, None)


@pytest.mark.parametrize("logged_nan, last, after, stop", [
    ((), 30, 0, 30), ((), 30, 5, 30), ((12,), 30, 0, 13), ((12, 15), 30, 2, 15), ((12,), 13, 5, 13), ((29,), 30, 0, 30),
    ((28,), 30, 1, 30), ((28,), 30, 0, 29)])
def test_the_replay_is_expected_to_stop_after_the_step_after_the_first_logged_nan(logged_nan, last, after, stop):
    assert _expected_stop(list(logged_nan), last, after) == stop


def test_the_chain_is_complete_past_the_nan_loss_every_parameter_or_the_logged_nan_whichever_is_last():
    base = range(10, 20)
    for nan_loss, full, logged_nan in itertools.product((None, 11, 12, 14), (None, 12, 15), subsets((11, 12, 13, 16))):
        records = spread(base, replayed={n: NAN for n in base if nan_loss is not None and n >= nan_loss},
                         params={n: 10 for n in base if full is not None and n >= full})
        done = full if full is not None else max(nan_loss or 12, 12) + 1
        logged = next((s for s in logged_nan if s >= 12), done)
        assert _horizon([event(12), event(13, "param")], records, list(logged_nan)) == max(done, logged), \
            (nan_loss, full, logged_nan)


@pytest.mark.parametrize("max_ulps", [0, 2, 3, 8, 9])
def test_losses_part_where_they_differ_by_more_than_the_ulps_allowed(run, max_ulps):
    records = spread(range(10, 16))
    records[3].replayed_loss = float(np.nextafter(np.nextafter(np.nextafter(np.float32(2.0), np.float32(3)),
                                                                 np.float32(3)), np.float32(3)))  # 3 float32 ulps above
    r = report(run, records=records, max_ulps=max_ulps)
    assert (r.diverged_at_step, r.reproduced) == ((13, False) if max_ulps < 3 else (None, True))
    if max_ulps == 8:
        assert report(run, records=records).diverged_at_step is None  # 8, LOSS_ULPS, unless told otherwise


def test_the_batch_named_is_each_per_sample_leaf_and_the_backend_the_run_compiled_with(tmp_path):
    """A run (a copy of the sample run) whose step-12 batch holds per-sample ids a level down, trained compiled."""
    copy = shutil.copytree(CLEAN_RUN, tmp_path / "run")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "compiled": {"backend": "inductor"}}))
    original = Run(copy).batch(12)
    ids = [f"id-{i}" for i in range(64)]
    write_bytes_atomic(copy / "batches" / "step_00000012.safetensors",
                       encoded(12, *snapshot({"x": original["x"], "y": original["y"], "meta": {"ids": ids, "src": "a"}})))
    r = report(Run(copy), [event(12)], spread(range(10, 16)))
    assert r.responsible_batch == BatchRef(12, str(copy / "batches" / "step_00000012.safetensors"),
                                           {"batch['meta']['ids']": ids, "batch['meta']['src']": "a"})
    assert r.setup.compiled == "inductor"
