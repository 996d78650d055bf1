"""The guard's step, skip, stop and rollback, read exactly: real guarded steps of a two-layer model whose gradients,
losses and state the test sets itself, and what the guard did (stepped or not, what it restored, its counters, the
lines of ``guard.jsonl`` and the log, the incident's files), each fact checked on both of its sides. In-process and
fast: the mutants of ``runs/guard.py`` run against this file (docs/mutation.md)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from nanforensics import Recorder
from nanforensics.runs.batches import snapshot
from nanforensics.runs.guard import (
    GUARD_LOG,
    INCIDENTS,
    GuardPolicy,
    GuardStop,
    _link_or_copy,
    _nonfinite_samples,
    _said,
    ring_nbytes,
)
from torch import nn

from test_guard import one_thread  # noqa: F401 - its autouse fixture: these models are tiny

NAN, INF = math.nan, math.inf


def build() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model.register_buffer("seen", torch.zeros(2))
    return model


def step_fn(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> torch.Tensor:
    """What replay would run (never called here: the tests set the gradients themselves)."""
    optimizer.zero_grad()
    loss = model(batch["x"]).sum()
    loss.backward()
    optimizer.step()
    return loss


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def batch(step: int, bad_row: int | None = None, ids: list[str] | None = None) -> dict[str, Any]:
    x = torch.full((2, 2), float(step))
    if bad_row is not None:
        x[bad_row, 1] = NAN
    return {"x": x, "ids": ids if ids is not None else [f"a{step}", f"b{step}"]}


OPEN: list["Run"] = []


@pytest.fixture(autouse=True)
def closed():
    """Every recorder a test left open is closed after it: an open guard keeps watching ``backward()``."""
    yield
    while OPEN:
        OPEN.pop().rec.close()


class Run:
    """A guarded recorder over ``build()``'s model; ``step`` sets the gradients, calls ``optimizer.step()`` and logs."""

    def __init__(self, path: Path, make: Callable[[Any], torch.optim.Optimizer] = sgd, **options: Any) -> None:
        self.path = path
        self.model = build()
        self.optimizer = make(self.model.parameters())
        options.setdefault("guard", GuardPolicy(max_consecutive=10, max_skip_fraction=1.0))
        self.rec = Recorder(path, self.model, self.optimizer, model_factory=build, step_fn=step_fn, **options)
        self.guard = self.rec.guard
        self.next = 0
        OPEN.append(self)

    def grads(self, values: list[list[float] | None]) -> None:
        for p, v in zip(self.model.parameters(), values):
            p.grad = None if v is None else torch.tensor(v, dtype=p.dtype).reshape(p.shape)

    def step(self, values: list[list[float] | None] | None = None, loss: float = 1.0, b: dict | None = None,
             after: Callable[[], None] | None = None) -> Any:
        if values is not None:
            self.grads(values)
        out = self.optimizer.step()
        if after is not None:
            after()
        self.rec.log(self.next, b if b is not None else batch(self.next), loss)
        self.next += 1
        return out

    def events(self) -> list[dict]:
        return [json.loads(line) for line in (self.path / INCIDENTS / GUARD_LOG).read_text().splitlines()]

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


FINE = [[0.5, -0.5, 1.0, 2.0], [0.25, 0.5], [1.0, -1.0], [0.5]]  # 0.weight, 0.bias, 1.weight, 1.bias


def with_value(index: int, at: int, value: float, grads: list | None = None) -> list[list[float] | None]:
    out = [None if g is None else list(g) for g in (grads or FINE)]
    out[index][at] = value
    return out


