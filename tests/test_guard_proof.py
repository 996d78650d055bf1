"""The guard's proof (replay/proof.py ``UpdateCheck``, issue 33): before a step whose gradients are finite, it says
whether the real optimizer's step would make a non-finite state or parameter value. Enumerated over gradient
magnitudes from denormal to float32's largest, each dtype the optimizers support, their settings and the state's
history: whenever it lets a step through, the real step leaves everything finite; whenever it names a hazard, the real
step makes that non-finite value (so a healthy step is never skipped)."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any, Callable

import pytest
import torch
from nanforensics.replay.proof import UpdateCheck

MAGNITUDES = [0.0, 1e-45, 1e-40, 1e-8, 1.0, 6e4, 1e19, 6e20, 1e30, 4e37, 3.4e38]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "adamw_decay": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_eps0": lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=0.0),
    "adam_lr1_betas0": lambda ps: torch.optim.Adam(ps, lr=1.0, betas=(0.0, 0.5)),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9, nesterov=True),
}
HISTORY = [None, 1.0, 1e30, 3e38]  # fresh state, or one step before with gradients of this magnitude


def _grad(magnitude: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([magnitude, -magnitude / 2, 1e-3], dtype=dtype)


def _finite(opt: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    tensors = [p] + [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _case(setting: str, dtype: torch.dtype, history: float | None, g: float, scale: float) -> tuple[Any, bool, Any]:
    p = torch.tensor([0.5, -0.25, 1.0], dtype=dtype) * scale
    opt = SETTINGS[setting]([p])
    if history is not None:
        p.grad = _grad(history, dtype)
        opt.step()
    if not all(bool(torch.isfinite(t).all()) for t in [p, *opt.state[p].values()]):
        return None, True, None  # the history itself overflowed: not a case of a step from finite values
    p.grad = _grad(g, dtype)
    if not bool(torch.isfinite(p.grad).all()):
        return None, True, None  # a non-finite gradient is the gradient check's
    check = UpdateCheck(opt)
    twin_p = p.detach().clone()
    twin = SETTINGS[setting]([twin_p])
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin_p.grad = p.grad.clone()
    hazard = check.hazard({p: float(p.grad.abs().max())})
    twin.step()
    return hazard, _finite(twin, twin_p), (check, twin, twin_p)


CASES = list(itertools.product(SETTINGS, DTYPES, HISTORY, MAGNITUDES, [1.0, 1e30]))


def test_the_proof_lets_through_exactly_the_finite_steps():
    """Both directions, over every case; and not vacuous: most healthy steps are decided by the proof alone (no copy
    of the step), and every setting meets a hazard somewhere."""
    decided, hazards, trials = 0, set(), 0
    for setting, dtype, history, g, scale in CASES:
        hazard, finite, extra = _case(setting, dtype, history, g, scale)
        if extra is None:
            continue
        decided += 1
        check, twin, twin_p = extra
        trials += check.trials
        where = (setting, dtype, history, g, scale)
        if hazard is None:
            assert finite, where
        else:
            assert not finite, where
            t = twin_p if hazard.state == "param" else twin.state[twin_p][hazard.state]
            assert not math.isfinite(float(t[tuple(hazard.index)])), where  # the coordinate it names
            hazards.add(setting)
    assert decided > 700
    assert trials < decided / 2
    assert hazards == set(SETTINGS)


def test_the_issue_case_v_overflows_from_a_finite_gradient():
    """Adam's v = b2 v + (1-b2) g^2 at g = 4e37 (the loss inf, every gradient finite): named as exp_avg_sq."""
    p = torch.zeros(3)
    opt = torch.optim.Adam([p])
    p.grad = torch.tensor([1.0, 4e37, 2.0])
    hazard = UpdateCheck(opt).hazard({p: 4e37})
    assert hazard is not None and (hazard.param, hazard.state, hazard.index, hazard.value) == (0, "exp_avg_sq", [1], "inf")
    assert not opt.state  # the check wrote nothing


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, weight_decay=0.1),
                                  lambda ps: torch.optim.Adam(ps, fused=True)],
                         ids=["adam_l2", "adam_fused"])
def test_groups_the_proof_does_not_cover_are_said(make):
    p = torch.zeros(3)
    opt = make([p])
    check = UpdateCheck(opt)
    assert check.uncovered() == [0]
    p.grad = torch.full((3,), 4e37)
    assert check.hazard({p: 4e37}) is None and check.trials == 0  # the gradient check alone
