"""The guard's three reasons to skip (issue 33): a non-finite gradient, a non-finite loss, and an update that would make
a non-finite state or parameter value from finite gradients (the replay's proof, replay/proof.py). An MLP with Adam
meets four rare bad batches; the run ends bit-identical to the loop that did not step at them, and the log names why
each was skipped."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from nanforensics import Recorder
from nanforensics.runs.guard import GUARD_LOG, INCIDENTS, GuardPolicy, _sum_flag, nonfinite_flag
from torch import nn

from conftest import run_cli
from guard_training import loop, mlp_step
from test_guard import one_thread  # noqa: F401 - its autouse fixture: these models are tiny

STEPS, BAD = 300, 5
DEFECTS = {41: "huge_gradient", 97: "inf_input", 180: "huge_value", 233: "huge_target"}
REASONS = {"huge_gradient": "update", "inf_input": "gradient", "huge_value": "gradient", "huge_target": "loss"}


def build_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))


def make_batch(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) / 2
    defect = DEFECTS.get(step)
    if defect == "huge_gradient":   # the loss about 1e22, the gradients about 1e22: finite, but Adam's g^2 is not
        x[BAD] = 1e12
    elif defect == "inf_input":
        x[BAD, 2] = float("inf")
    elif defect == "huge_value":    # the square of the error overflows, and its gradient with it
        x[BAD, 0] = 1e30
    elif defect == "huge_target":   # the loss inf, every gradient finite (about 4e37): the case
        y[BAD, 0] = 1e38  # (3e38 in the issue; here 2 * 3e38 in pow's backward would overflow first)
    return {"x": x, "y": y, "ids": [f"s{step:03d}-{i}" for i in range(8)]}


def train(run: Path | None, make_opt: Callable[[Any], torch.optim.Optimizer], steps: int = STEPS,
          skip: tuple[int, ...] = (), defects: bool = True, policy: GuardPolicy | None = None,
          dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build_mlp().to(dtype)
    opt = make_opt(model.parameters())
    policy = policy or GuardPolicy(max_skip_fraction=0.05)
    rec = Recorder(run, model, opt, model_factory=build_mlp, step_fn=mlp_step, guard=policy, batches="memory",
                   checkpoint_every=100) if run is not None else None
    batches = ((step, make_batch(step if defects else step + 1000)) for step in range(steps))
    loop(rec, model, opt, mlp_step, ((s, {**b, "x": b["x"].to(dtype), "y": b["y"].to(dtype)}) for s, b in batches), skip)
    return model, opt


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / INCIDENTS / GUARD_LOG).read_text().splitlines()]


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _same(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    for (name, got), want in zip(a[0].state_dict().items(), b[0].state_dict().values()):
        assert torch.isfinite(got).all() and torch.equal(got, want), name
    for p, q in zip(a[0].parameters(), b[0].parameters()):
        sa, sb = a[1].state[p], b[1].state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_four_bad_batches_skipped_bit_for_bit_each_with_its_reason(tmp_path):
    run = tmp_path / "run"
    guarded = train(run, adam)
    _same(guarded, train(None, adam, skip=tuple(DEFECTS)))
    skips = {e["step"]: e for e in events(run) if e["event"] == "skip"}
    assert {s: e["reason"] for s, e in skips.items()} == {s: REASONS[d] for s, d in DEFECTS.items()}
    update = skips[41]["update"]
    assert update["state"] == "exp_avg_sq" and update["value"] == "inf" and update["tensor"] in ("0.weight", "2.weight")
    assert skips[233]["loss"] == "inf" and skips[233]["grad"] is None
    assert skips[97]["grad"]["value"] in ("nan", "inf", "-inf")
    incident = json.loads((run / INCIDENTS / "step_00000041" / "incident.json").read_text())
    assert incident["reason"] == "update" and incident["update"] == update
    out = tmp_path / "report.json"  # the incident replays the step the guard skipped, unguarded: the same coordinate
    assert run_cli("replay", run / INCIDENTS / "step_00000041", "--json", out).code == 1
    origin = json.loads(out.read_text())["origin"]
    assert (origin["step"], origin["stage"], origin["state_key"], origin["tensor"], origin["index"]) == (
        41, "optimizer_state", "exp_avg_sq", update["tensor"], update["index"])


def test_without_the_loss_check_the_proof_skips_the_overflowing_target(tmp_path):
    """The issue's run: a target of 1e38 makes every gradient finite and Adam's v inf; with the loss check off the
    proof still skips it, naming exp_avg_sq."""
    run = tmp_path / "run"
    train(run, adam, steps=240, policy=GuardPolicy(max_skip_fraction=0.05, skip_nonfinite_loss=False))
    skip = next(e for e in events(run) if e["event"] == "skip" and e["step"] == 233)
    assert skip["reason"] == "update" and skip["update"]["state"] == "exp_avg_sq"


OPTIMIZERS = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2), torch.float32),
    "adam_l2": (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2), torch.float32),
    "amsgrad": (lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True), torch.float32),
    "sgd_nesterov": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True), torch.float32),
    "adamw_bf16": (lambda ps: torch.optim.AdamW(ps, lr=1e-2), torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_healthy_runs_are_never_skipped(tmp_path, name):
    make, dtype = OPTIMIZERS[name]
    run = tmp_path / "run"
    model, _ = train(run, make, steps=150, defects=False, dtype=dtype)
    log = events(run)
    assert log[-1]["skipped"] == 0 and all(torch.isfinite(p).all() for p in model.parameters())
    covered = [e for e in log if e["event"] == "gradient_check_only"]
    assert [e["groups"] for e in covered] == ([[0]] if name == "adam_l2" else [])  # said where the proof cannot go


class TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).to(torch.bfloat16)).float()


@pytest.mark.parametrize("fused", [False, True], ids=["proof", "device"])
def test_the_flag_combines_every_dtype_group(tmp_path, fused):
    """A NaN in the float32 layer's gradient beside a finite bfloat16 layer: skipped (a flag that kept only the last
    (device, dtype) group's verdict would step)."""
    model = TwoDtypes()
    opt = torch.optim.AdamW(model.parameters(), fused=fused or None)
    rec = Recorder(tmp_path / "run", model, opt, model_factory=TwoDtypes, step_fn=mlp_step, guard=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    model.a.weight.grad[1, 2] = float("nan")
    opt.step()
    rec.log(0, {"x": torch.zeros(1)}, 0.0)
    rec.close()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert events(tmp_path / "run")[-1]["skipped_steps"] == [0]


def test_nonfinite_flag_over_groups():
    """The device check itself, each group in either place."""
    finite = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16)]
    for i in range(2):
        bad = [t.clone() for t in finite]
        bad[i][0] = float("nan")
        assert float(nonfinite_flag(bad, torch.device("cpu"))) == 1.0
    assert float(nonfinite_flag(finite, torch.device("cpu"))) == 0.0


@pytest.mark.parametrize("kinds", [k for n in range(4) for k in itertools.product(["finite", "nan", "inf", "huge"], repeat=n)])
def test_the_state_screen_flags_exactly_when_a_sum_is_nonfinite(kinds):
    """The screen of the state after a step over every mix of up to three tensors, a state whose every tensor sums
    non-finite included: a sum of finite values past float32's largest flags too (the host then settles it); an
    integer or empty tensor is no part of it."""
    value = {"finite": 1.5, "nan": float("nan"), "inf": float("-inf"), "huge": 3e38}
    tensors = [torch.full((2,), value[k], dtype=torch.float64 if i % 2 else torch.float32) for i, k in enumerate(kinds)]
    tensors += [torch.full((2,), 7, dtype=torch.int64), torch.empty(0)]
    assert float(_sum_flag(tensors, torch.device("cpu"))) == float(any(k != "finite" for k in kinds))