def exact_sgd(before: list[torch.Tensor], grads: list, lr: float = 0.5) -> list[torch.Tensor]:
    return [p if g is None else p - lr * torch.tensor(g).reshape(p.shape) for p, g in zip(before, grads)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


class NotedSGD(torch.optim.SGD):
    """An optimizer whose step takes more than the closure, and returns what it did."""

    def step(self, closure: Any = None, note: str = "") -> Any:  # type: ignore[override]
        loss = super().step(closure)
        return ("stepped", note, loss)


class NotedAdamW(torch.optim.AdamW):
    def step(self, closure: Any = None, note: str = "") -> Any:  # type: ignore[override]
        loss = super().step(closure)
        return ("stepped", note, loss)


def noted_sgd(params: Any) -> torch.optim.Optimizer:
    return NotedSGD(params, lr=0.5)


def noted_adamw(params: Any) -> torch.optim.Optimizer:
    return NotedAdamW(params, lr=0.1, fused=True)


# ---- the step: stepped or skipped, and what the call returns ---------------------------------------------------------

def test_a_nonfinite_gradient_skips_the_step_and_each_record_says_so(tmp_path, caplog):
    """0.weight has no gradient: the first bad one is 1.bias's (named by its place among all the parameters, not among
    those with a gradient); everything stays as it was; the skip's line, the incident's files and the log line."""
    run = Run(tmp_path / "run", checkpoint_every=100)
    run.step(FINE)
    run.step(FINE)
    before, buffers = run.params(), [b.clone() for b in run.model.buffers()]
    grads = with_value(3, 0, INF, [None] + FINE[1:])
    with caplog.at_level(logging.INFO, logger="nanforensics"):
        run.step(grads, b=batch(2, bad_row=1))
    assert same(run.params(), before) and same([b for b in run.model.buffers()], buffers)
    assert (run.guard.skipped, run.guard.consecutive, run.guard.steps) == ([2], 1, 3)
    entry = {"event": "skip", "step": 2, "reason": "gradient", "ranks_nonfinite_grad": [0],
             "grad": {"tensor": "1.bias", "index": [0], "value": "inf", "rank": 0},
             "samples": {"batch['ids']": ["a2", "b2"]}, "nonfinite_inputs": {"batch['x']": [1]},
             "incident": "incidents/step_00000002"}
    assert run.events() == [entry]
    assert [r.getMessage() for r in caplog.records] == [
        "nanforensics guard: skipped step 2 (non-finite gradient 1.bias[0] = inf); incident incidents/step_00000002"]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    incident = tmp_path / "run" / INCIDENTS / "step_00000002"
    meta = json.loads((incident / "incident.json").read_text())
    assert meta == {"format": "nanforensics.incident/1", "kind": "skip", "step": 2, "from_checkpoint": 0,
                    **{k: v for k, v in entry.items() if k != "incident"}}
    assert sorted(str(p.relative_to(incident)) for p in incident.rglob("*")) == [
        "batches", *[f"batches/step_0000000{s}.safetensors" for s in range(3)], "checkpoints",
        "checkpoints/step_00000000", *[f"checkpoints/step_00000000/{f}" for f in
                                       ("meta.json", "model.safetensors", "optimizer.safetensors")],
        "incident.json", "manifest.json", "steps.jsonl"]
    assert [json.loads(line)["step"] for line in (incident / "steps.jsonl").read_text().splitlines()] == [0, 1, 2]
    manifest = json.loads((incident / "manifest.json").read_text())
    run_manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest == {**run_manifest, "start_step": 0, "keep_checkpoints": None}
    for f in ("model.safetensors", "optimizer.safetensors"):  # hard links: a checkpoint file is never changed in place
        assert (incident / "checkpoints" / "step_00000000" / f).stat().st_ino == \
            (tmp_path / "run" / "checkpoints" / "step_00000000" / f).stat().st_ino
    run.rec.flush()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000003"]  # after the skip
    assert run.guard.ring == []
    run.step(FINE)
    assert run.guard.consecutive == 0 and same(run.params(), exact_sgd(before, FINE))


def test_any_nonfinite_gradient_anywhere_skips_and_finite_ones_step(tmp_path):
    """NaN, inf and -inf in each parameter's gradient in turn: each step skipped and named; then a finite step."""
    run = Run(tmp_path / "run", guard=GuardPolicy(max_consecutive=20, max_skip_fraction=1.0))
    before = run.params()
    cases = [(where, value) for value in (NAN, INF, -INF) for where in range(4)]
    for where, value in cases:
        assert run.step(with_value(where, 0, value)) is None
        assert same(run.params(), before)
    assert run.guard.skipped == list(range(len(cases)))
    assert [e["grad"] for e in run.events()] == [
        {"tensor": ["0.weight", "0.bias", "1.weight", "1.bias"][where], "index": [0, 0] if where in (0, 2) else [0],
         "value": str(value).lower(), "rank": 0} for where, value in cases]
    run.step(FINE)
    assert same(run.params(), exact_sgd(before, FINE)) and run.guard.skipped == list(range(len(cases)))


def test_a_closure_runs_once_its_gradients_decide_and_its_loss_is_returned(tmp_path):
    """Lightning's way: ``optimizer.step(closure)``, positional or by name; the closure runs once, under grad even
    inside ``no_grad``; its loss comes back whether the step ran or was skipped."""
    run = Run(tmp_path / "run")
    calls = []

    def closure(grads: list) -> Callable[[], torch.Tensor]:
        def run_it() -> torch.Tensor:
            calls.append(torch.is_grad_enabled())
            run.grads(grads)
            return torch.tensor(float(len(calls)))
        return run_it

    calls_by = [lambda c: run.optimizer.step(c), lambda c: run.optimizer.step(closure=c)]
    for step, (by, grads) in enumerate((b, g) for b in calls_by for g in (FINE, with_value(1, 1, NAN))):
        before = run.params()
        with torch.no_grad():
            assert float(by(closure(grads))) == step + 1
        run.rec.log(step, batch(step), 1.0)
        assert calls == [True] * (step + 1)
        assert same(run.params(), before if grads is not FINE else exact_sgd(before, FINE)), step
    assert run.guard.skipped == [1, 3]


@pytest.mark.parametrize("make", [noted_sgd, noted_adamw], ids=["host", "device"])
def test_the_steps_own_arguments_and_return_value_pass_through_the_guard(tmp_path, make):
    """Whatever follows the closure reaches the optimizer's step in its own place (the closure's place once took the
    next argument: ``step(closure, x)`` called ``step(x)``), and its return value comes back: the closure's loss
    where there is one."""
    run = Run(tmp_path / "run", make=make)
    loss = torch.tensor(3.0)
    steps = [lambda: run.optimizer.step(None, "a"), lambda: run.optimizer.step(note="b"),
             lambda: run.optimizer.step(lambda: loss, "c"), lambda: run.optimizer.step()]
    got = []
    for call in steps:
        run.grads(FINE)
        got.append(call())
        run.rec.log(run.next, batch(run.next), 1.0)
        run.next += 1
    assert got == [("stepped", "a", None), ("stepped", "b", None), loss, ("stepped", "", None)]
    assert run.guard.skipped == []


def test_a_grad_scalers_step_returns_what_the_optimizer_did(tmp_path):
    model = build()
    optimizer = noted_adamw(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    rec = Recorder(tmp_path / "run", model, optimizer, model_factory=build, step_fn=step_fn, scaler=scaler, guard=True)
    OPEN.append(types.SimpleNamespace(rec=rec))
    scaler.scale(model(torch.ones(3, 2)).sum()).backward()
    assert scaler.step(optimizer, None, "scaled") == ("stepped", "scaled", None)
    scaler.update()
    scaler.scale(model(torch.ones(3, 2)).sum()).backward()
    assert scaler.step(optimizer, note="by name") == ("stepped", "by name", None)
    scaler.update()
    scaler.scale(model(torch.ones(3, 2)).sum()).backward()
    assert float(scaler.step(optimizer, lambda: torch.tensor(5.0))) == 5.0  # a closure by position: its loss


def test_two_optimizer_steps_in_one_logged_step_skip_if_either_would(tmp_path):
    """Each call steps or not on its own gradients; the logged step counts as skipped when either call was, and its
    record names what the skipped call saw (the fused path counted it so already; the host path once kept only the
    last call's verdict: the first call's skip went unrecorded)."""
    run = Run(tmp_path / "run", make=huge_sgd)
    bad_grad, bad_update = with_value(0, 2, NAN), with_value(3, 0, -1e38)
    for step, (first, second) in enumerate(((FINE, bad_grad), (bad_grad, FINE), (bad_update, FINE), (FINE, FINE))):
        with torch.no_grad():
            run.model[1].bias.fill_(3e38 if step == 2 else 0.0)
        before = run.params()
        run.grads(first)
        run.optimizer.step()
        run.step(second)
        stepped = [g for g in (first, second) if g is FINE]
        assert same(run.params(), exact_sgd(exact_sgd(before, FINE, 1.0), FINE, 1.0) if len(stepped) == 2 else
                    exact_sgd(before, FINE, 1.0)), step
    skips = [e for e in run.events() if e["event"] == "skip"]
    assert run.guard.skipped == [0, 1, 2] and [e["step"] for e in skips] == [0, 1, 2]
    assert [e["reason"] for e in skips] == ["gradient", "gradient", "update"]
    assert skips[0]["grad"] == skips[1]["grad"] == {"tensor": "0.weight", "index": [1, 0], "value": "nan", "rank": 0}
    assert skips[2]["update"] == {"tensor": "1.bias", "state": "param", "index": [0], "value": "inf"}


@pytest.mark.parametrize("make", [sgd, noted_sgd], ids=["proof", "gradients-only"])
def test_a_skip_whose_gradients_were_overwritten_in_place_is_still_recorded(tmp_path, caplog, make):
    """Two calls, the gradients the first (skipped) call saw zeroed in place and refilled before the second: the
    record can name no tensor, and says so (a non-finite gradient, no reason of its own)."""
    run = Run(tmp_path / "run", make=make)
    run.grads(with_value(0, 0, NAN))
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=False)
    with torch.no_grad():
        for p, g in zip(run.model.parameters(), FINE):
            p.grad.copy_(torch.tensor(g).reshape(p.shape))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanforensics"):
        run.step()
    skip = next(e for e in run.events() if e["event"] == "skip")
    assert (skip["reason"], skip["grad"], "loss" in skip, "update" in skip) == (None, None, False, False)
    assert caplog.records[0].getMessage() == ("nanforensics guard: skipped step 0 (a non-finite gradient); incident "
                                              "incidents/step_00000000")


def test_a_nonfinite_loss_skips_unless_the_policy_lets_it_through(tmp_path, caplog):
    """The loss each scalar ``backward()`` ran from since the last step; a backward with no step after it (an
    evaluation) is no step's loss."""
    for check in (True, False):
        run = Run(tmp_path / f"run{check}", guard=GuardPolicy(skip_nonfinite_loss=check))
        x = torch.ones(1, 2)
        (run.model(x).sum() * float("nan")).backward()  # an evaluation's NaN, no step after it
        run.rec.log(0, batch(0), 1.0)
        before = run.params()
        caplog.clear()
        run.optimizer.zero_grad()
        with caplog.at_level(logging.WARNING, logger="nanforensics"):
            (run.model(x).sum() * 0 + float("inf")).backward()  # every gradient 0: finite
            run.optimizer.step()
            run.rec.log(1, batch(1), float("inf"))
        assert run.guard.skipped == ([1] if check else [])
        assert same(run.params(), before if check else exact_sgd(before, [[0.0] * 4, [0.0] * 2, [0.0] * 2, [0.0]]))
        if check:
            skip = run.events()[0]
            assert (skip["reason"], skip["loss"], skip["grad"]) == ("loss", "inf", None)
            assert caplog.records[0].getMessage() == ("nanforensics guard: skipped step 1 (non-finite loss inf); "
                                                      "incident incidents/step_00000001")
        run.rec.close()
        assert (torch.Tensor.backward is torch.Tensor.backward) and run.guard.losses == []


def huge_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def test_an_update_that_would_overflow_the_parameter_is_skipped_and_named(tmp_path, caplog):
    run = Run(tmp_path / "run", make=huge_sgd)
    with torch.no_grad():
        run.model[1].bias.fill_(3e38)
    before = run.params()
    with caplog.at_level(logging.WARNING, logger="nanforensics"):
        run.step(with_value(3, 0, -3e38))
    assert same(run.params(), before) and run.guard.skipped == [0]
    skip = run.events()[0]
    assert (skip["reason"], skip["grad"], skip["update"]) == (
        "update", None, {"tensor": "1.bias", "state": "param", "index": [0], "value": "inf"})
    assert caplog.records[0].getMessage() == (
        "nanforensics guard: skipped step 0 (finite gradients, but the update would make the parameter of 1.bias[0] "
        "inf); incident incidents/step_00000000")
    run.step(FINE)
    assert run.guard.skipped == [0] and not same(run.params(), before)
    assert run.guard.update_check.proof.proven(run.model[0].weight, None, run.model[0].weight)  # known: not read again


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.1)


def test_an_update_that_would_overflow_adams_state_is_skipped_and_named(tmp_path):
    run = Run(tmp_path / "run", make=adam)
    run.step(FINE)
    state = {k: v.clone() for k, v in run.optimizer.state[run.model[0].weight].items()}
    run.step(with_value(0, 1, 1e30))
    assert run.guard.skipped == [1]
    assert all(torch.equal(v, state[k]) for k, v in run.optimizer.state[run.model[0].weight].items())
    skip = run.events()[0]
    assert skip["update"] == {"tensor": "0.weight", "state": "exp_avg_sq", "index": [0, 1], "value": "inf"}
    assert _said(skip) == "finite gradients, but the update would make exp_avg_sq of 0.weight[0, 1] inf"


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.1, fused=True)


def test_fused_adam_takes_the_verdict_on_the_device(tmp_path):
    """The verdict handed to the fused step as ``found_inf`` (and taken away after), each step as the unguarded twin's
    that did not step at the bad one; no proof: the log says once that only the gradients are checked."""
    run = Run(tmp_path / "run", make=fused_adamw)
    twin = build()
    twin_opt = fused_adamw(twin.parameters())
    assert run.guard.update_check is None
    for step, grads in enumerate((FINE, with_value(2, 1, NAN), FINE)):
        run.step(grads)
        assert "found_inf" not in vars(run.optimizer)
        if step != 1:
            for p, g in zip(twin.parameters(), grads):
                p.grad = torch.tensor(g).reshape(p.shape)
            twin_opt.step()
        assert same(run.params(), [p.detach() for p in twin.parameters()])
    run.rec.close()
    log = run.events()
    assert log[0] == {"event": "gradient_check_only", "optimizer": "AdamW", "groups": [0],
                      "why": "its verdict is handed to the fused step on the device"}
    assert [e["step"] for e in log if e["event"] == "skip"] == [1]


def test_a_closure_under_the_fused_step_returns_its_loss(tmp_path):
    run = Run(tmp_path / "run", make=fused_adamw)
    run.grads(with_value(0, 0, NAN))
    before = run.params()
    assert float(run.optimizer.step(lambda: torch.tensor(7.0))) == 7.0
    run.rec.log(0, batch(0), 1.0)
    assert same(run.params(), before) and run.guard.skipped == [0]


def test_a_grad_scaler_decides_its_own_steps(tmp_path):
    """A GradScaler hands a fused optimizer its ``found_inf``: the guard lets the scaler skip (its back-off counted as
    the scaler's), and the losses of that step are its own, not the next step's."""
    model = build()
    optimizer = fused_adamw(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    rec = Recorder(tmp_path / "run", model, optimizer, model_factory=build, step_fn=step_fn, scaler=scaler, guard=True)
    x = torch.ones(3, 2)
    for step in range(3):
        optimizer.zero_grad()
        loss = model(x).sum() * (float("inf") if step == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        assert rec.guard.losses == []
        rec.log(step, batch(step), loss)
    rec.close()
    summary = json.loads((tmp_path / "run" / INCIDENTS / GUARD_LOG).read_text().splitlines()[-1])
    assert (summary["skipped"], summary["scaler_skips"]) == (0, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- the policy's limit, the repeated samples, the incident's name ---------------------------------------------------

def test_a_repeated_sample_is_named_with_the_skip_that_first_held_it(tmp_path, caplog):
    run = Run(tmp_path / "run")
    bad = with_value(0, 0, NAN)
    run.step(bad, b=batch(0, ids=["s1", "s2"]))
    run.step(bad, b={**batch(1), "ids": ["s3", "s2", "s1"], "tag": "t"})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanforensics"):
        run.step(bad, b=batch(2, ids=["s3", "s4"]))
    run.step(bad, b=batch(3, ids=["s5", {"file": "f", "row": 1}]))
    run.step(bad, b=batch(4, ids=[{"row": 1, "file": "f"}]))  # the same id, its keys in another order
    skips = [e for e in run.events() if e["event"] == "skip"]
    assert ["repeats" in e for e in skips] == [False, True, True, False, True]
    assert skips[4]["repeats"] == [{"step": 3, "samples": [{"file": "f", "row": 1}]}]
    assert skips[1]["repeats"] == [{"step": 0, "samples": ["s1", "s2"]}] or \
        skips[1]["repeats"] == [{"step": 0, "samples": ["s2", "s1"]}]
    assert skips[2]["repeats"] == [{"step": 1, "samples": ["s3"]}]
    assert caplog.records[0].getMessage() == ("nanforensics guard: skipped step 2 (non-finite gradient 0.weight[0, 0] "
                                              "= nan; the same samples as step 1); incident incidents/step_00000002")


def test_max_consecutive_skips_stop_the_run_naming_the_newest_incident(tmp_path):
    run = Run(tmp_path / "run", guard=GuardPolicy(max_consecutive=2))
    run.step(with_value(0, 0, NAN))
    with pytest.raises(GuardStop) as stop:
        run.step(with_value(0, 0, NAN))
    assert stop.value.incident == tmp_path / "run" / INCIDENTS / "step_00000001"
    assert str(stop.value) == ("nanforensics guard stopped the run: 2 consecutive steps skipped (max_consecutive=2); "
                               f"replay {stop.value.incident}")
    assert [e["event"] for e in run.events()] == ["skip", "skip", "stop", "summary"]  # the stop closed the recorder
    assert run.events()[2] == {"event": "stop", "step": 1, "why": "2 consecutive steps skipped (max_consecutive=2)",
                               "incident": "incidents/step_00000001"}


def test_an_incident_never_writes_over_a_name_taken(tmp_path):
    run = Run(tmp_path / "run")
    taken = tmp_path / "run" / INCIDENTS / "step_00000000"
    taken.mkdir()
    (taken / "mine").write_text("kept")
    run.step(with_value(0, 0, NAN))
    assert (taken / "mine").read_text() == "kept" and sorted(os.listdir(taken)) == ["mine"]
    assert run.events()[0]["incident"] == "incidents/step_00000000.2"
    assert json.loads((taken.parent / "step_00000000.2" / "incident.json").read_text())["step"] == 0


def test_an_incidents_batches_are_the_recorders_own_from_memory_or_disk(tmp_path):
    """In memory, the ring's batches are written as the recorder writes them to disk: byte for byte the files of a
    twin run that kept every batch on disk, from which its incident copies them."""
    runs = [Run(tmp_path / mode, batches=mode, checkpoint_every=2) for mode in ("memory", "disk")]
    for run in runs:
        for step in range(4):
            run.step(FINE if step < 3 else with_value(0, 0, NAN))
    incidents = [tmp_path / mode / INCIDENTS / "step_00000003" for mode in ("memory", "disk")]
    for incident in incidents:
        assert sorted(p.name for p in (incident / "batches").iterdir()) == [f"step_0000000{s}.safetensors" for s in (2, 3)]
        assert json.loads((incident / "incident.json").read_text())["from_checkpoint"] == 2
        for s in (2, 3):
            assert (incident / "batches" / f"step_0000000{s}.safetensors").read_bytes() == \
                (tmp_path / "disk" / "batches" / f"step_0000000{s}.safetensors").read_bytes()
        assert (incident / "steps.jsonl").read_text().splitlines() == \
            (tmp_path / "disk" / "steps.jsonl").read_text().splitlines()[2:]


ONE = ring_nbytes(snapshot(batch(0)))


@pytest.mark.parametrize("limit, newest", [(3 * ONE, 3), (3 * ONE + 1, 4)])
def test_the_ring_checkpoints_when_it_holds_its_limit_not_a_byte_before(tmp_path, limit, newest):
    run = Run(tmp_path / "run", guard=GuardPolicy(ring_bytes=limit), checkpoint_every=100)
    for _ in range(4):
        run.step(FINE)
    run.rec.close()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == [f"step_{newest:08d}"]


# ---- the state after the step: stop or roll back ---------------------------------------------------------------------

def poison(t: torch.Tensor, at: tuple[int, ...]) -> Callable[[], None]:
    def write() -> None:
        with torch.no_grad():
            t[at] = NAN
    return write


STOPPED = ("left a non-finite parameter or optimizer-state value that no skip could prevent (written after the step, "
           "or by an update the guard's proof does not cover)")


@pytest.mark.parametrize("where", ["param", "state", "both"])
def test_a_nonfinite_value_written_after_the_step_stops_the_run_at_the_check(tmp_path, where):
    """Found at the step the check is due (every second step here), the first by parameter, then by its state; the
    first parameter never had a gradient, so the optimizer holds no state for it."""
    run = Run(tmp_path / "run", make=adam, guard=GuardPolicy(state_check_every=2))
    frozen = [None] + FINE[1:]
    run.step(frozen, after=poison(run.model[0].bias, (0,)) if where == "param" else None)  # not due: not seen yet
    writes = [poison(run.optimizer.state[run.model[1].weight]["exp_avg"], (0, 1))] if where != "param" else []
    writes += [poison(run.model[0].bias, (1,))] if where == "both" else []
    with pytest.raises(GuardStop) as stop:
        run.step(frozen, after=lambda: [w() for w in writes])
    assert run.model[0].weight not in run.optimizer.state
    incident = tmp_path / "run" / INCIDENTS / "step_00000001"
    assert stop.value.incident == incident
    assert str(stop.value) == f"nanforensics guard stopped the run: step 1 {STOPPED}; replay {incident}"
    found = {"tensor": "1.weight", "state": "exp_avg", "rank": 0, "index": [0, 1], "value": "nan"} if where == "state" \
        else {"tensor": "0.bias", "state": "param", "rank": 0, "index": [1 if where == "both" else 0], "value": "nan"}
    entry = {"event": "state_nonfinite", "step": 1, "found": [found], "checked_every": 2,
             "incident": "incidents/step_00000001"}
    assert run.events() == [entry, {"event": "summary", "steps": 2, "skipped": 0, "skipped_steps": [],
                                    "scaler_skips": 0, "rollbacks": [], "incidents": ["incidents/step_00000001"]}]
    meta = json.loads((incident / "incident.json").read_text())
    assert meta == {"format": "nanforensics.incident/1", "kind": "stop", "step": 1, "from_checkpoint": 0,
                    **{k: v for k, v in entry.items() if k != "incident"}}


def test_a_step_skipped_because_the_state_already_was_nonfinite_stops(tmp_path):
    """A NaN written between checks makes the next gradients NaN: no skip helps, the run stops there."""
    run = Run(tmp_path / "run", make=adam, guard=GuardPolicy(state_check_every=100))
    run.step(FINE, after=poison(run.model[1].bias, (0,)))
    with pytest.raises(GuardStop, match=re.escape(f"step 1 {STOPPED}")):
        run.step(with_value(3, 0, NAN))
    assert [e["event"] for e in run.events()] == ["state_nonfinite", "summary"] and run.guard.skipped == []


def test_rollback_restores_the_newest_checkpoints_state_and_goes_on(tmp_path, caplog):
    run = Run(tmp_path / "run", make=adam, checkpoint_every=2,
              guard=GuardPolicy(state_check_every=1, rollback=True, max_consecutive=2))
    run.step(FINE)
    run.step(FINE)
    params, buffers = run.params(), [b.clone() for b in run.model.buffers()]
    state = [{k: v.clone() for k, v in run.optimizer.state[p].items()} for p in run.model.parameters()]
    run.step(with_value(0, 0, 0.125))

    def flaky() -> None:
        poison(run.model[1].bias, (0,))()
        run.model.seen.fill_(5.0)
        run.optimizer.state[run.model[0].weight]["exp_avg"].fill_(9.0)

    with caplog.at_level(logging.INFO, logger="nanforensics"):
        run.step(FINE, after=flaky)
    assert same(run.params(), params) and same([b for b in run.model.buffers()], buffers)
    for p, saved in zip(run.model.parameters(), state):
        now = run.optimizer.state[p]
        assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved)
    assert (run.guard.rollbacks, run.guard.consecutive, run.rec._checkpoints) == ([3], 1, [4])
    assert run.events() == [{"event": "rollback", "step": 3, "found": [
        {"tensor": "1.bias", "state": "param", "rank": 0, "index": [0], "value": "nan"}], "checked_every": 1,
        "incident": "incidents/step_00000003", "rolled_back_to": 2}]
    assert [r.getMessage() for r in caplog.records] == [
        "nanforensics guard: step 3 left a non-finite state value; rolled back to the state before step 2 "
        "(incident incidents/step_00000003)"]
    caplog.clear()
    with pytest.raises(GuardStop, match=r"2 consecutive steps skipped \(max_consecutive=2\)"):
        run.step(FINE, after=flaky)  # a second in a row: rolled back to step 4's copy, then the policy's limit
    assert (caplog.records[-1].levelname, caplog.records[-1].getMessage()) == (
        "WARNING", "nanforensics guard: 5 steps, 0 skipped, 0 skipped by the GradScaler (benign), 2 rolled back; "
                   f"incidents in {tmp_path / 'run' / INCIDENTS}")
    assert same(run.params(), params) and run.guard.rollbacks == [3, 4]
    assert [(e["event"], e.get("rolled_back_to")) for e in run.events()] == [
        ("rollback", 2), ("rollback", 4), ("stop", None), ("summary", None)]
    assert run.events()[2] == {"event": "stop", "step": 4, "why": "2 consecutive steps skipped (max_consecutive=2)",
                               "incident": "incidents/step_00000004"}


# ---- installed and taken away; said once; the summary ---------------------------------------------------------------

def test_close_says_what_was_skipped_once_and_gives_the_step_and_backward_back(tmp_path, caplog):
    backward = torch.Tensor.backward
    runs = [Run(tmp_path / "clean"), Run(tmp_path / "run")]
    assert (tmp_path / "run" / INCIDENTS).is_dir() and torch.Tensor.backward is not backward
    runs[0].step(FINE)
    for grads in (FINE, with_value(0, 0, NAN), FINE, with_value(1, 0, INF)):
        runs[1].step(grads)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nanforensics"):
        for run in runs:
            run.rec.close()
            run.guard.close()
    assert torch.Tensor.backward is backward
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "nanforensics guard: 1 steps, 0 skipped, 0 skipped by the GradScaler (benign), 0 rolled back; "
                 f"incidents in {tmp_path / 'clean' / INCIDENTS}"),
        ("WARNING", "nanforensics guard: 4 steps, 2 skipped (steps 1, 3), 0 skipped by the GradScaler (benign), "
                    f"0 rolled back; incidents in {tmp_path / 'run' / INCIDENTS}")]
    assert runs[0].events() == [{"event": "summary", "steps": 1, "skipped": 0, "skipped_steps": [], "scaler_skips": 0,
                                 "rollbacks": [], "incidents": []}]
    assert runs[1].events()[-1] == {"event": "summary", "steps": 4, "skipped": 2, "skipped_steps": [1, 3],
                                    "scaler_skips": 0, "rollbacks": [],
                                    "incidents": ["incidents/step_00000001", "incidents/step_00000003"]}
    assert [e["event"] for e in runs[1].events()] == ["skip", "skip", "summary"]
    run = runs[1]
    assert "step" not in vars(run.optimizer)
    run.grads(with_value(0, 0, NAN))
    run.optimizer.step()  # the optimizer's own step again: nothing guards it
    assert math.isnan(run.model[0].weight[0, 0].item())


def scheduled(params: Any) -> torch.optim.Optimizer:
    optimizer = sgd(params)
    torch.optim.lr_scheduler.StepLR(optimizer, 1)  # wraps optimizer.step to count its calls
    return optimizer


def test_a_scheduler_made_before_the_recorder_still_counts_the_guarded_steps(tmp_path):
    """The scheduler's counting wrapper is the step the guard calls; a scheduler made after does not wrap the guard
    again; closing puts the wrapper back."""
    run = Run(tmp_path / "run", make=scheduled)
    wrapper = run.guard._original
    installed = vars(run.optimizer)["step"]
    assert installed is not wrapper and getattr(wrapper, "_wrapped_by_lr_sched", False)
    torch.optim.lr_scheduler.StepLR(run.optimizer, 1)
    assert vars(run.optimizer)["step"] is installed
    run.optimizer._opt_called = False
    run.step(FINE)
    assert run.optimizer._opt_called and run.guard.skipped == []
    run.step(with_value(0, 0, NAN))
    assert run.guard.skipped == [1]
    run.rec.close()
    assert vars(run.optimizer)["step"] is wrapper


def test_a_scheduler_made_after_the_recorder_wraps_the_guard(tmp_path):
    run = Run(tmp_path / "run")
    installed = vars(run.optimizer)["step"]
    assert not hasattr(installed, "_wrapped_by_lr_sched")
    torch.optim.lr_scheduler.StepLR(run.optimizer, 1)
    assert vars(run.optimizer)["step"] is not installed
    run.step(with_value(0, 0, NAN))
    assert run.guard.skipped == [0]


def adam_l2(params: Any) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}], lr=0.1)


def test_what_the_proof_cannot_cover_is_said_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="nanforensics"):
        run = Run(tmp_path / "run", make=adam_l2)
        Run(tmp_path / "plain", make=adam)
    why = ("the update's proof knows Adam, AdamW and SGD (not a subclass, not sharded) without L2 weight decay, fused, "
           "capturable or differentiable steps")
    assert run.events() == [{"event": "gradient_check_only", "optimizer": "Adam", "groups": [1], "why": why}]
    assert [r.getMessage() for r in caplog.records if "guard" in r.getMessage()] == [
        f"nanforensics guard: Adam, groups [1]: gradients (and the loss) checked alone, not the update: {why}"]
    assert not (tmp_path / "plain" / INCIDENTS / GUARD_LOG).exists()


# ---- the words and the samples ----------------------------------------------------------------------------------------

def test_the_skip_in_words():
    update = {"tensor": "w", "index": [1, 2], "value": "-inf"}
    assert _said({"reason": "update", "update": {**update, "state": "param"}}) == \
        "finite gradients, but the update would make the parameter of w[1, 2] -inf"
    assert _said({"reason": "update", "update": {**update, "state": "momentum_buffer"}}) == \
        "finite gradients, but the update would make momentum_buffer of w[1, 2] -inf"
    assert _said({"reason": "loss", "loss": "nan"}) == "non-finite loss nan"
    assert _said({"reason": "gradient", "grad": {"tensor": "b", "index": [0], "value": "inf"}}) == \
        "non-finite gradient b[0] = inf"
    assert _said({"reason": "gradient", "grad": None}) == _said({}) == "a non-finite gradient"


def test_the_samples_of_a_batch_that_hold_a_nonfinite_value():
    x = torch.zeros(4, 2, 3)
    x[2, 1, 0], x[0, 0, 2] = NAN, -INF
    batch = {"x": x, "scalar": torch.tensor(INF), "fine": torch.ones(3), "ids": torch.arange(3),
             "empty": torch.empty(0, 2), "half": torch.tensor([[1.0], [INF]], dtype=torch.float16), "s": ["a", "b"]}
    assert _nonfinite_samples(batch) == {"batch['x']": [0, 2], "batch['scalar']": [0], "batch['half']": [1]}
    assert _nonfinite_samples({"ok": torch.ones(2, 2)}) == {}


def test_a_checkpoint_file_is_linked_where_it_can_be_and_copied_where_not(tmp_path):
    src = tmp_path / "a"
    src.write_bytes(b"state")
    _link_or_copy(str(src), str(tmp_path / "b"))
    assert (tmp_path / "b").stat().st_ino == src.stat().st_ino
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system to copy across")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        _link_or_copy(str(src), os.path.join(other, "c"))
        copied = os.stat(os.path.join(other, "c"))
        assert copied.st_ino != src.stat().st_ino and Path(other, "c").read_bytes() == b"state"
        assert copied.st_mtime == src.stat().st_mtime  # copy2: the file's times too


class Phases(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.z = nn.Parameter(torch.zeros(2, dtype=torch.cfloat))


def test_a_complex_gradient_that_skips_the_step_is_the_one_named(tmp_path):
    """The update's check reads a complex gradient's magnitudes: the record names it (it once named floating point
    gradients alone, and a skip for a complex one said no tensor)."""
    model = Phases()
    optimizer = sgd(model.parameters())
    rec = Recorder(tmp_path / "run", model, optimizer, model_factory=Phases, step_fn=step_fn, guard=True)
    model.w.grad, model.z.grad = torch.ones(2), torch.tensor([0j, complex(0.0, NAN)])
    optimizer.step()
    rec.log(0, batch(0), 1.0)
    rec.close()
    skip = json.loads((tmp_path / "run" / INCIDENTS / GUARD_LOG).read_text().splitlines()[0])
    assert (skip["reason"], skip["grad"]) == ("gradient", {"tensor": "z", "index": [1], "value": "nan", "rank": 0})
    assert not model.z.any() and not model.w.any()


class CountingSGD(torch.optim.SGD):
    """An optimizer whose state holds a Python number beside its tensors (the steps each parameter took)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        out = super().step(closure)
        for p in (p for group in self.param_groups for p in group["params"] if p.grad is not None):
            self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
        return out


def counting_sgd(params: Any) -> torch.optim.Optimizer:
    return CountingSGD(params, lr=0.5, momentum=0.5)


def test_rollback_restores_state_that_is_not_a_tensor(tmp_path):
    run = Run(tmp_path / "run", make=counting_sgd, checkpoint_every=2, guard=GuardPolicy(state_check_every=1,
                                                                                          rollback=True))
    run.step(FINE)
    run.step(FINE)
    params = run.params()
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in run.optimizer.state[p].items()}
             for p in run.model.parameters()]
    run.step(FINE, after=poison(run.model[0].weight, (1, 1)))
    assert run.guard.rollbacks == [2] and same(run.params(), params)
    for p, saved in zip(run.model.parameters(), state):
        assert run.optimizer.state[p]["calls"] == saved["calls"] == 2
        assert torch.equal(run.optimizer.state[p]["momentum_buffer"], saved["momentum_buffer"])
    run.step(FINE)
    assert [run.optimizer.state[p]["calls"] for p in run.model.parameters()] == [3] * 4


def test_a_watched_backward_passes_its_arguments_on(tmp_path):
    """The guard keeps each scalar ``backward()`` runs from; the call itself is the user's, its arguments intact."""
    run = Run(tmp_path / "run")
    loss = run.model(torch.ones(3, 2)).sum()
    want = [3 * g for g in torch.autograd.grad(loss, list(run.model.parameters()), retain_graph=True)]
    loss.backward(torch.tensor(2.0), retain_graph=True)  # the graph kept: a second backward through it works
    loss.backward(gradient=torch.tensor(1.0))
    assert same([p.grad for p in run.model.parameters()], want) and len(run.guard.losses) == 2



def test_an_optimizer_holding_no_parameter_is_guarded_on_the_cpu(tmp_path):
    """A frozen model's optimizer (one empty group): nothing to check, the steps are recorded as they come."""
    model = build()
    optimizer = torch.optim.SGD([{"params": []}], lr=0.1)
    rec = Recorder(tmp_path / "run", model, optimizer, model_factory=build, step_fn=step_fn, guard=True)
    OPEN.append(types.SimpleNamespace(rec=rec))
    assert rec.guard.device == torch.device("cpu")
    optimizer.step()
    rec.log(0, batch(0), 1.0)
    assert rec.guard.skipped == [] and rec.guard.steps == 1
